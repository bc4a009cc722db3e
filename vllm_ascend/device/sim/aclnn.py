"""What every simulated operator shares (torch_npu's ops as aclnn calls them):

* the ``ascend_sim`` operator library: each torch_npu operator is a ``torch.library`` op there,
  so the graph recorder (sim/recorder.py) sees one device kernel whose host arguments (FIA's
  ``actual_seq_lengths`` lists, for instance) are recorded by value, as on the chip. Each
  operator module defines its ops in a fragment of it;
* ``CAPTURING``: set while a graph is captured, so that a captured task's kernel runs its
  host-side checks and leaves garbage in its output (it runs at replay only);
* the chip's contiguity rule and the memory sampling of the ops that run while a peak is
  measured (sim/memory.py);
* the forms a graph replay calls (sim/replay.py), which each operator module registers:
  ``REPLAY`` (the kernel without the checks the capture made) and ``REPLAY_INTO`` (the kernel
  writing into the graph's output buffers).

Messages and codes follow the chip (../shared/TORCH_NPU_CONTRACTS.md, F1-F17 and section 10)
where they are known; where the chip's rule is not documented, the stricter reading is taken and
the comment says so.
"""

import threading

import torch
from torch.library import Library

from vllm_ascend.device.sim import memory as _memory
from vllm_ascend.device.sim.errors import PARAM_INVALID, AscendOpError

LIB = Library("ascend_sim", "DEF")  # the operator modules define their ops in FRAGMENTs of it
INT32_MAX = 2147483647


class _Capturing(threading.local):
    active = False
    _garbage = torch.Generator().manual_seed(20261203)  # its own: the process's RNG is untouched

    def __init__(self):
        self._noise: dict[torch.dtype, torch.Tensor] = {}

    def unwritten(self, t: torch.Tensor) -> torch.Tensor:
        """What a captured task's output holds until a replay writes it: garbage (finite, so
        the ops after it in the capture still run their checks on sane values). Copied from a
        buffer of uniform(-1, 1) noise drawn once per dtype: drawing it anew for every output
        took a quarter of a capture's time."""
        n = t.numel()
        noise = self._noise.get(t.dtype)
        if noise is None or noise.numel() < n:
            noise = torch.empty(max(n, 1 << 20), dtype=t.dtype).uniform_(
                -1, 1, generator=self._garbage)
            self._noise[t.dtype] = noise
        return t.copy_(noise[:n].view(t.shape))


# Set while a graph is captured (sim/graph.py, around its recorder): the attention kernels run their
# host-side checks, as the chip's tiling does at capture, and leave garbage in the output, as a
# captured task runs at replay only. The capture of a FULL graph cost twice its attention before.
CAPTURING = _Capturing()


def sampling(impl):
    """The op, then, while a peak is measured, a look at the device's memory: its inputs and
    outputs live now (sim/memory.py)."""
    def op(*args, **kwargs):
        out = impl(*args, **kwargs)
        _memory.op_ran()
        return out

    return op


def op_error(op):
    """An error factory ``(code, message) -> AscendOpError`` for ``op``."""
    return lambda code, message: AscendOpError(op, f"aclnn op of {op}", code, message)


def require_contiguous(op_error, **tensors):
    # F14: the op-plugin does not call .contiguous(); non-contiguous inputs are not supported.
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise op_error(PARAM_INVALID, f"{name} must be contiguous (non-contiguous tensors "
                           f"are not supported), got shape {list(t.shape)} stride {t.stride()}")


# What a graph replay calls for an ascend_sim op, by the op's name (with its overload), when the
# op registers one: the kernel without the checks of its tensors and attributes, which the
# capture made as the chip's tiling does (a task update may change host lists only)...
REPLAY: dict = {}
# ... and the kernel writing into a replay's outputs, ``into(outs, *args, **kwargs)``: a captured
# task writes its output buffers (a replay of the functional kernel would copy each result there).
REPLAY_INTO: dict = {}
