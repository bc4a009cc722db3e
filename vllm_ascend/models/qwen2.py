"""Qwen2: upstream's model; attention with the fused QKV split (+ optional q/k norm) + RoPE."""

from vllm.model_executor.models.qwen2 import Qwen2Attention, Qwen2ForCausalLM

from vllm_ascend.models.common import (attach_step_rope, fuse_norms_into_quantization,
                                       fused_attention_forward, use_attention_class)


class AscendQwen2Attention(Qwen2Attention):
    def forward(self, positions, hidden_states):
        norms = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        return fused_attention_forward(self, positions, hidden_states, *norms)


class AscendQwen2ForCausalLM(Qwen2ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        use_attention_class(self, Qwen2Attention, AscendQwen2Attention)
        attach_step_rope(self, vllm_config)
        fuse_norms_into_quantization(self)
