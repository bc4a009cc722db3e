"""pyACL (``acl``) on the CPU, as far as vllm-ascend calls it: the runtime's virtual memory
management (``acl.rt``), which sleep mode is built on, and ``memcpy``.

On a chip, ``reserve_mem_address`` reserves device virtual addresses, ``malloc_physical``
allocates device memory in 2 MB pages, ``map_mem`` backs the addresses with it and
``unmap_mem``/``free_physical`` give it back while the addresses stay reserved: what was
captured at an address (an ACL graph's task) reads whatever is mapped there at replay. Here
the host is the device: a reservation is an anonymous ``mmap`` with no access, mapping grants
access, unmapping drops the pages (``MADV_DONTNEED``) and the access, so nothing can be read
there until it is mapped again. Physical memory counts as torch's (it is allocated through a
pool of torch's allocator) in sim/memory.py, and the device's capacity bounds it.

Each call returns pyACL's ``(value, ret)`` or ``ret``, with the runtime's error codes
(include/acl/error_codes/rt_error_codes.h): 107000 for an invalid argument (an unaligned size or
address, a handle or address that is not live, mapping over a mapping), 207001 when the device
has no memory left. A graph replay that reads an address whose memory is unmapped fails with
507015 (sim/graph.py), where the chip reports the AI core's memory fault at the next synchronize.
"""

import ctypes
import ctypes.util
import itertools
import threading

from vllm_ascend.device.sim import devices as _devices
from vllm_ascend.device.sim import memory as _memory

ACL_SUCCESS = 0
ACL_ERROR_RT_PARAM_INVALID = 107000
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001
ACL_ERROR_RT_AICORE_EXCEPTION = 507015
GRANULARITY = 2 << 20  # the runtime's page for physical memory and mappings
ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST = 1, 2

_PROT_NONE, _PROT_READ_WRITE = 0, 3
_MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x02, 0x20, 0x4000
_MADV_DONTNEED = 4
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.reserved: dict[int, int] = {}  # virtual address -> size
        self.mapped: dict[int, int] = {}  # virtual address -> physical handle
        self.physical: dict[int, int] = {}  # handle -> size
        self.host: dict[int, int] = {}  # pinned host memory (malloc_host) -> size
        self.handles = itertools.count(1)
        self.unmapped_reservations = 0  # reservations without memory: replays check addresses
        self.writes = 0  # maps, unmaps and copies into device memory: torch sees none of them


_STATE = _State()


def raw_writes() -> int:
    """How many times ACL has mapped, unmapped or copied into device memory in this process:
    writes no tensor's version counter sees (sim/matmul.py's packed weights are made again)."""
    return _STATE.writes


def _aligned(n) -> bool:
    return isinstance(n, int) and n > 0 and n % GRANULARITY == 0


def physical_bytes() -> int:
    """Device memory allocated by malloc_physical and not freed."""
    return sum(_STATE.physical.values())


def any_unmapped() -> bool:
    """Whether some reserved range has no memory mapped (cheap: asked before each replay)."""
    return _STATE.unmapped_reservations > 0


def unmapped_range_holding(address: int, nbytes: int) -> tuple[int, int] | None:
    """The reserved range without memory that [address, address + nbytes) touches, if any."""
    if not _STATE.unmapped_reservations:
        return None
    for base, size in _STATE.reserved.items():
        if base not in _STATE.mapped and address < base + size and base < address + nbytes:
            return base, size
    return None


