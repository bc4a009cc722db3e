"""Qwen3-MoE: upstream's model; attention with the fused QKV split + q/k RMSNorm + RoPE. Its
experts run on the fused-MoE operators through the MoE CustomOp (ops/fused_moe/), which vLLM's
sparse MoE block instantiates; routing renormalises the top-k probabilities when the config's
``norm_topk_prob`` says so, as HF does."""

from vllm.model_executor.models.qwen3_moe import Qwen3MoeAttention, Qwen3MoeForCausalLM

from vllm_ascend.models.common import (attach_step_rope, fuse_norms_into_quantization,
                                       fused_attention_forward, use_attention_class)


class AscendQwen3MoeAttention(Qwen3MoeAttention):
    def forward(self, positions, hidden_states):
        return fused_attention_forward(self, positions, hidden_states, self.q_norm, self.k_norm)


class AscendQwen3MoeForCausalLM(Qwen3MoeForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        use_attention_class(self, Qwen3MoeAttention, AscendQwen3MoeAttention)
        attach_step_rope(self, vllm_config)
        fuse_norms_into_quantization(self)
