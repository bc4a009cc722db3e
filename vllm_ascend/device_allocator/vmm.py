"""Device memory that sleeps: a memory pool whose allocations are CANN virtual memory.

vLLM allocates the weights, the KV cache and a few runtime buffers inside
``use_memory_pool(tag)`` (its allocator protocol, ``vllm.device_allocator.MemAllocator``). Each
allocation the pool asks for is an address range reserved with ``acl.rt.reserve_mem_address``
and backed by physical memory (``malloc_physical`` + ``map_mem``). ``sleep`` copies the tags to
keep to host memory and gives the physical memory back (``unmap_mem`` + ``free_physical``), the
address staying reserved; ``wake_up`` maps new physical memory at the same address and copies
the contents back. So what captured ACL graphs read (weights, KV cache) is where it was, and
they replay without being captured again.

Upstream vllm-ascend does the same with a C++ extension (``vllm_ascend_C``, camem.py); here the
two functions of torch_npu's pluggable allocator are Python callbacks through ctypes, and the
runtime calls are pyACL's (docs/torch_npu_calls.md, "Sleep mode").
"""

import contextlib
import ctypes
import dataclasses

from vllm_ascend import device
from vllm_ascend.device import torch_npu
from vllm_ascend.logger import get_logger

logger = get_logger(__name__)

GRANULARITY = 2 << 20  # the runtime maps physical memory in 2 MB pages
ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST = 1, 2
ACL_MEM_LOCATION_TYPE_DEVICE, ACL_HBM_MEM_HUGE = 1, 0
# torch_npu's pluggable allocator: void* malloc(size_t, int device, aclrtStream) and
# void free(void*, size_t, int device, aclrtStream).
_MALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                            ctypes.c_void_p)
# Selective wake-up may leave only these asleep (vLLM's DEFERRABLE_TAGS): any wake restores the
# others.
DEFERRABLE_TAGS = ("weights", "kv_cache")


class DeviceMemoryError(RuntimeError):
    pass


@dataclasses.dataclass
class _Allocation:
    size: int
    device: int
    tag: str
    handle: int | None  # the physical memory mapped at the address; None while asleep
    backup: int | None = None  # host memory holding the contents while asleep


def _check(ret: int, call: str) -> None:
    if ret != 0:
        raise DeviceMemoryError(f"acl.rt.{call} failed with error {ret}")


