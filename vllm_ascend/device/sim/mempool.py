"""torch_npu's memory pools with a pluggable allocator (``torch.npu.memory``), on the CPU.

On a chip, ``torch_npu._C._npu_customAllocator(malloc_fn, free_fn)`` wraps two C functions
(``void*(size_t, int, aclrtStream)`` and ``void(void*, size_t, int, aclrtStream)``) as an
allocator; ``MemPool(allocator)`` is a pool of torch's caching allocator whose segments come
from it, and inside ``use_mem_pool(pool)`` every device tensor is carved from that pool.

Here device tensors are host tensors, so ``use_mem_pool`` watches the ops run inside it (a
dispatch mode): ``empty`` and ``zeros`` are made in memory obtained from ``malloc_fn`` (zero, as
freshly mapped memory is), and every other new storage is moved there; the memory goes back
through ``free_fn`` when the storage dies. Two differences, both stricter in memory:
each storage gets its own allocation (the chip's caching allocator packs small tensors into
shared 2 MB segments), and host tensors made inside the pool (a checkpoint being read) are
device tensors here, so they pass through the pool too (the chip reads them on the host).
"""

import contextlib
import ctypes
import math
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from vllm_ascend.device.sim import devices as _devices
from vllm_ascend.device.sim import memory as _memory

MALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                           ctypes.c_void_p)


class CustomAllocator:
    """What ``torch_npu._C._npu_customAllocator`` returns: the two functions, by address."""

    def __init__(self, malloc_ptr: int, free_ptr: int):
        if not malloc_ptr or not free_ptr:
            raise RuntimeError("_npu_customAllocator: a function pointer is null")
        self.malloc = MALLOC_FN(malloc_ptr)
        self.free = FREE_FN(free_ptr)


class MemPool:
    """A pool of device memory whose allocations come from ``allocator``."""

    def __init__(self, allocator: CustomAllocator | None = None):
        if not isinstance(allocator, CustomAllocator):
            raise TypeError("MemPool: the simulator pools memory only from a custom allocator "
                            "(torch_npu._C._npu_customAllocator)")
        self.allocator = allocator

    def storage(self, nbytes: int, device: int) -> torch.UntypedStorage:
        """A storage of ``nbytes`` in memory from this pool's allocator, zero-filled (freshly
        mapped memory is)."""
        ptr = self.allocator.malloc(nbytes, device, None)
        if not ptr:
            raise torch.OutOfMemoryError(
                f"NPU out of memory: the memory pool's allocator returned no memory for "
                f"{nbytes} bytes")
        block = (ctypes.c_char * nbytes).from_address(ptr)
        # The allocator gets its memory back when the last tensor on it dies.
        weakref.finalize(block, self.allocator.free, ptr, nbytes, device, None)
        return torch.frombuffer(block, dtype=torch.uint8).untyped_storage()

    @staticmethod
    def tensor(storage, dtype, offset, size, stride, inference: bool) -> torch.Tensor:
        t = torch.empty(0, dtype=dtype)
        with torch.inference_mode(inference):
            t.set_(storage, offset, size, stride)
        return t

    def adopt(self, t: torch.Tensor, device: int) -> torch.Tensor:
        """``t``'s contents in memory from this pool's allocator."""
        nbytes = t.untyped_storage().nbytes()
        with _memory.moving(nbytes):  # t's own storage is freed once moved
            storage = self.storage(nbytes, device)
        storage.copy_(t.untyped_storage())
        return self.tensor(storage, t.dtype, t.storage_offset(), t.size(), t.stride(),
                           t.is_inference())

    def new(self, size, dtype, device: int) -> torch.Tensor:
        """A new contiguous tensor in this pool's memory, zero-filled."""
        stride, numel = [], 1
        for n in reversed(size):
            stride.insert(0, numel)
            numel *= max(n, 1)
        storage = self.storage(math.prod(size) * dtype.itemsize, device)
        return self.tensor(storage, dtype, 0, size, stride, torch.is_inference_mode_enabled())


_ACTIVE: list = []  # the pools in use, innermost last
_NEW = {torch.ops.aten.zeros.default, torch.ops.aten.empty.memory_format}


def _plain_cpu(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return (device is None or torch.device(device).type == "cpu") and \
        not kwargs.get("pin_memory") and kwargs.get("layout") in (None, torch.strided) and \
        kwargs.get("memory_format") in (None, torch.contiguous_format)


class _Pooling(TorchDispatchMode):
    """Puts each storage an op makes into the pool (not views, not in-place results): empty()
    and zeros() are made there, any other new storage is moved there."""

    def __init__(self, pool: MemPool, device: int):
        super().__init__()
        self.pool, self.device = pool, device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NEW and _ACTIVE[-1] is self and _plain_cpu(kwargs) and math.prod(args[0]):
            # Made in the pool at once, not on the heap and moved (a KV cache is most of the
            # device): freshly mapped memory is zero, as zeros() wants, and empty() may be.
            return self.pool.new(list(args[0]), kwargs.get("dtype") or
                                 torch.get_default_dtype(), self.device)
        out = func(*args, **kwargs)
        if _ACTIVE[-1] is not self:  # pools nest: the innermost one allocates, as on the chip
            return out
        seen = {t.untyped_storage().data_ptr()
                for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}

        def adopt(t):
            if (not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor
                    or t.device.type != "cpu" or t.untyped_storage().nbytes() == 0
                    or t.untyped_storage().data_ptr() in seen):
                return t
            seen.add(t.untyped_storage().data_ptr())
            return self.pool.adopt(t, self.device)

        return tree_map(adopt, out)


@contextlib.contextmanager
def use_mem_pool(pool: MemPool, device=None):
    mode = _Pooling(pool, _devices.current_device() if device is None else int(device))
    _ACTIVE.append(mode)
    try:
        with mode:
            yield
    finally:
        _ACTIVE.remove(mode)
