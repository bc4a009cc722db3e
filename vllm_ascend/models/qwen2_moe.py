"""Qwen2-MoE: upstream's model; attention with the fused QKV split + RoPE. Routed experts run on
the fused-MoE operators through the MoE CustomOp (ops/fused_moe/); the shared expert, gated by
its sigmoid gate, is vLLM's dense MLP (whose gate/up run fused into SwiGLU), added to the routed
output by vLLM's MoE runner, as HF adds it."""

from vllm.model_executor.models.qwen2_moe import Qwen2MoeAttention, Qwen2MoeForCausalLM

from vllm_ascend.models.common import (attach_step_rope, fuse_norms_into_quantization,
                                       fused_attention_forward, use_attention_class)


class AscendQwen2MoeAttention(Qwen2MoeAttention):
    def forward(self, positions, hidden_states):
        return fused_attention_forward(self, positions, hidden_states)


class AscendQwen2MoeForCausalLM(Qwen2MoeForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        use_attention_class(self, Qwen2MoeAttention, AscendQwen2MoeAttention)
        attach_step_rope(self, vllm_config)
        fuse_norms_into_quantization(self)
