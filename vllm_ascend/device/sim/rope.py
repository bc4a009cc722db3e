"""torch_npu's rotary embeddings: ``npu_rotary_mul`` (cos/sin given, half or interleaved) and
``npu_mrope`` (cos/sin gathered from a cache by position), with the chip's checks, the replay
form of ``npu_rotary_mul`` writing into a graph's output, and their shapes for torch.compile's
tracing (../shared/TORCH_NPU_CONTRACTS.md section 5; docs/torch_npu_calls.md, "Fused ops")."""

import torch

from vllm_ascend.device.sim import aclnn
from vllm_ascend.device.sim.aclnn import op_error, require_contiguous
from vllm_ascend.device.sim.errors import PARAM_INVALID, TILING_ERROR
from vllm_ascend.device.sim.trace import kernel

_lib = torch.library.Library("ascend_sim", "FRAGMENT")
_lib.define("npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') "
            "-> Tensor")
_lib.define("npu_mrope(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, "
            "int head_size, *, int[]? mrope_section=None, str? rotary_mode='half', "
            "str? cache_mode='default') -> (Tensor, Tensor)")


def rotate(x, cos, sin, interleaved):
    """x*cos + rot(x)*sin with full-width cos/sin in the same layout as x."""
    if interleaved:
        turned = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        turned = torch.cat((-x2, x1), dim=-1)
    return x * cos + turned * sin


def _rotary_mul_impl(x, r1, r2, rotary_mode="half"):
    _check_rotary_mul(x, r1, r2, rotary_mode)
    return rotate(x, r1, r2, rotary_mode == "interleave")


def _rotary_mul_into(outs, x, r1, r2, rotary_mode="half"):
    if rotary_mode == "interleave":
        outs[0].copy_(rotate(x, r1, r2, True))
        return
    # rotate(): x*cos + cat(-x2, x1)*sin; the sign after the product, which is symmetric
    half = x.shape[-1] // 2
    turned = x.roll(half, -1).mul_(r2)
    turned[..., :half].neg_()
    torch.add(x * r1, turned, out=outs[0])


def _check_rotary_mul(x, r1, r2, rotary_mode):
    error = op_error("npu_rotary_mul")
    if x.dim() not in (3, 4) or x.shape[-1] % 2 or x.shape[-1] >= 896:
        raise error(TILING_ERROR, f"input must be 3/4-D with an even last dim below 896, got "
                    f"{list(x.shape)}")
    if rotary_mode not in ("half", "interleave"):
        raise error(PARAM_INVALID, f"rotary_mode {rotary_mode!r} must be 'half' or 'interleave'")
    if r1.shape != r2.shape or r1.shape[-1] != x.shape[-1] or r1.dim() != x.dim() or any(
            r not in (1, s) for r, s in zip(r1.shape, x.shape)):
        raise error(TILING_ERROR, f"cos/sin {list(r1.shape)} must broadcast to the input "
                    f"{list(x.shape)} (e.g. 1S1D, 11SD) with the same last dim")
    if not (x.dtype == r1.dtype == r2.dtype):
        raise error(PARAM_INVALID, f"input, r1 and r2 must share the dtype, got {x.dtype}, "
                    f"{r1.dtype}, {r2.dtype}")
    require_contiguous(error, input=x, r1=r1, r2=r2)


def _mrope_impl(positions, query, key, cos_sin_cache, head_size, *, mrope_section=None,
                rotary_mode="half", cache_mode="default"):
    error = op_error("npu_mrope")
    rot = cos_sin_cache.shape[-1]
    if list(mrope_section or [0, 0, 0]) != [0, 0, 0]:
        raise error(TILING_ERROR, "multimodal mrope_section is not simulated")
    if rotary_mode not in ("half", "interleaved") or cache_mode != "default":
        raise error(PARAM_INVALID, f"rotary_mode {rotary_mode!r} / cache_mode {cache_mode!r} "
                    "are not supported")
    if query.dim() != 2 or key.dim() != 2 or positions.dim() != 1 or \
            positions.shape[0] != query.shape[0] or query.shape[1] % head_size or \
            key.shape[1] % head_size:
        raise error(TILING_ERROR, "query/key must be [T, heads*head_size] and positions [T]")
    if cos_sin_cache.dtype != query.dtype or query.dtype != key.dtype:
        raise error(PARAM_INVALID, "cos_sin_cache, query and key must share the dtype")
    if query.dtype != torch.float32 and (head_size % 32 or rot % 32) or rot > head_size:
        raise error(TILING_ERROR, f"head_size({head_size}) and rotary_dim({rot}) must be "
                    "multiples of 32 for fp16/bf16, rotary_dim at most head_size")
    require_contiguous(error, positions=positions, query=query, key=key,
                        cos_sin_cache=cos_sin_cache)
    cos, sin = cos_sin_cache.index_select(0, positions.long()).chunk(2, dim=-1)
    interleaved = rotary_mode == "interleaved"
    if interleaved:
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    else:
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def apply(x):
        x = x.unflatten(-1, (-1, head_size))
        turned = rotate(x[..., :rot], cos, sin, interleaved)
        return torch.cat((turned, x[..., rot:]), -1).flatten(-2) if rot < head_size else \
            turned.flatten(-2)

    return apply(query), apply(key)


_lib.impl("npu_rotary_mul", kernel("npu_rotary_mul", _rotary_mul_impl), "CPU")
_lib.impl("npu_mrope", kernel("npu_mrope", _mrope_impl), "CPU")
aclnn.REPLAY_INTO["npu_rotary_mul"] = _rotary_mul_into


@torch.library.register_fake("ascend_sim::npu_rotary_mul")
def _rotary_mul_fake(x, r1, r2, rotary_mode="half"):
    return torch.empty_like(x)


@torch.library.register_fake("ascend_sim::npu_mrope")
def _mrope_fake(positions, query, key, cos_sin_cache, head_size, *, mrope_section=None,
                rotary_mode="half", cache_mode="default"):
    return torch.empty_like(query), torch.empty_like(key)
