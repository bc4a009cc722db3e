"""Llama (and SmolLM2): upstream's model; attention with the fused QKV split + RoPE.

The residual add is fused into RMSNorm and gate/up into SwiGLU by the CustomOps in ops/, which
upstream's layers already call; only the attention forward changes here.
"""

from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

from vllm_ascend.models.common import (attach_step_rope, fuse_norms_into_quantization,
                                       fused_attention_forward)


class AscendLlamaAttention(LlamaAttention):
    def forward(self, positions, hidden_states):
        return fused_attention_forward(self, positions, hidden_states)


class AscendLlamaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, attn_layer_type=AscendLlamaAttention, **kwargs)


class AscendLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix,
                         layer_type=AscendLlamaDecoderLayer)
        attach_step_rope(self, vllm_config)
        fuse_norms_into_quantization(self)
