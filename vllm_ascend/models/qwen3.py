"""Qwen3: upstream's model; attention with the fused QKV split + q/k RMSNorm + RoPE."""

from vllm.model_executor.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM

from vllm_ascend.models.common import (attach_step_rope, fuse_norms_into_quantization,
                                       fused_attention_forward, use_attention_class)


class AscendQwen3Attention(Qwen3Attention):
    def forward(self, positions, hidden_states):
        return fused_attention_forward(self, positions, hidden_states, self.q_norm, self.k_norm)


class AscendQwen3ForCausalLM(Qwen3ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        use_attention_class(self, Qwen3Attention, AscendQwen3Attention)
        attach_step_rope(self, vllm_config)
        fuse_norms_into_quantization(self)
