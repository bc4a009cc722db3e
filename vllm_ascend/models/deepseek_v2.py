"""DeepSeek-V2/V3: upstream's model, whose MLA layers vLLM builds with the Ascend MLA layer
(ops/mla.py: norm, RoPE and the KV write fused, attention on the latent cache) and whose MoE
layers run on the fused-MoE operators (ops/fused_moe/). The MLA layers share one set of step
cos/sin rows, in the half layout the interleave-rope operators take."""

from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

from vllm_ascend.models.common import attach_step_rope
from vllm_ascend.ops.mla import AscendMultiHeadLatentAttention


class AscendDeepseekV2ForCausalLM(DeepseekV2ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        attach_step_rope(self, vllm_config, AscendMultiHeadLatentAttention, half_layout=True)


class AscendDeepseekV3ForCausalLM(DeepseekV3ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        attach_step_rope(self, vllm_config, AscendMultiHeadLatentAttention, half_layout=True)
