"""The simulator's W8A8 operators, as upstream vllm-ascend's quantization/methods/w8a8_dynamic.py,
w8a8_static.py (through ops/register_custom_ops.py ``_quantize_impl``) and its norm-quant fusion
pass (compilation/passes/norm_quant_fusion_pass.py) call them. docs/torch_npu_calls.md holds each
contract and its source (torch_npu's API reference; CANN's aclnn pages for the formulas).

Only the combinations the product uses are simulated (int8 in, no smoothing, no asymmetric
weight offsets); anything else is refused by name, not ignored. Rounding is half to even, and
int8 results saturate at [-128, 127]. The fused norms quantize the float32 norm, not its
rounding to x's dtype.
"""

import torch
from torch.library import Library

from vllm_ascend.device.sim.errors import PARAM_INVALID, TILING_ERROR, AscendOpError
from vllm_ascend.device.sim.norm import rms_float
from vllm_ascend.device.sim.trace import kernel

_lib = Library("ascend_sim", "FRAGMENT")
HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _error(op):
    return lambda code, message: AscendOpError(op, f"aclnn op of {op}", code, message)


def _to_int8(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x).clamp_(-128, 127).to(torch.int8)


def _affine(x: torch.Tensor, scales, zero_points, div_mode: bool) -> torch.Tensor:
    """int8 of ``x / scales + zero_points`` (div_mode) or ``x * scales + zero_points``."""
    y = x.float() / scales.float() if div_mode else x.float() * scales.float()
    return _to_int8(y if zero_points is None else y + zero_points.float())


def _per_token(y: torch.Tensor):
    """Symmetric per-token int8: scale = rowmax(|y|) / 127, y_q = round(y / scale)."""
    scale = y.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row quantizes to 0
    return _to_int8(y / safe.unsqueeze(-1)), scale


_lib.define("npu_dynamic_quant(Tensor x, *, Tensor? smooth_scales=None, Tensor? group_index=None, "
            "ScalarType? dst_type=None) -> (Tensor, Tensor)")
_lib.define("npu_quantize(Tensor input, Tensor scales, Tensor? zero_points, ScalarType dtype, "
            "int axis=1, bool div_mode=True) -> Tensor")
_lib.define("npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, "
            "Tensor? pertoken_scale=None, Tensor? bias=None, ScalarType? output_dtype=None) "
            "-> Tensor")
_lib.define("npu_add_rms_norm_quant(Tensor x1, Tensor x2, Tensor gamma, Tensor scales1, "
            "Tensor? zero_points1=None, Tensor? beta=None, Tensor? scales2=None, "
            "Tensor? zero_points2=None, int axis=-1, float epsilon=1e-06, bool div_mode=True) "
            "-> (Tensor, Tensor, Tensor)")
_lib.define("npu_add_rms_norm_dynamic_quant(Tensor x1, Tensor x2, Tensor gamma, *, "
            "Tensor? smooth_scale1=None, Tensor? smooth_scale2=None, Tensor? beta=None, "
            "float epsilon=1e-06, bool[2]? output_mask=None) "
            "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")


def _dynamic_quant_impl(x, *, smooth_scales=None, group_index=None, dst_type=None):
    error = _error("npu_dynamic_quant")
    if x.dtype not in HALF or x.dim() < 2:
        raise error(PARAM_INVALID, f"x must be float16 or bfloat16 with more than one dim, got "
                    f"{x.dim()}-D {x.dtype}")
    if dst_type not in (None, torch.int8):
        raise NotImplementedError(f"npu_dynamic_quant: dst_type={dst_type} is not simulated")
    if smooth_scales is not None or group_index is not None:
        raise NotImplementedError("npu_dynamic_quant: smooth_scales/group_index are not simulated")
    return _per_token(x.float())


def _check_scale_vector(error, name, t, width):
    # "1-D: the size of the axis dim of input, or 1" (npu_quantize); axis is the last dim.
    if t.dim() != 1 or t.shape[0] not in (1, width):
        raise error(TILING_ERROR, f"{name} must be 1-D of size {width} or 1, got "
                    f"{list(t.shape)}")


def _quantize_impl(input, scales, zero_points, dtype, axis=1, div_mode=True):
    error = _error("npu_quantize")
    if input.dtype not in FLOATS:
        raise error(PARAM_INVALID, f"input must be float32/float16/bfloat16, got {input.dtype}")
    if dtype not in (torch.qint8, torch.int8):
        raise NotImplementedError(f"npu_quantize: dtype={dtype} is not simulated (torch.qint8 is)")
    if axis not in (-1, input.dim() - 1):
        raise error(PARAM_INVALID, f"axis {axis}: only the last dim is supported")
    _check_scale_vector(error, "scales", scales, input.shape[-1])
    if not div_mode and scales.dtype != input.dtype:
        # div_mode=False: "the dtype and format of scales must match input's" (torch_npu 7.x).
        raise error(PARAM_INVALID, f"scales dtype {scales.dtype} must equal input's "
                    f"{input.dtype} when div_mode is False")
    if div_mode and scales.dtype not in (torch.float32, torch.bfloat16):
        raise error(PARAM_INVALID, f"scales must be float32 or bfloat16 when div_mode is True, "
                    f"got {scales.dtype}")
    if zero_points is not None and (zero_points.shape != scales.shape or
                                    (not div_mode and zero_points.dtype != scales.dtype)):
        raise error(PARAM_INVALID, f"zero_points {list(zero_points.shape)} {zero_points.dtype} "
                    f"must have the shape (and with div_mode False the dtype) of scales "
                    f"{list(scales.shape)} {scales.dtype}")
    return _affine(input, scales, zero_points, div_mode)


