from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

from vllm_ascend import device


@RotaryEmbedding.register_oot(name="RotaryEmbedding")
class AscendRotaryEmbedding(RotaryEmbedding):
    """Plain (unscaled) RoPE through the device's rotary kernel."""

    def forward_oot(self, positions, query, key=None):
        cos_sin_cache = self._match_cos_sin_cache_dtype(query)
        return device.current.rotary_embedding(positions, query, key, cos_sin_cache,
                                               self.head_size, self.is_neox_style)