class rt:  # noqa: N801  (pyACL's module name)
    @staticmethod
    def reserve_mem_address(size, alignment, expect_ptr, flags):
        if not _aligned(size) or alignment != 0 or expect_ptr != 0 or flags != 0:
            return 0, ACL_ERROR_RT_PARAM_INVALID  # alignment/expect_ptr/flags: reserved, 0
        ptr = _libc.mmap(None, size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE,
                         -1, 0)
        if ptr in (None, ctypes.c_void_p(-1).value):
            return 0, ACL_ERROR_RT_MEMORY_ALLOCATION
        with _STATE.lock:
            _STATE.reserved[ptr] = size
            _STATE.unmapped_reservations += 1
        return ptr, ACL_SUCCESS

    @staticmethod
    def release_mem_address(vir_ptr):
        with _STATE.lock:
            if vir_ptr not in _STATE.reserved or vir_ptr in _STATE.mapped:
                return ACL_ERROR_RT_PARAM_INVALID  # not reserved, or still mapped
            size = _STATE.reserved.pop(vir_ptr)
            _STATE.unmapped_reservations -= 1
        _libc.munmap(vir_ptr, size)
        return ACL_SUCCESS

    @staticmethod
    def malloc_physical(size, prop, flags):
        if not _aligned(size) or flags != 0 or not isinstance(prop, dict):
            return 0, ACL_ERROR_RT_PARAM_INVALID
        with _STATE.lock:
            if not _memory.can_allocate(size, _devices.total_memory()):
                return 0, ACL_ERROR_RT_MEMORY_ALLOCATION
            handle = next(_STATE.handles)
            _STATE.physical[handle] = size
        _memory.physical_changed(physical_bytes())
        return handle, ACL_SUCCESS

    @staticmethod
    def free_physical(handle):
        with _STATE.lock:
            if handle not in _STATE.physical or handle in _STATE.mapped.values():
                return ACL_ERROR_RT_PARAM_INVALID  # not allocated, or still mapped
            del _STATE.physical[handle]
        _memory.physical_changed(physical_bytes())
        return ACL_SUCCESS

    @staticmethod
    def map_mem(vir_ptr, size, offset, handle, flags):
        with _STATE.lock:
            if (_STATE.reserved.get(vir_ptr) != size or _STATE.physical.get(handle) != size
                    or offset != 0 or flags != 0 or vir_ptr in _STATE.mapped
                    or handle in _STATE.mapped.values()):
                return ACL_ERROR_RT_PARAM_INVALID
            if _libc.mprotect(vir_ptr, size, _PROT_READ_WRITE) != 0:
                return ACL_ERROR_RT_MEMORY_ALLOCATION
            _STATE.mapped[vir_ptr] = handle
            _STATE.unmapped_reservations -= 1
            _STATE.writes += 1
        return ACL_SUCCESS

    @staticmethod
    def unmap_mem(vir_ptr):
        with _STATE.lock:
            if vir_ptr not in _STATE.mapped:
                return ACL_ERROR_RT_PARAM_INVALID
            size = _STATE.reserved[vir_ptr]
            _libc.madvise(vir_ptr, size, _MADV_DONTNEED)  # the pages go back: contents lost
            _libc.mprotect(vir_ptr, size, _PROT_NONE)
            del _STATE.mapped[vir_ptr]
            _STATE.unmapped_reservations += 1
            _STATE.writes += 1
        return ACL_SUCCESS

    @staticmethod
    def malloc_host(size):
        """Page-locked host memory (not the device's: outside sim/memory.py's heap)."""
        if not isinstance(size, int) or size <= 0:
            return 0, ACL_ERROR_RT_PARAM_INVALID
        ptr = _libc.mmap(None, size, _PROT_READ_WRITE, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
        if ptr in (None, ctypes.c_void_p(-1).value):
            return 0, ACL_ERROR_RT_MEMORY_ALLOCATION
        with _STATE.lock:
            _STATE.host[ptr] = size
        return ptr, ACL_SUCCESS

    @staticmethod
    def free_host(host_ptr):
        with _STATE.lock:
            size = _STATE.host.pop(host_ptr, None)
        if size is None:
            return ACL_ERROR_RT_PARAM_INVALID
        _libc.munmap(host_ptr, size)
        return ACL_SUCCESS

    @staticmethod
    def memcpy(dst, dest_max, src, count, kind):
        """Host <-> device copies of ``count`` bytes between malloc_host memory and mapped
        device memory."""
        if kind not in (ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST) or count < 0 \
                or dest_max < count:
            return ACL_ERROR_RT_PARAM_INVALID
        device_side, host_side = (dst, src) if kind == ACL_MEMCPY_HOST_TO_DEVICE else (src, dst)
        if not _mapped(device_side, count) or not _in_host(host_side, count):
            return ACL_ERROR_RT_PARAM_INVALID
        ctypes.memmove(dst, src, count)
        _STATE.writes += kind == ACL_MEMCPY_HOST_TO_DEVICE
        return ACL_SUCCESS


def _inside(address: int, nbytes: int, ranges) -> bool:
    """Whether [address, address + nbytes) lies within one of ``ranges`` ((base, size) pairs)."""
    return any(base <= address and address + nbytes <= base + size for base, size in ranges)


def _in_host(address: int, nbytes: int) -> bool:
    return _inside(address, nbytes, _STATE.host.items())


def _mapped(address: int, nbytes: int) -> bool:
    return _inside(address, nbytes, ((base, _STATE.reserved[base]) for base in _STATE.mapped))
