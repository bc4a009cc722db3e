"""The simulated device's memory: torch's allocator, and what lives outside it.

On a chip, ``torch.npu.memory_stats`` counts the tensors torch's NPU caching allocator holds,
and ``mem_get_info`` the whole device: that, plus memory the allocator never sees (HCCL's
communication buffers, the runtime's own). vLLM budgets the KV cache from the second, so memory
outside torch shrinks the cache instead of failing the first large batch.

Here the host is the device, so:

* **torch's allocator** is the C heap this process gained since it opened its device (glibc's
  ``mallinfo2``: bytes allocated and not freed, which is where torch's CPU tensors live). Host
  memory the process held before is not the device's. A peak is measured from
  ``reset_peak_memory_stats`` to the first read of it after a synchronisation (vLLM's profile
  run): meanwhile the simulator looks at each SwiGLU and attention op (an MLP's gate/up output
  and an attention's inputs and output are alive then). A temporary made and freed between
  two of those (the sampler's logits) is not seen. Looking costs about a millisecond in a large
  process (glibc walks its free lists), so it is not done at every op, nor while serving.
* **outside torch** is charged explicitly by what would hold it on a chip: each communicator
  of two or more ranks holds 2 x HCCL_BUFFSIZE MiB, "used for receiving and sending", from its
  creation (CANN's HCCL_BUFFSIZE reference, envref_07_0080; the chip allocates it at the
  communicator's first collective, the simulator at its creation, the stricter reading).
  CANN's default is 200 MB on a 64 GiB chip; unset, the simulator scales it to its device
  (``hccl_buffer_bytes``).
* **the simulator's own** host memory on the heap is not the device's: a model's weights packed
  for the CPU's products, and what the CPU's libraries keep for each product's shape (oneDNN's
  primitives, measured at a shape's first call: sim/matmul.py), are subtracted, as the
  simulator measures them. What is left depends on the host's allocator only by its rounding.
* **physical memory** that the runtime's virtual memory calls allocate (sim/acl.py: sleep mode's
  pool) is torch's too, counted from those calls, since it lives outside the heap.
* **out of memory**: when the two together exceed the device, the next look at the device's
  memory (a memory query: vLLM's profiling, the capture's log line) raises torch's
  ``OutOfMemoryError`` with the chip's wording; the chip fails at the allocation itself, which
  the simulator cannot see.

Limits: a process that runs the engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) shares
its heap with its user, so memory the user allocates while the engine serves counts as device
memory (stricter, not laxer); a worker that re-opens its device in the same process starts from
an empty device, where the chip would still hold what an earlier worker leaked.
"""

import contextlib
import ctypes
import ctypes.util
import os

import torch

HCCL_BUFFSIZE_ENV = "HCCL_BUFFSIZE"
DEFAULT_HCCL_BUFFSIZE_MB = 200
CHIP_HBM_BYTES = 64 << 30  # an Atlas 800 A2's 910B: the chip CANN's default is sized for
GiB = float(1 << 30)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def _heap() -> int:
    """Bytes this process has allocated from the C heap and not freed. A microsecond in a small
    process, a millisecond or more in an engine's (glibc walks its free lists)."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


class _Account:
    def __init__(self):
        self.base: int | None = None  # the heap when the device was opened
        self.peak = 0
        self.measuring = False  # a peak is being measured: look at each simulated op
        self.synced = False  # the device synchronised since the measurement began
        self.outside: dict[str, int] = {}  # what holds memory outside torch -> bytes
        self.physical = 0  # sim/acl.py's physical memory, which a pool of torch's allocator holds
        self.moving = 0  # heap bytes of a storage being moved into a pool (sim/mempool.py)
        self.simulator = 0  # heap bytes the simulator holds for itself (sim/matmul.py's packs)


_ACCOUNT = _Account()


def open_device() -> None:
    """The process (re)opened its device: the heap it holds now is host memory (the part the
    simulator holds for itself stays counted as that, apart)."""
    _ACCOUNT.base = _heap() - _ACCOUNT.simulator
    _ACCOUNT.peak = 0


def allocated() -> int:
    """What torch's allocator holds on the device now; the peak follows it."""
    if _ACCOUNT.base is None:
        return _ACCOUNT.physical
    current = max(_heap() - _ACCOUNT.base - _ACCOUNT.moving - _ACCOUNT.simulator, 0) \
        + _ACCOUNT.physical
    if current > _ACCOUNT.peak:
        _ACCOUNT.peak = current
    return current


