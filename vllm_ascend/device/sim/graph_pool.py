"""The memory of the simulator's ACL graphs: a graph pool (a private pool of the chip's caching
allocator, shared by an engine's graphs) in which each capture places the storages it made, by
liveness (``Placement``); the blocks of it that a capture's outputs own once the capture ends
(``block_storage``); and torch_npu's non-owning references (``weak_ref_tensor``), which read
poison once their memory's owner is gone, as the chip's would read memory given to someone else.
sim/graph.py moves a capture's storages here when it freezes the record.
"""

import ctypes
import threading
import weakref

import torch
from torch.utils._python_dispatch import _disable_current_modes

_ALIGN = 64


class GraphPool:
    """Memory shared by graphs, as a private pool of the chip's caching allocator: segments of
    device memory in which each capture places the storages it made, by liveness.

    Once a capture ends, what it made that Python no longer holds is free for the next capture
    (graphs of one pool never run at once, so a later graph may use it as its own); what Python
    still holds (the capture's output, passed on to the next piece) stays allocated as a block of
    its own until its last tensor goes, and then returns to the pool. The graph keeps reading and
    writing its memory at replay whoever owns it now, as a captured graph does on the chip.
    Capturing the largest size first keeps the pool near that size's needs. A capture that does
    not fit in the free ranges adds one segment."""

    def __init__(self):
        self.segments: list[torch.Tensor] = []  # uint8
        self.free: list[tuple[int, int, int]] = []  # (segment, offset, bytes), merged
        self._lock = threading.RLock()

    @property
    def nbytes(self) -> int:
        return sum(seg.numel() for seg in self.segments)

    def release(self, segment: int, offset: int, nbytes: int) -> None:
        """A block's last tensor went: its range is free for the next capture."""
        with self._lock:
            _free_range(self.free, segment, offset, nbytes)


def _free_range(free: list, segment: int, offset: int, nbytes: int) -> None:
    free.append((segment, offset, nbytes))
    free.sort()
    merged: list = []
    for seg, off, size in free:
        if merged and merged[-1][0] == seg and merged[-1][1] + merged[-1][2] == off:
            merged[-1] = (seg, merged[-1][1], merged[-1][2] + size)
        else:
            merged.append((seg, off, size))
    free[:] = merged


class Placement:
    """One capture's storages placed in a pool by liveness, in program order: first fit in the
    pool's free ranges, else in one new segment that grows as needed. Holds the pool's lock
    until ``commit`` (a block freed meanwhile, by this thread, joins the free ranges at once)."""

    def __init__(self, pool: GraphPool):
        self.pool = pool
        self.new = len(pool.segments)  # the index a new segment gets
        self.top = 0  # bytes of the new segment placed so far

    def __enter__(self):
        self.pool._lock.acquire()
        return self

    def __exit__(self, exc_type, exc, tb):
        pool = self.pool
        try:
            if exc_type is None and self.top:
                pool.segments.append(torch.zeros(self.top, dtype=torch.uint8))
            elif exc_type is not None:  # nothing was placed after all
                pool.free = [r for r in pool.free if r[0] != self.new]
        finally:
            pool._lock.release()

    def place(self, nbytes: int) -> tuple[int, int]:
        free = self.pool.free
        for k, (seg, off, size) in enumerate(free):
            if size >= nbytes and seg != self.new:
                free[k:k + 1] = [(seg, off + nbytes, size - nbytes)] if size > nbytes else []
                return seg, off
        for k, (seg, off, size) in enumerate(free):
            if seg == self.new and (size >= nbytes or off + size == self.top):
                # (a free tail of the new segment grows into new bytes)
                free.pop(k)
                if size > nbytes:
                    _free_range(free, seg, off + nbytes, size - nbytes)
                self.top = max(self.top, off + nbytes)
                return seg, off
        offset, self.top = self.top, self.top + nbytes
        return self.new, offset

    def release(self, segment: int, offset: int, nbytes: int) -> None:
        _free_range(self.pool.free, segment, offset, nbytes)


# A pool block a capture's output was moved into (a storage of its own over pool memory):
# its data pointer -> (the segment, the byte offset in it, bytes).
BLOCKS: dict[int, tuple[torch.Tensor, int, int]] = {}


def block_storage(pool: GraphPool, segment: int, offset: int, nbytes: int):
    """A storage over ``nbytes`` of a pool segment, owning that range: when its last tensor
    goes, the range returns to the pool (and weak references into it read poison)."""
    seg = pool.segments[segment]
    address = seg.data_ptr() + offset
    block = (ctypes.c_char * nbytes).from_address(address)
    BLOCKS[address] = (seg, offset, nbytes)
    weakref.finalize(block, _block_freed, pool, segment, offset, nbytes, seg)
    return torch.frombuffer(block, dtype=torch.uint8).untyped_storage()


