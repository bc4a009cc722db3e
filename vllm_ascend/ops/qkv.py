"""QKV split + q/k RMSNorm + RoPE as one fused op, with cos/sin gathered once per step.

A model's ``StepRope`` holds static cos/sin buffers that its attention layers share. A pre-hook
of the model's call fills them from the forward's positions (worker/model_runner.py; inside a
FULL graph's capture, so each replay gathers them again), so every layer reads the same gathered
rows instead of gathering per layer, and graphs read them at their captured address.
"""

import torch

from vllm_ascend.device import torch_npu


def full_width_cos_sin(cos: torch.Tensor, sin: torch.Tensor, is_neox: bool):
    """Half-width cos/sin rows [T, rot/2] -> full width [T, rot] in the rope's layout (neox:
    halves repeated; GPT-J: pairs interleaved), as npu_rotary_mul takes them."""
    if is_neox:
        return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    return cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)


class StepRope:
    """cos/sin rows of the step's positions, full rotary width, in the rope's own layout, as
    [1, tokens, 1, rot] buffers of the model's dtype (npu_rotary_mul's 1S1D broadcast)."""

    def __init__(self):
        self.cache: torch.Tensor | None = None  # [max_position, rot_dim]: cos | sin halves
        self.is_neox = True
        self.cos: torch.Tensor | None = None  # [1, max_num_tokens, 1, rot_dim]
        self.sin: torch.Tensor | None = None

    def attach(self, rope, max_num_tokens: int, dtype: torch.dtype,
               half_layout: bool = False) -> None:
        """Use ``rope``'s table; allocate the step buffers (once per model). ``half_layout``:
        cos/sin in half (neox) layout whatever the rope's style, as the interleave-rope
        operators take them (they de-interleave x themselves)."""
        cache = rope.cos_sin_cache
        is_neox = half_layout or rope.is_neox_style
        if self.cache is not None and self.cache is not cache and not (
                torch.equal(self.cache, cache) and self.is_neox == is_neox):
            raise ValueError("vllm-ascend's fused RoPE expects one rotary table per model; "
                             "this model has layers with different RoPE parameters")
        if self.cache is None or self.cos.shape[1] < max_num_tokens:
            self.cos = torch.zeros(1, max_num_tokens, 1, cache.shape[-1], dtype=dtype,
                                   device=cache.device)
            self.sin = torch.zeros_like(self.cos)
        self.cache, self.is_neox = cache, is_neox

    def reserve(self, max_num_tokens: int) -> None:
        """Room for ``max_num_tokens`` rows: an engine reusing the StepRope an earlier engine
        left on vLLM's cached rotary module may run larger forwards (its dummy runs included)."""
        if self.cos is not None and self.cos.shape[1] < max_num_tokens:
            self.cos = self.cos.new_zeros(1, max_num_tokens, 1, self.cos.shape[-1])
            self.sin = torch.zeros_like(self.cos)

    def update(self, positions: torch.Tensor) -> None:
        if self.cache is None:
            return
        n = positions.shape[0]
        cos, sin = full_width_cos_sin(
            *self.cache.index_select(0, positions.flatten()).chunk(2, dim=-1), self.is_neox)
        self.cos[0, :n, 0].copy_(cos)
        self.sin[0, :n, 0].copy_(sin)

    def get(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:, :n], self.sin[:, :n]



def rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 mode: str) -> torch.Tensor:
    """x [1, T, heads, head_size] rotated on its first rot dims by npu_rotary_mul."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return torch_npu.npu_rotary_mul(x.contiguous(), cos, sin, rotary_mode=mode)
    turned = torch_npu.npu_rotary_mul(x[..., :rot].contiguous(), cos, sin, rotary_mode=mode)
    return torch.cat((turned, x[..., rot:]), dim=-1)


def split_qkv_norm_rope(qkv, q_size, kv_size, head_size, rope: StepRope, q_norm=None,
                        k_norm=None):
    """(q, k, v) from a fused QKV projection: split, optional per-head q/k RMSNorm
    (npu_rms_norm), RoPE (npu_rotary_mul) with the step's cos/sin from ``rope``. q and k come
    out contiguous, [T, q_size] and [T, kv_size]."""
    t = qkv.shape[0]
    cos, sin = rope.get(t)
    mode = "half" if rope.is_neox else "interleave"
    nq = q_size // head_size
    if q_norm is None:
        # q and k are adjacent in qkv: rotate both in one call.
        qk = rotate_heads(qkv[:, : q_size + kv_size].view(1, t, -1, head_size), cos, sin,
                          mode)[0]
        q, k = qk[:, :nq].contiguous(), qk[:, nq:].contiguous()
    else:
        q = torch_npu.npu_rms_norm(qkv[:, :q_size].view(t, -1, head_size), q_norm.weight,
                                   q_norm.variance_epsilon)[0]
        k = torch_npu.npu_rms_norm(qkv[:, q_size: q_size + kv_size].view(t, -1, head_size),
                                   k_norm.weight, k_norm.variance_epsilon)[0]
        q = rotate_heads(q.unsqueeze(0), cos, sin, mode)[0]
        k = rotate_heads(k.unsqueeze(0), cos, sin, mode)[0]
    return q.reshape(t, q_size), k.reshape(t, kv_size), qkv[:, q_size + kv_size:]


def split_qkv_norm_rope_reference(qkv, q_size, kv_size, head_size, positions, rope, q_norm=None,
                                  k_norm=None):
    """The unfused sequence upstream runs: split, RMSNorm per head, RotaryEmbedding."""
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    if q_norm is not None:
        q = q_norm.forward_native(q.unflatten(-1, (-1, head_size))).flatten(-2)
        k = k_norm.forward_native(k.unflatten(-1, (-1, head_size))).flatten(-2)
    q, k = rope.forward_native(positions, q, k)
    return q, k, v