def reset_peak() -> None:
    _ACCOUNT.peak = 0
    _ACCOUNT.peak = allocated()
    _ACCOUNT.measuring, _ACCOUNT.synced = True, False


def op_ran() -> None:
    if _ACCOUNT.measuring:
        allocated()


def synchronized() -> None:
    _ACCOUNT.synced = True


def physical_changed(nbytes: int) -> None:
    """sim/acl.py's physical memory now holds ``nbytes``."""
    _ACCOUNT.physical = nbytes
    allocated()  # the peak follows it


@contextlib.contextmanager
def moving(nbytes: int):
    """A storage of ``nbytes`` on the heap is being moved into pool memory: on the chip it
    would have been allocated in the pool in the first place, so it is not counted twice."""
    _ACCOUNT.moving += nbytes
    try:
        yield
    finally:
        _ACCOUNT.moving -= nbytes


def simulator_holds(nbytes: int) -> None:
    """The simulator took ``nbytes`` of the heap for itself (negative: gave them back): host
    memory a chip would not hold, so not the device's."""
    _ACCOUNT.simulator += nbytes


def heap() -> int:
    """The process's C heap in use, for the simulator to measure what it takes for itself."""
    return _heap()


def can_allocate(nbytes: int, total: int) -> bool:
    """Whether the device has ``nbytes`` more to give (the runtime's physical allocations fail
    at once when it has not, unlike torch's tensors, which the simulator cannot see)."""
    return allocated() + outside_torch() + nbytes <= total


def outside_torch() -> int:
    return sum(_ACCOUNT.outside.values())


def hccl_buffer_bytes(device_total: int) -> int:
    """What one communicator holds: 2 x HCCL_BUFFSIZE MB. Unset, HCCL_BUFFSIZE is CANN's default
    (200 MB) scaled to the simulated device as it is to a chip's HBM: 200 MB on a 64 GiB 910B
    is 200 x device memory / 64 GiB here (18 MB on a 5.9 GiB device), so a simulated device
    leaves its engines the share of memory a chip leaves them."""
    value = os.environ.get(HCCL_BUFFSIZE_ENV)
    if value is None:
        mb = max(1, round(DEFAULT_HCCL_BUFFSIZE_MB * device_total / CHIP_HBM_BYTES))
    elif not value.isdigit() or int(value) < 1:
        raise ValueError(f"{HCCL_BUFFSIZE_ENV}={value!r} must be an integer >= 1 (MB)")
    else:
        mb = int(value)
    return 2 * mb << 20  # one buffer to send, one to receive


def charge(holder: str, nbytes: int) -> None:
    """``holder`` holds ``nbytes`` of device memory outside torch's allocator."""
    _ACCOUNT.outside[holder] = _ACCOUNT.outside.get(holder, 0) + nbytes


def release(holder: str) -> None:
    _ACCOUNT.outside.pop(holder, None)


def check_capacity(total: int, device: int) -> tuple[int, int]:
    """One look at the device's memory for a memory query: (torch's allocation now, its peak),
    after raising the chip's out-of-memory error if the device holds more than it has. A look
    after a synchronisation ends a peak measurement."""
    current = allocated()
    if _ACCOUNT.synced:
        _ACCOUNT.measuring = False
    torch_bytes, outside = _ACCOUNT.peak, outside_torch()
    if torch_bytes + outside <= total:
        return current, torch_bytes
    holders = ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in sorted(_ACCOUNT.outside.items()))
    _ACCOUNT.peak = 0  # reported once per excess
    raise torch.OutOfMemoryError(
        f"NPU out of memory. (NPU {device}; {total / GiB:.2f} GiB total capacity; "
        f"{torch_bytes / GiB:.2f} GiB allocated by PyTorch at the peak; "
        f"{outside / GiB:.2f} GiB outside PyTorch's allocator ({holders or 'nothing'})). "
        "The simulator finds it when memory is next asked about; the chip fails at the "
        "allocation. Lower gpu_memory_utilization or max_num_batched_tokens, or give the "
        "device more memory.")
