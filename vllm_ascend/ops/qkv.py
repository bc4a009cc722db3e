"""QKV split + q/k RMSNorm + RoPE as one fused op, with cos/sin gathered once per step.

``StepRope`` holds static cos/sin buffers. The runner fills them from the step's positions before
the forward (outside any graph), so every layer reads the same gathered rows instead of
gathering per layer, and FULL graphs read them at their captured address.
"""

import torch

from vllm_ascend import device
from vllm_ascend.device.base import full_width_cos_sin


class StepRope:
    """cos/sin rows of the step's positions, full rotary width, in the rope's own layout
    (neox: halves repeated; GPT-J: pairs interleaved), so a rotation is x*cos + rot(x)*sin."""

    def __init__(self):
        self.cache: torch.Tensor | None = None  # [max_position, rot_dim]: cos | sin halves
        self.is_neox = True
        self.cos: torch.Tensor | None = None  # [max_num_tokens, rot_dim]
        self.sin: torch.Tensor | None = None

    def attach(self, rope, max_num_tokens: int) -> None:
        """Use ``rope``'s table; allocate the step buffers (once per model)."""
        cache = rope.cos_sin_cache
        if self.cache is not None and self.cache is not cache and not (
                torch.equal(self.cache, cache) and self.is_neox == rope.is_neox_style):
            raise ValueError("vllm-ascend's fused RoPE expects one rotary table per model; "
                             "this model has layers with different RoPE parameters")
        if self.cache is None or self.cos.shape[0] < max_num_tokens:
            self.cos = torch.zeros(max_num_tokens, cache.shape[-1], dtype=cache.dtype,
                                   device=cache.device)
            self.sin = torch.zeros_like(self.cos)
        self.cache, self.is_neox = cache, rope.is_neox_style

    def update(self, positions: torch.Tensor) -> None:
        if self.cache is None:
            return
        n = positions.shape[0]
        cos, sin = full_width_cos_sin(
            *self.cache.index_select(0, positions.flatten()).chunk(2, dim=-1), self.is_neox)
        self.cos[:n].copy_(cos)
        self.sin[:n].copy_(sin)

    def get(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:n].to(dtype), self.sin[:n].to(dtype)

    def reset(self) -> None:
        self.cache = self.cos = self.sin = None


STEP_ROPE = StepRope()


def split_qkv_norm_rope(qkv, q_size, kv_size, head_size, positions, rope, q_norm=None,
                        k_norm=None):
    """(q, k, v) from a fused QKV projection: split, optional per-head q/k RMSNorm, RoPE."""
    cos, sin = STEP_ROPE.get(qkv.shape[0], qkv.dtype)
    return device.current.split_qkv_norm_rope(
        qkv, q_size, kv_size, head_size, q_norm.weight if q_norm is not None else None,
        k_norm.weight if k_norm is not None else None,
        q_norm.variance_epsilon if q_norm is not None else 0.0, cos, sin, STEP_ROPE.is_neox)


def split_qkv_norm_rope_reference(qkv, q_size, kv_size, head_size, positions, rope, q_norm=None,
                                  k_norm=None):
    """The unfused sequence upstream runs: split, RMSNorm per head, RotaryEmbedding."""
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    if q_norm is not None:
        q = q_norm.forward_native(q.unflatten(-1, (-1, head_size))).flatten(-2)
        k = k_norm.forward_native(k.unflatten(-1, (-1, head_size))).flatten(-2)
    q, k = rope.forward_native(positions, q, k)
    return q, k, v
