"""DeepSeek's MTP draft layers (vLLM's "mtp" speculative method on a DeepSeek-V3 checkpoint):
upstream's model, whose MLA layer is the Ascend one (ops/mla.py) and shares step cos/sin rows
like the target's. The runner fills them before each draft step (worker/model_runner.py)."""

from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP

from vllm_ascend.models.common import attach_step_rope
from vllm_ascend.ops.mla import AscendMultiHeadLatentAttention


class AscendDeepSeekMTP(DeepSeekMTP):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        attach_step_rope(self, vllm_config, AscendMultiHeadLatentAttention, half_layout=True)
