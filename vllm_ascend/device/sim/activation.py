"""torch_npu's ``npu_swiglu``: SiLU of the first half times the second, with the chip's checks,
its replay form writing into a graph's output, and its shape for torch.compile's tracing
(../shared/TORCH_NPU_CONTRACTS.md section 5; docs/torch_npu_calls.md, "Fused ops")."""

import torch

from vllm_ascend.device.sim import aclnn
from vllm_ascend.device.sim.aclnn import op_error, require_contiguous, sampling
from vllm_ascend.device.sim.errors import TILING_ERROR
from vllm_ascend.device.sim.norm import ACT_DTYPES
from vllm_ascend.device.sim.trace import kernel

_lib = torch.library.Library("ascend_sim", "FRAGMENT")
_lib.define("npu_swiglu(Tensor self, int dim=-1) -> Tensor")


def _check_swiglu(x, dim):
    error = op_error("npu_swiglu")
    require_contiguous(error, input=x)
    if x.shape[dim] % 2 or x.dtype not in ACT_DTYPES:
        raise error(TILING_ERROR, f"dim {dim} of {list(x.shape)} must be even and the dtype "
                    f"fp32/fp16/bf16, got {x.dtype}")


def _swiglu_impl(x, dim=-1):
    _check_swiglu(x, dim)
    a, b = x.chunk(2, dim=dim)
    return torch.nn.functional.silu(a) * b


def _swiglu_into(outs, x, dim=-1):
    a, b = x.chunk(2, dim=dim)
    torch.mul(torch.nn.functional.silu(a), b, out=outs[0])


_lib.impl("npu_swiglu", kernel("npu_swiglu", sampling(_swiglu_impl)), "CPU")
aclnn.REPLAY_INTO["npu_swiglu"] = sampling(_swiglu_into)


@torch.library.register_fake("ascend_sim::npu_swiglu")
def _swiglu_fake(x, dim=-1):
    shape = list(x.shape)
    shape[dim] //= 2
    return x.new_empty(shape)