def _decode_scale(error, scale: torch.Tensor) -> torch.Tensor:
    """An int64 scale is npu_trans_quant_param's encoding: the float32's bits in the low 32 bits
    (upstream builds it so: w8a8_dynamic.py scale_from_float_to_int64). Offset bits above them
    are not simulated."""
    if scale.dtype != torch.int64:
        return scale.float()
    high = scale >> 31  # 0 for a float32's bits widened from int32 (or -1, sign-extended)
    if not bool(((high == 0) | (high == -1)).all()):
        raise NotImplementedError("npu_quant_matmul: int64 scales with offset bits are not "
                                  "simulated")
    return (scale & 0xFFFFFFFF).to(torch.int32).view(torch.float32)


def _quant_matmul_impl(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
                       output_dtype=None):
    error = _error("npu_quant_matmul")
    if x1.dtype != torch.int8 or x2.dtype != torch.int8:
        raise error(PARAM_INVALID, f"x1 and x2 must be int8 (int32/int4 is not simulated), got "
                    f"{x1.dtype} and {x2.dtype}")
    if x1.dim() != 2 or x2.dim() != 2:
        raise NotImplementedError("npu_quant_matmul: only 2-D x1 [m, k] and x2 [k, n] are "
                                  "simulated")
    (m, k), (k2, n) = x1.shape, x2.shape
    if k != k2:
        raise error(TILING_ERROR, f"x1 {list(x1.shape)} and x2 {list(x2.shape)}: k differs")
    if output_dtype in (None, torch.int8) or offset is not None:
        raise NotImplementedError("npu_quant_matmul: int8 output (and offset) is not simulated")
    # The supported combinations (torch_npu's npu_quant_matmul reference, the A2/A3 table):
    #   float16,  no pertoken:      scale int64/float32,   bias int32
    #   bfloat16:                   scale float32/bfloat16, bias int32/bfloat16/float32
    #   float16,  pertoken float32: scale float32,          bias int32/float16/float32
    allowed = {
        (torch.float16, False): ((torch.int64, torch.float32), (torch.int32,)),
        (torch.bfloat16, False): ((torch.float32, torch.bfloat16),
                                  (torch.int32, torch.bfloat16, torch.float32)),
        (torch.bfloat16, True): ((torch.float32, torch.bfloat16),
                                 (torch.int32, torch.bfloat16, torch.float32)),
        (torch.float16, True): ((torch.float32,), (torch.int32, torch.float16, torch.float32)),
    }.get((output_dtype, pertoken_scale is not None))
    if allowed is None:
        raise error(PARAM_INVALID, f"output_dtype {output_dtype} is not supported")
    scales, biases = allowed
    if scale.dtype not in scales or (bias is not None and bias.dtype not in biases):
        raise error(PARAM_INVALID, f"with output_dtype {output_dtype} and pertoken_scale "
                    f"{'given' if pertoken_scale is not None else 'None'}, scale must be one of "
                    f"{scales} and bias one of {biases}; got scale {scale.dtype}, bias "
                    f"{None if bias is None else bias.dtype}")
    if scale.dim() != 1 or scale.shape[0] not in (1, n):
        raise error(TILING_ERROR, f"scale must be 1-D of size 1 or n={n}, got {list(scale.shape)}")
    if pertoken_scale is not None and (pertoken_scale.dtype != torch.float32 or
                                       tuple(pertoken_scale.shape) != (m,)):
        raise error(PARAM_INVALID, f"pertoken_scale must be float32 [{m}], got "
                    f"{pertoken_scale.dtype} {list(pertoken_scale.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise error(TILING_ERROR, f"bias must be [{n}], got {list(bias.shape)}")
    acc = x1.double() @ x2.double()  # exact int32 accumulation
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.double()
    y = acc.float() * _decode_scale(error, scale)
    if pertoken_scale is not None:
        y = y * pertoken_scale.unsqueeze(-1)
    if bias is not None and bias.dtype != torch.int32:
        y = y + bias.float()
    return y.to(output_dtype)


def _check_add_norm(error, x1, x2, gamma):
    if x1.dtype not in HALF or x2.dtype != x1.dtype or gamma.dtype != x1.dtype:
        raise error(PARAM_INVALID, f"x1, x2 and gamma must share float16 or bfloat16, got "
                    f"{x1.dtype}, {x2.dtype}, {gamma.dtype}")
    if x2.shape != x1.shape or tuple(gamma.shape) != (x1.shape[-1],) or x1.dim() < 2:
        raise error(TILING_ERROR, f"x1 {list(x1.shape)} and x2 {list(x2.shape)} must match and "
                    f"gamma {list(gamma.shape)} be their last dim")
    return x1 + x2


def _add_rms_norm_quant_impl(x1, x2, gamma, scales1, zero_points1=None, beta=None, scales2=None,
                             zero_points2=None, axis=-1, epsilon=1e-6, div_mode=True):
    error = _error("npu_add_rms_norm_quant")
    if beta is not None or scales2 is not None or zero_points2 is not None:
        raise NotImplementedError("npu_add_rms_norm_quant: beta and the second quantization "
                                  "are not simulated")
    if axis != -1:
        raise error(PARAM_INVALID, f"axis must be -1, got {axis}")
    _check_scale_vector(error, "scales1", scales1, x1.shape[-1])
    # Stricter reading: the scale in x's dtype (as upstream passes it) or float32; the offset in
    # the scale's dtype, as npu_quantize requires.
    if scales1.dtype not in (x1.dtype, torch.float32) or (
            zero_points1 is not None and (zero_points1.dtype != scales1.dtype or
                                          zero_points1.shape != scales1.shape)):
        raise error(PARAM_INVALID, f"scales1 {scales1.dtype} must be x1's dtype or float32 and "
                    f"zero_points1 {None if zero_points1 is None else zero_points1.dtype} "
                    "match it")
    summed = _check_add_norm(error, x1, x2, gamma)
    y = _affine(rms_float(summed, gamma, epsilon)[0], scales1, zero_points1, div_mode)
    return y, x1.new_empty((0,), dtype=torch.int8), summed


def _add_rms_norm_dynamic_quant_impl(x1, x2, gamma, *, smooth_scale1=None, smooth_scale2=None,
                                     beta=None, epsilon=1e-6, output_mask=None):
    error = _error("npu_add_rms_norm_dynamic_quant")
    if smooth_scale1 is not None or smooth_scale2 is not None or beta is not None:
        raise NotImplementedError("npu_add_rms_norm_dynamic_quant: smooth scales and beta are "
                                  "not simulated")
    if output_mask is not None and list(output_mask) != [True, False]:
        raise NotImplementedError("npu_add_rms_norm_dynamic_quant: only output_mask=[True, "
                                  "False] (one quantized output) is simulated")
    summed = _check_add_norm(error, x1, x2, gamma)
    y_q, scale = _per_token(rms_float(summed, gamma, epsilon)[0])
    empty = x1.new_empty((0,))
    return y_q, empty.to(torch.int8), summed, scale, empty.float()


for _name, _impl in (("npu_dynamic_quant", _dynamic_quant_impl), ("npu_quantize", _quantize_impl),
                     ("npu_quant_matmul", _quant_matmul_impl),
                     ("npu_add_rms_norm_quant", _add_rms_norm_quant_impl),
                     ("npu_add_rms_norm_dynamic_quant", _add_rms_norm_dynamic_quant_impl)):
    _lib.impl(_name, kernel(_name, _impl), "CPU")


@torch.library.register_fake("ascend_sim::npu_dynamic_quant")
def _dynamic_quant_fake(x, *, smooth_scales=None, group_index=None, dst_type=None):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.register_fake("ascend_sim::npu_quantize")
def _quantize_fake(input, scales, zero_points, dtype, axis=1, div_mode=True):
    return input.new_empty(input.shape, dtype=torch.int8)


@torch.library.register_fake("ascend_sim::npu_quant_matmul")
def _quant_matmul_fake(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
                       output_dtype=None):
    return x1.new_empty((x1.shape[0], x2.shape[1]), dtype=output_dtype or torch.int8)


@torch.library.register_fake("ascend_sim::npu_add_rms_norm_quant")
def _add_rms_norm_quant_fake(x1, x2, gamma, scales1, zero_points1=None, beta=None, scales2=None,
                             zero_points2=None, axis=-1, epsilon=1e-6, div_mode=True):
    return (x1.new_empty(x1.shape, dtype=torch.int8), x1.new_empty((0,), dtype=torch.int8),
            torch.empty_like(x1))


@torch.library.register_fake("ascend_sim::npu_add_rms_norm_dynamic_quant")
def _add_rms_norm_dynamic_quant_fake(x1, x2, gamma, *, smooth_scale1=None, smooth_scale2=None,
                                     beta=None, epsilon=1e-6, output_mask=None):
    return (x1.new_empty(x1.shape, dtype=torch.int8), x1.new_empty((0,), dtype=torch.int8),
            torch.empty_like(x1), x1.new_empty(x1.shape[:-1], dtype=torch.float32),
            x1.new_empty((0,), dtype=torch.float32))