def _block_freed(pool: GraphPool, segment: int, offset: int, nbytes: int, seg) -> None:
    address = seg.data_ptr() + offset
    BLOCKS.pop(address, None)
    if live_aliases(address):  # only non-owning references are left: poison, as elsewhere
        WEAK_ALIASES.pop(address, None)
        with _disable_current_modes():
            bytes_of(seg.untyped_storage())[offset:offset + nbytes].fill_(POISON_BYTE)
    pool.release(segment, offset, nbytes)


def storage_key(t: torch.Tensor) -> int:
    storage = t.untyped_storage()
    # Empty storages may all sit at address 0: each is its own, aliasing nothing.
    return storage.data_ptr() if storage.nbytes() else -id(t)


# -- non-owning references (torch_npu._C._weak_ref_tensor) -----------------------------------------

WEAK_ALIASES: dict[int, list] = {}  # storage key -> weak references to its non-owning aliases
POISON_BYTE = 0xFF  # all ones: NaN in every float dtype, -1 in every signed integer one


def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """An alias of ``t`` that does not own its memory, as torch_npu's is. torch has no
    non-owning CPU tensor, so the alias shares the storage and the simulator watches it: when
    nothing but such aliases holds the memory (its owner was released: a tensor dropped, a graph
    reset, a pool freed), the memory is poisoned, so a reader sees NaN (or -1) where the chip
    would read memory given to someone else. What is watched: ``t`` itself and, for memory a
    capture moved into its pool, the graph's tensors and the pool (an owner made from ``t``
    elsewhere, such as a view, is not: while it lives the memory counts as owned). For a
    capture's output (a block of the pool that Python's tensors own), the alias reads the pool's
    memory, so it does not keep the block allocated; the block's range is poisoned when it
    returns to the pool."""
    key = storage_key(t)
    block = BLOCKS.get(key)
    with _disable_current_modes():  # not part of a graph being captured
        if block is not None:
            segment, offset, _ = block
            alias = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                segment.untyped_storage(), offset // t.element_size() + t.storage_offset(),
                t.size(), t.stride())
        else:
            alias = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    WEAK_ALIASES.setdefault(key, []).append(weakref.ref(alias))
    if block is None:
        weakref.finalize(t, _poison_if_unowned, key)
    return alias


def live_aliases(key: int) -> list[torch.Tensor]:
    aliases = [a for a in (r() for r in WEAK_ALIASES.get(key, ())) if a is not None]
    if aliases:
        WEAK_ALIASES[key] = [weakref.ref(a) for a in aliases]
    else:
        WEAK_ALIASES.pop(key, None)
    return aliases


def _poison_if_unowned(key: int) -> None:
    """Called as an owner of the memory at ``key`` goes: poison it if only aliases hold it."""
    aliases = live_aliases(key)
    if not aliases:
        return
    storage = aliases[0].untyped_storage()
    # The storage's references: the aliases, the `storage` object just made, the owner going
    # (its weak-reference callbacks run before it lets go of its storage), and other owners.
    if torch._C._storage_Use_Count(storage._cdata) - 2 - len(aliases) > 0:
        return
    with _disable_current_modes():
        torch.empty(0, dtype=torch.uint8).set_(storage).fill_(POISON_BYTE)


def move_aliases(key: int, storage, byte_offset: int, owners, watch_key=None) -> None:
    """A storage the capture moved into the pool: its aliases follow it. The tensors that own
    it there (``owners``) poison it for them when they go; or, for a block Python's tensors own,
    the block does when it is freed (``watch_key``: its address)."""
    aliases = live_aliases(key)
    WEAK_ALIASES.pop(key, None)
    if not aliases:
        return
    with _disable_current_modes():
        for alias in aliases:
            alias.set_(storage, byte_offset // alias.element_size() + alias.storage_offset(),
                       alias.size(), alias.stride())
    new_key = watch_key if watch_key is not None else storage_key(aliases[0])
    WEAK_ALIASES.setdefault(new_key, []).extend(weakref.ref(a) for a in aliases)
    for owner in owners:
        weakref.finalize(owner, _poison_if_unowned, new_key)


def storage_nbytes(storage) -> int:
    return max(_ALIGN, -(-storage.nbytes() // _ALIGN) * _ALIGN)


def bytes_of(storage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)
