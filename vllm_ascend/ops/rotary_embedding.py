from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

from vllm_ascend.device import torch_npu

MROPE_ALIGN = 32  # npu_mrope: head_size and rotary_dim multiples of 32 for fp16/bf16


@RotaryEmbedding.register_oot(name="RotaryEmbedding")
class AscendRotaryEmbedding(RotaryEmbedding):
    """Plain (unscaled) RoPE through npu_mrope with no multimodal sections: upstream's
    rotary_embedding.py path where Triton is unavailable. Handles a partial rotary dim (the
    cache's width) itself. Sizes npu_mrope does not take (a partial rotary dim of 16, as
    GLM-4's with 32-wide heads) run upstream's unfused torch version, as upstream's Triton
    kernel covers them."""

    def forward_oot(self, positions, query, key=None):
        if self.head_size % MROPE_ALIGN or self.rotary_dim % MROPE_ALIGN:
            return self.forward_native(positions, query, key)
        cos_sin_cache = self._match_cos_sin_cache_dtype(query)
        tokens = positions.numel()
        key_2d = key.reshape(tokens, -1) if key is not None else query.new_empty(tokens, 0)
        q, k = torch_npu.npu_mrope(
            positions.flatten().contiguous(), query.reshape(tokens, -1).contiguous(),
            key_2d.contiguous(), cos_sin_cache, self.head_size, mrope_section=[0, 0, 0],
            rotary_mode="half" if self.is_neox_style else "interleaved")
        return q.view(query.shape), (k.view(key.shape) if key is not None else None)
