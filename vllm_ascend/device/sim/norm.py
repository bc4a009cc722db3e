"""torch_npu's RMS norms: ``npu_rms_norm`` and ``npu_add_rms_norm`` (the residual add fused in),
with the chip's checks, their replay forms writing into a graph's outputs, and their shapes for
torch.compile's tracing (torch_npu registers Meta kernels for its ops too). The contracts:
../shared/TORCH_NPU_CONTRACTS.md section 5; the call sites: docs/torch_npu_calls.md, "Fused ops"."""

import torch

from vllm_ascend.device.sim import aclnn
from vllm_ascend.device.sim.aclnn import op_error
from vllm_ascend.device.sim.errors import PARAM_INVALID, TILING_ERROR
from vllm_ascend.device.sim.trace import kernel

_lib = torch.library.Library("ascend_sim", "FRAGMENT")
_lib.define("npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)")
_lib.define("npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) "
            "-> (Tensor, Tensor, Tensor)")
ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rms_float(x, gamma, eps):
    """(y, rstd) in float32: the norm before any rounding to x's dtype. (xf * xf is pow(xf, 2)'s
    arithmetic; a 16-bit gamma times a float32 tensor is its exact widening's product.)"""
    xf = x.float()
    rstd = torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps)
    return xf * rstd * gamma, rstd


def _rms(x, gamma, eps):
    """(y, rstd): rstd is float32 [..., 1], as torch_npu returns it."""
    y, rstd = rms_float(x, gamma, eps)
    return y.to(x.dtype), rstd


def _check_norm(op, x, gamma):
    error = op_error(op)
    if not 2 <= x.dim() <= 8:
        raise error(PARAM_INVALID, f"input must be 2-8-D, got {x.dim()}-D")
    if x.dtype not in ACT_DTYPES or gamma.dtype not in (x.dtype, torch.float32):
        raise error(PARAM_INVALID, f"input dtype {x.dtype} with gamma {gamma.dtype} is not "
                    "supported")
    if tuple(gamma.shape) != tuple(x.shape[x.dim() - gamma.dim():]):
        raise error(TILING_ERROR, f"gamma {list(gamma.shape)} must equal the trailing dims of "
                    f"the input {list(x.shape)}")
    # Upstream passes strided q/k head views (Qwen3's q_norm): no contiguity rule here.


def _rms_into(x, gamma, eps, y, rstd):
    """_rms written into y and rstd: the same arithmetic in the same order, in place."""
    xf = x.to(torch.float32, copy=True)
    torch.rsqrt((xf * xf).mean(-1, keepdim=True).add_(eps), out=rstd)
    torch.mul(xf.mul_(rstd), gamma, out=y)  # in float32, rounded once into y


def _rms_norm_impl(x, gamma, epsilon=1e-6):
    _check_norm("npu_rms_norm", x, gamma)
    return _rms(x, gamma, epsilon)


def _rms_norm_into(outs, x, gamma, epsilon=1e-6):
    _rms_into(x, gamma, epsilon, *outs)


def _check_add_rms_norm(x1, x2, gamma):
    _check_norm("npu_add_rms_norm", x1, gamma)
    if x2.shape != x1.shape or x2.dtype != x1.dtype or gamma.dtype != x1.dtype:
        raise op_error("npu_add_rms_norm")(PARAM_INVALID, "x1, x2 and gamma must share the "
                                             "dtype, and x1 and x2 the shape")
    if x1.numel() == 0:
        raise op_error("npu_add_rms_norm")(PARAM_INVALID, "empty tensors are not supported")


def _add_rms_norm_impl(x1, x2, gamma, epsilon=1e-6):
    _check_add_rms_norm(x1, x2, gamma)
    summed = x1 + x2
    y, rstd = _rms(summed, gamma, epsilon)
    return y, rstd, summed


def _add_rms_norm_into(outs, x1, x2, gamma, epsilon=1e-6):
    y, rstd, summed = outs
    torch.add(x1, x2, out=summed)
    _rms_into(summed, gamma, epsilon, y, rstd)


_lib.impl("npu_rms_norm", kernel("npu_rms_norm", _rms_norm_impl), "CPU")
_lib.impl("npu_add_rms_norm", kernel("npu_add_rms_norm", _add_rms_norm_impl), "CPU")
# They check nothing: the functional kernel checked the same tensors at capture, as the chip's
# tiling does, and a replay reads those tensors again (their shapes, dtypes and layouts).
aclnn.REPLAY_INTO.update(npu_rms_norm=_rms_norm_into, npu_add_rms_norm=_add_rms_norm_into)



# Shapes only, for torch.compile's tracing (torch_npu registers Meta kernels for its ops too).
@torch.library.register_fake("ascend_sim::npu_rms_norm")
def _rms_norm_fake(x, gamma, epsilon=1e-6):
    return torch.empty_like(x), x.new_empty(x.shape[:-1] + (1,), dtype=torch.float32)


@torch.library.register_fake("ascend_sim::npu_add_rms_norm")
def _add_rms_norm_fake(x1, x2, gamma, epsilon=1e-6):
    rstd = x1.new_empty(x1.shape[:-1] + (1,), dtype=torch.float32)
    return torch.empty_like(x1), rstd, torch.empty_like(x1)