class _Router:
    """torch_npu's allocator calls two C functions for the whole process: they route each
    allocation to the NPUMemAllocator whose pool is in use, and each free to its owner."""

    def __init__(self):
        self.active: "NPUMemAllocator | None" = None
        self.owner: dict[int, "NPUMemAllocator"] = {}  # address -> allocator
        self.callbacks = (_MALLOC_FN(self.malloc), _FREE_FN(self.free))  # alive as long as this
        self.allocator = torch_npu._C._npu_customAllocator(
            *(ctypes.cast(fn, ctypes.c_void_p).value for fn in self.callbacks))

    # An exception must not cross into C: it is logged, and a failed allocation returns null,
    # which the pool turns into torch's out-of-memory error.
    def malloc(self, size: int, device_index: int, stream) -> int:
        try:
            if self.active is None:
                raise DeviceMemoryError("an allocation outside use_memory_pool")
            ptr = self.active._map_new(-(-size // GRANULARITY) * GRANULARITY, device_index)
            self.owner[ptr] = self.active
            return ptr
        except Exception as e:
            logger.error("vllm-ascend: sleep-mode pool could not allocate %d bytes: %s", size, e)
            return 0

    def free(self, ptr: int, size: int, device_index: int, stream) -> None:
        try:
            self.owner.pop(ptr)._free(ptr)
        except Exception as e:
            logger.error("vllm-ascend: sleep-mode pool could not free %#x: %s", ptr, e)


_ROUTER: _Router | None = None


class NPUMemAllocator:
    """vLLM's sleep-mode allocator protocol on CANN virtual memory, one per worker: sleeping
    one engine leaves another engine's memory in the same process alone."""

    default_tag = "default"

    def __init__(self):
        global _ROUTER
        if _ROUTER is None:
            _ROUTER = _Router()
        self.acl = device.current.acl
        self.allocations: dict[int, _Allocation] = {}  # address -> allocation
        self.current_tag = self.default_tag
        self._pools: list = []  # torch keeps a pool's memory only while the pool lives

    def _free(self, ptr: int) -> None:
        allocation = self.allocations.pop(ptr)
        if allocation.handle is not None:
            self._release(ptr, allocation)
        self._drop_backup(allocation)
        _check(self.acl.rt.release_mem_address(ptr), "release_mem_address")

    def _map_new(self, size: int, device_index: int) -> int:
        ptr, ret = self.acl.rt.reserve_mem_address(size, 0, 0, 0)
        _check(ret, "reserve_mem_address")
        allocation = _Allocation(size, device_index, self.current_tag, None)
        try:
            self._map(ptr, allocation)
        except Exception:
            self.acl.rt.release_mem_address(ptr)
            raise
        self.allocations[ptr] = allocation
        return ptr

    def _map(self, ptr: int, allocation: _Allocation) -> None:
        prop = {"handleType": 0, "allocationType": 0, "memAttr": ACL_HBM_MEM_HUGE,
                "location": {"id": allocation.device, "type": ACL_MEM_LOCATION_TYPE_DEVICE},
                "reserve": 0}
        handle, ret = self.acl.rt.malloc_physical(allocation.size, prop, 0)
        _check(ret, "malloc_physical")
        ret = self.acl.rt.map_mem(ptr, allocation.size, 0, handle, 0)
        if ret != 0:
            self.acl.rt.free_physical(handle)
            _check(ret, "map_mem")
        allocation.handle = handle

    def _drop_backup(self, allocation: _Allocation) -> None:
        if allocation.backup is not None:
            _check(self.acl.rt.free_host(allocation.backup), "free_host")
            allocation.backup = None

    # -- vLLM's MemAllocator protocol -------------------------------------------------------
    @contextlib.contextmanager
    def use_memory_pool(self, tag: str | None = None):
        """Device tensors made inside are this pool's, tagged ``tag``."""
        pool = torch_npu.npu.memory.MemPool(_ROUTER.allocator)
        self._pools.append(pool)
        previous = self.current_tag, _ROUTER.active
        self.current_tag, _ROUTER.active = tag or self.default_tag, self
        try:
            with torch_npu.npu.memory.use_mem_pool(pool):
                yield
        finally:
            self.current_tag, _ROUTER.active = previous

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        """Release the physical memory of every allocation; ``offload_tags``' contents go to
        host memory first, the rest is discarded."""
        if offload_tags is None:
            offload_tags = (self.default_tag,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        torch_npu.npu.synchronize()  # nothing in flight reads what is released
        for ptr, allocation in self.allocations.items():
            if allocation.handle is None:
                continue
            if allocation.tag in offload_tags:
                host, ret = self.acl.rt.malloc_host(allocation.size)
                _check(ret, "malloc_host")
                allocation.backup = host
                _check(self.acl.rt.memcpy(host, allocation.size, ptr, allocation.size,
                                          ACL_MEMCPY_DEVICE_TO_HOST), "memcpy")
            self._release(ptr, allocation)

    def discard(self, tags: tuple[str, ...] | str) -> None:
        """Release the physical memory of ``tags``' allocations, contents discarded."""
        tags = (tags,) if isinstance(tags, str) else tuple(tags)
        torch_npu.npu.synchronize()
        for ptr, allocation in self.allocations.items():
            if allocation.handle is not None and allocation.tag in tags:
                self._release(ptr, allocation)

    def _release(self, ptr: int, allocation: _Allocation) -> None:
        _check(self.acl.rt.unmap_mem(ptr), "unmap_mem")
        _check(self.acl.rt.free_physical(allocation.handle), "free_physical")
        allocation.handle = None

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Map memory again at the same addresses: ``tags`` (None: all) and every tag that
        cannot stay asleep; offloaded contents are copied back, the rest is undefined."""
        for ptr, allocation in self.allocations.items():
            if allocation.handle is not None or not (
                    tags is None or allocation.tag in tags
                    or allocation.tag not in DEFERRABLE_TAGS):
                continue
            self._map(ptr, allocation)
            if allocation.backup is not None:
                _check(self.acl.rt.memcpy(ptr, allocation.size, allocation.backup,
                                          allocation.size, ACL_MEMCPY_HOST_TO_DEVICE), "memcpy")
                self._drop_backup(allocation)

    def release(self) -> int:
        """At the engine's shutdown: give back the physical memory of every allocation torch
        has not freed (something in the process still references the tensors: vLLM's compiled
        code caches hold a model's parameters). Their addresses stay reserved until the tensors
        die. Returns the bytes released."""
        mapped = [(ptr, a) for ptr, a in self.allocations.items() if a.handle is not None]
        if mapped:
            torch_npu.npu.synchronize()
        for ptr, allocation in mapped:
            self._release(ptr, allocation)
        for allocation in self.allocations.values():
            self._drop_backup(allocation)
        self._pools.clear()
        return sum(a.size for _, a in mapped)

    def asleep_tags(self) -> list[str]:
        """The tags some of whose memory is not mapped now."""
        return sorted({a.tag for a in self.allocations.values() if a.handle is None})

    def get_current_usage(self) -> int:
        """Bytes of physical memory mapped in the pools now."""
        return sum(a.size for a in self.allocations.values() if a.handle is not None)

    def host_copies(self) -> dict[str, int]:
        """tag -> bytes of its contents kept in host memory while asleep."""
        copies: dict[str, int] = {}
        for a in self.allocations.values():
            if a.backup is not None:
                copies[a.tag] = copies.get(a.tag, 0) + a.size
        return copies

    def usage_by_tag(self) -> dict[str, tuple[int, int]]:
        """tag -> (bytes mapped, bytes asleep)."""
        usage: dict[str, tuple[int, int]] = {}
        for a in self.allocations.values():
            mapped, asleep = usage.get(a.tag, (0, 0))
            usage[a.tag] = (mapped + a.size, asleep) if a.handle is not None else \
                (mapped, asleep + a.size)
        return usage
