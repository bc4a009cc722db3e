import torch
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.yarn_scaling_rope import (
    YaRNScalingRotaryEmbedding)

from vllm_ascend.device import torch_npu
from vllm_ascend.ops.qkv import StepRope, rotate_heads

MROPE_ALIGN = 32  # npu_mrope: head_size and rotary_dim multiples of 32 for fp16/bf16


class AscendRope:
    """RoPE on a cos/sin table (the subclass's: plain, or YaRN-scaled). With the step's cos/sin
    rows gathered once per step (``step_rope``, given by share_step_ropes), npu_rotary_mul on
    them, as upstream's rotary_embedding.py reads its ``update_cos_sin`` rows; otherwise npu_mrope
    with no multimodal sections (upstream's path where Triton is unavailable), which gathers in
    every layer. Sizes npu_mrope does not take (a partial rotary dim of 16, as GLM-4's with
    32-wide heads) run upstream's unfused torch version, as upstream's Triton kernel covers
    them."""

    step_rope: StepRope | None = None  # shared by the layers reading one rotary table

    def takes_fused_sizes(self) -> bool:
        return not (self.head_size % MROPE_ALIGN or self.rotary_dim % MROPE_ALIGN)

    def forward_oot(self, positions, query, key=None):
        if not self.takes_fused_sizes():
            return self.forward_native(positions, query, key)
        tokens = positions.numel()
        if self.step_rope is not None and key is not None:
            cos, sin = self.step_rope.get(tokens)
            mode = "half" if self.step_rope.is_neox else "interleave"
            q = rotate_heads(query.view(1, tokens, -1, self.head_size), cos, sin, mode)
            k = rotate_heads(key.view(1, tokens, -1, self.head_size), cos, sin, mode)
            return q.view(query.shape), k.view(key.shape)
        cos_sin_cache = self._match_cos_sin_cache_dtype(query)
        key_2d = key.reshape(tokens, -1) if key is not None else query.new_empty(tokens, 0)
        q, k = torch_npu.npu_mrope(
            positions.flatten().contiguous(), query.reshape(tokens, -1).contiguous(),
            key_2d.contiguous(), cos_sin_cache, self.head_size, mrope_section=[0, 0, 0],
            rotary_mode="half" if self.is_neox_style else "interleaved")
        return q.view(query.shape), (k.view(key.shape) if key is not None else None)


@RotaryEmbedding.register_oot(name="RotaryEmbedding")
class AscendRotaryEmbedding(AscendRope, RotaryEmbedding):
    """Plain (unscaled) RoPE."""


@YaRNScalingRotaryEmbedding.register_oot(name="YaRNScalingRotaryEmbedding")
class AscendYaRNScalingRotaryEmbedding(AscendRope, YaRNScalingRotaryEmbedding):
    """YaRN (GPT-OSS): only its table differs, so the same rotation, as upstream's
    AscendYaRNRotaryEmbedding calls AscendRotaryEmbedding.forward_oot."""


def share_step_ropes(model: torch.nn.Module, max_num_tokens: int, dtype: torch.dtype,
                     existing: list[StepRope]) -> None:
    """Give each rotary table of ``model`` that AscendRotaryEmbedding rotates one StepRope (the
    runner fills it before each forward), reusing one of ``existing`` on the same table (a model
    file's). Then every family's layers read the rows gathered once per step, with or without a
    model file."""
    for rope in existing:
        rope.reserve(max_num_tokens)
    by_table = {(id(s.cache), s.is_neox): s for s in existing}
    for module in model.modules():
        if isinstance(module, AscendRope) and module.takes_fused_sizes() and \
                module.step_rope is None:
            key = (id(module.cos_sin_cache), module.is_neox_style)
            if key not in by_table:
                by_table[key] = StepRope()
                by_table[key].attach(module, max_num_tokens, dtype)
            module.step_rope = by_table[key]
