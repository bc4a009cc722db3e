"""QKV split + q/k RMSNorm + RoPE as one fused op, with cos/sin gathered once per step.

``StepRope`` holds static cos/sin buffers. The runner fills them from the step's positions before
the forward (outside any graph), so every layer reads the same gathered rows instead of
gathering per layer, and FULL graphs read them at their captured address.
"""

import torch

from vllm_ascend import device


class StepRope:
    def __init__(self):
        self.cache: torch.Tensor | None = None  # [max_position, rot_dim]: cos | sin halves
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def attach(self, rope, max_num_tokens: int) -> None:
        """Use ``rope``'s table; allocate the step buffers (once per model)."""
        cache = rope.cos_sin_cache
        if self.cache is not None and self.cache is not cache and not torch.equal(
                self.cache, cache):
            raise ValueError("vllm-ascend's fused RoPE expects one rotary table per model; "
                             "this model has layers with different RoPE parameters")
        if self.cache is None or self.cos.shape[0] < max_num_tokens:
            half = cache.shape[-1] // 2
            self.cos = torch.zeros(max_num_tokens, half, dtype=cache.dtype, device=cache.device)
            self.sin = torch.zeros_like(self.cos)
        self.cache = cache

    def update(self, positions: torch.Tensor) -> None:
        if self.cache is None:
            return
        n = positions.shape[0]
        rows = self.cache.index_select(0, positions.flatten())
        half = rows.shape[-1] // 2
        self.cos[:n].copy_(rows[:, :half])
        self.sin[:n].copy_(rows[:, half:])

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
        q_norm.variance_epsilon if q_norm is not None else 0.0, cos, sin, rope.is_neox_style)


def split_qkv_norm_rope_reference(qkv, q_size, kv_size, head_size, positions, rope, q_norm=None,
                                  k_norm=None):
    """The unfused sequence upstream runs: split, RMSNorm per head, RotaryEmbedding."""
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    if q_norm is not None:
        q = q_norm.forward_native(q.unflatten(-1, (-1, head_size))).flatten(-2)
        k = k_norm.forward_native(k.unflatten(-1, (-1, head_size))).flatten(-2)
    q, k = rope.forward_native(positions, q, k)
    return q, k, v
