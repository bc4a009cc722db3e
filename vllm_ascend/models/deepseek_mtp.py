"""DeepSeek's MTP draft layers (vLLM's "mtp" speculative method on a DeepSeek-V3 checkpoint):
upstream's model, whose MLA layer is the Ascend one (ops/mla.py) and shares step cos/sin rows
like the target's."""

from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP

from vllm_ascend.models.common import attach_step_rope
from vllm_ascend.ops.mla import AscendMultiHeadLatentAttention


class AscendDeepSeekMTP(DeepSeekMTP):
    # vLLM compiles this class at its top level (support_torch_compile sets its __call__), which
    # runs no forward hooks, so the runner's pre-hook cannot fill its step rows: its call does.
    fills_step_ropes = True

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._rope_rows = attach_step_rope(self, vllm_config, AscendMultiHeadLatentAttention,
                                           half_layout=True)

    def __call__(self, *args, **kwargs):
        # In the call, so that a FULL draft graph captures the gather (as the runner's hook).
        self._rope_rows.update(kwargs["positions"])
        return super().__call__(*args, **kwargs)
