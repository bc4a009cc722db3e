"""The simulator's ACL graphs: capture records device ops, replay runs only the record.

Between ``capture_begin`` and ``capture_end`` the ops run once, eagerly, under a dispatcher-level
recorder, except the matrix products and attention, which are recorded unrun, as the chip records
a captured task (``_UNRUN``, ``ops.CAPTURING``: the host-side checks run, the output holds garbage
until a replay). Each device op is kept with its tensor arguments by identity and every other
argument (ints, lists, floats) by value. Ops implemented in Python (vLLM's attention and
KV-update custom ops, which read the forward context) are not recorded whole: their CPU kernel
runs under the recorder, so the device ops they issue are what is recorded. At ``capture_end``
the record is frozen as a graph pool would leave it:

* tensors made outside the graph (inputs, weights, the KV cache) are read at their addresses;
* every storage the graph made moves into its pool (``GraphPool``: a caching allocator's private
  pool, shared by the graphs of an engine), placed by liveness: what dies inside the graph
  shares bytes with what comes later, and what Python still holds when the capture ends (the
  callable's output, a workspace kept for updates) becomes a block that its tensors own; when
  they go, the block returns to the pool for the next capture, while this graph keeps reading
  and writing it at replay (outputs are overwritten in place by every replay, and by a later
  graph's replay once the block is someone else's). Capturing the largest size first keeps the
  memory of all sizes near that of the largest;
* replay is a flat list of prepared kernel calls (``.out`` overloads where the op has one), with
  no Python of the model in it, cut where a node waits on an ExternalEvent. The simulator's own
  kernels (``ascend_sim`` ops) are called as the Python functions they are, not through torch's
  dispatcher, and those with a form that writes into given outputs (``ops.REPLAY_INTO``, and
  aten.linear's, ``matmul.prepare_linear``) write into the graph's, as a captured task writes its
  output buffers.

A host synchronisation during capture (``.item()``, ``.tolist()``) or a device-to-host copy
(``.cpu()``, ``.numpy()``, ``.to("cpu")``) raises, as on the chip. Each
live graph holds one stream of the device's budget; exhausting it raises error 207008.
"""

import contextlib
import ctypes
import threading
import weakref

import torch
from torch._C import DispatchKey
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from vllm_ascend.device.sim import acl as _acl
from vllm_ascend.device.sim import ledger as _ledger
from vllm_ascend.device.sim import matmul as _matmul
from vllm_ascend.device.sim import ops as _ops
from vllm_ascend.device.sim import trace as _trace

STREAM_EXHAUSTED_CODE = 207008
_RECORDED_NAMESPACES = {"aten", "prims", "ascend_sim"}
_UNCAPTURABLE_NAMESPACES = {"_c10d_functional", "_c10d_functional_autograd", "c10d_functional"}
# Allocations whose contents are undefined: nothing to redo on replay.
_NO_REPLAY = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
              torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default}
_ALIGN = 64
# Ops whose result is a copy of their first argument.
_COPIES = {torch.ops.aten.contiguous.default, torch.ops.aten.clone.default}


def _plain(*tensors) -> bool:
    """Plain tensors or parameters (weights), not subclasses that run code of their own."""
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


def _product_shape(a, b):
    """(shape, dtype) of ``a @ b`` (mm, bmm), or None where the kernel should run."""
    if (_plain(a, b) and a.dtype == b.dtype
            and a.is_floating_point() and a.dim() == b.dim() and a.dim() in (2, 3)
            and a.shape[-1] == b.shape[-2] and a.shape[:-2] == b.shape[:-2]):
        return (*a.shape[:-1], b.shape[-1]), a.dtype
    return None  # run it: the kernel's own error, or a case not worth recording unrun


# Matrix products, most of a capture's time on the CPU, are recorded without running, as the chip
# records a captured task (it runs at replay only): their result is garbage until a replay fills
# it, so code that reads a capture's output sees garbage here too. Shapes the kernel would refuse
# run and raise as before.
def _biased_shape(bias, a, b, **scales):
    """The same for addmm (``bias`` broadcast to the product's shape)."""
    result = _product_shape(a, b)
    if result is None or not _plain(bias) or bias.dtype != a.dtype:
        return None
    try:
        return result if torch.broadcast_shapes(bias.shape, result[0]) == result[0] else None
    except RuntimeError:
        return None


def _linear_shape(x, weight, bias=None):
    """The same for linear, ``x @ weight.T + bias`` (vLLM's unquantized layers call it whole)."""
    if x.dim() < 1 or weight.dim() != 2:
        return None
    result = _product_shape(x.reshape(-1, x.shape[-1]), weight.t())
    if result is None or (bias is not None and (not _plain(bias) or bias.dtype != x.dtype
                                                or bias.shape != weight.shape[:1])):
        return None
    return (*x.shape[:-1], weight.shape[0]), x.dtype


_UNRUN = {torch.ops.aten.mm.default: _product_shape, torch.ops.aten.bmm.default: _product_shape,
          torch.ops.aten.addmm.default: _biased_shape, torch.ops.aten.linear.default: _linear_shape}


class GraphCaptureError(RuntimeError):
    pass


class GraphReplayError(RuntimeError):
    pass


class StreamResourceError(RuntimeError):
    """The chip ran out of streams (ACL error 207008)."""


class StreamPool:
    """The device's stream budget; every live captured graph holds one stream."""

    def __init__(self, budget_fn):
        self._budget_fn = budget_fn
        self.in_use = 0
        # Reentrant: a graph the garbage collector drops inside acquire() releases its stream.
        self._lock = threading.RLock()

    @property
    def budget(self) -> int:
        return self._budget_fn()

    def acquire(self) -> None:
        with self._lock:
            if self.in_use >= self.budget:
                raise StreamResourceError(
                    f"ACL error {STREAM_EXHAUSTED_CODE}: the stream resources are insufficient "
                    f"({self.in_use} of {self.budget} streams are held by captured graphs)")
            self.in_use += 1

    def release(self) -> None:
        with self._lock:
            self.in_use -= 1


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


class _Placement:
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
_BLOCKS: dict[int, tuple[torch.Tensor, int, int]] = {}


def _block_storage(pool: GraphPool, segment: int, offset: int, nbytes: int):
    """A storage over ``nbytes`` of a pool segment, owning that range: when its last tensor
    goes, the range returns to the pool (and weak references into it read poison)."""
    seg = pool.segments[segment]
    address = seg.data_ptr() + offset
    block = (ctypes.c_char * nbytes).from_address(address)
    _BLOCKS[address] = (seg, offset, nbytes)
    weakref.finalize(block, _block_freed, pool, segment, offset, nbytes, seg)
    return torch.frombuffer(block, dtype=torch.uint8).untyped_storage()


def _block_freed(pool: GraphPool, segment: int, offset: int, nbytes: int, seg) -> None:
    address = seg.data_ptr() + offset
    _BLOCKS.pop(address, None)
    if _live_aliases(address):  # only non-owning references are left: poison, as elsewhere
        _WEAK_ALIASES.pop(address, None)
        with _disable_current_modes():
            _bytes_of(seg.untyped_storage())[offset:offset + nbytes].fill_(_POISON_BYTE)
    pool.release(segment, offset, nbytes)


class _Node:
    __slots__ = ("func", "args", "kwargs", "outs", "group")

    def __init__(self, func, args, kwargs, outs, group):
        self.func, self.args, self.kwargs, self.outs, self.group = func, args, kwargs, outs, group


class _Wait:
    """A captured ``ExternalEvent.wait``: replay stops here until the event is recorded."""

    def __init__(self, event):
        self.event = event


class _HostCall:
    """A host-side graph node (an ExternalEvent reset): replay calls ``fn()`` here."""

    def __init__(self, fn):
        self.fn = fn


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.nodes: list = []  # _Node, _Wait or _HostCall
        self.group = None  # the open task group's id, if any

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ledger.HOST_SYNCS:  # a capture cannot contain them
            raise GraphCaptureError(
                "a host synchronisation (.item() / bool(tensor)) happened during graph capture; "
                "on the chip this fails the capture. Move the host read out of the captured "
                "region (compute it before the forward) or run this model eagerly.")
        if func.namespace == "c10d":
            # A collective (torch.distributed on the device's process group): recorded whole,
            # as the chip captures an HCCL collective; replay issues it again and waits for it.
            out = func(*args, **kwargs)
            self.nodes.append(_Node(func, args, kwargs, out, self.group))
            return out
        if func.namespace in _UNCAPTURABLE_NAMESPACES:
            raise GraphCaptureError(
                f"{func} was issued during graph capture: functional collectives complete "
                "asynchronously into tensors the graph pool reuses, and are not captured. Issue "
                "collectives through torch.distributed on the process group (in place), as "
                "vLLM's device communicator does, or run this model eagerly.")
        if func.namespace not in _RECORDED_NAMESPACES:
            # Implemented in Python: record the device ops it issues, not the call itself.
            with self:
                return func._op_dk(DispatchKey.CPU, *args, **kwargs)
        unrun = _UNRUN.get(func)
        result = unrun(*args, **kwargs) if unrun is not None else None
        if result is not None:
            out = _ops.CAPTURING.unwritten(torch.empty(result[0], dtype=result[1]))
        else:
            out = func(*args, **kwargs)
        self.nodes.append(_Node(func, args, kwargs, out, self.group))
        return out


def _host_copy_error(what: str) -> GraphCaptureError:
    return GraphCaptureError(
        f"a device-to-host copy ({what}) happened during graph capture; on the chip this fails "
        "the capture. Read host values before the captured region.")


def _refusing(name: str):
    def refuse(self, *args, **kwargs):
        raise _host_copy_error(f".{name}()")
    return refuse


def _to_refusing_host(original):
    """Tensor.to during capture: a copy to "cpu" named as a string is the host (vLLM and
    upstream write device copies with the device object, which on the simulator is the CPU)."""
    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, str) and target.split(":")[0] == "cpu":
            raise _host_copy_error(f'.to("{target}")')
        return original(self, *args, **kwargs)
    return to


# Tensor methods that copy device memory to the host without a dispatcher op the recorder sees
# (on the simulator the device tensor already is a host tensor).
_HOST_COPIES = {"tolist": _refusing("tolist"), "numpy": _refusing("numpy"),
                "cpu": _refusing("cpu")}


_OUT_OVERLOADS: dict = {}


def _out_overload(func):
    """The ``.out`` overload taking the same arguments as ``func`` plus out tensors, if any."""
    if func in _OUT_OVERLOADS:
        return _OUT_OVERLOADS[func]
    found = None
    schema = func._schema
    want = [(a.name, str(a.type)) for a in schema.arguments]
    packet = func.overloadpacket
    for name in packet.overloads():
        cand = getattr(packet, name)
        outs = [a.name for a in cand._schema.arguments if a.is_out]
        if not outs or len(outs) != len(schema.returns):
            continue
        if [(a.name, str(a.type)) for a in cand._schema.arguments if not a.is_out] == want:
            found = (cand, outs)
            break
    _OUT_OVERLOADS[func] = found
    return found


def _binding_with_out(func, args, kwargs, targets):
    """torch's own Python binding with out= (the cheapest call), if it computes the same thing."""
    if len(targets) != 1 or func.namespace != "aten":
        return None
    fn = getattr(torch._C._VariableFunctions, func.overloadpacket.__name__, None)
    if fn is None:
        return None
    scratch = torch.empty_like(targets[0])  # the target keeps what the capture left in it
    try:
        expected = func(*args, **kwargs)
        written = fn(*args, **kwargs, out=scratch)
    except Exception:
        return None
    # The binding must write into out= and return it: some (__and__, __or__) accept out= and
    # return NotImplemented without writing.
    if written is not scratch or not isinstance(expected, torch.Tensor) or \
            not torch.equal(expected, scratch):
        return None
    return fn


def _storage_key(t: torch.Tensor) -> int:
    storage = t.untyped_storage()
    # Empty storages may all sit at address 0: each is its own, aliasing nothing.
    return storage.data_ptr() if storage.nbytes() else -id(t)


def _tensors(tree, found=None) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results (lists, tuples and dicts of them): a plain
    walk, as pytree's flatten took a tenth of a capture's time."""
    found = [] if found is None else found
    if isinstance(tree, torch.Tensor):
        found.append(tree)
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            _tensors(x, found)
    elif isinstance(tree, dict):
        for x in tree.values():
            _tensors(x, found)
    return found


def _map(fn, tree):
    """``fn`` applied to every leaf of lists, tuples (named ones too) and dicts, kept in shape."""
    if isinstance(tree, list):
        return [_map(fn, x) for x in tree]
    if isinstance(tree, tuple):
        items = [_map(fn, x) for x in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    if isinstance(tree, dict):
        return {k: _map(fn, v) for k, v in tree.items()}
    return fn(tree)


# -- non-owning references (torch_npu._C._weak_ref_tensor) -----------------------------------------

_WEAK_ALIASES: dict[int, list] = {}  # storage key -> weak references to its non-owning aliases
_POISON_BYTE = 0xFF  # all ones: NaN in every float dtype, -1 in every signed integer one


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
    key = _storage_key(t)
    block = _BLOCKS.get(key)
    with _disable_current_modes():  # not part of a graph being captured
        if block is not None:
            segment, offset, _ = block
            alias = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                segment.untyped_storage(), offset // t.element_size() + t.storage_offset(),
                t.size(), t.stride())
        else:
            alias = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    _WEAK_ALIASES.setdefault(key, []).append(weakref.ref(alias))
    if block is None:
        weakref.finalize(t, _poison_if_unowned, key)
    return alias


def _live_aliases(key: int) -> list[torch.Tensor]:
    aliases = [a for a in (r() for r in _WEAK_ALIASES.get(key, ())) if a is not None]
    if aliases:
        _WEAK_ALIASES[key] = [weakref.ref(a) for a in aliases]
    else:
        _WEAK_ALIASES.pop(key, None)
    return aliases


def _poison_if_unowned(key: int) -> None:
    """Called as an owner of the memory at ``key`` goes: poison it if only aliases hold it."""
    aliases = _live_aliases(key)
    if not aliases:
        return
    storage = aliases[0].untyped_storage()
    # The storage's references: the aliases, the `storage` object just made, the owner going
    # (its weak-reference callbacks run before it lets go of its storage), and other owners.
    if torch._C._storage_Use_Count(storage._cdata) - 2 - len(aliases) > 0:
        return
    with _disable_current_modes():
        torch.empty(0, dtype=torch.uint8).set_(storage).fill_(_POISON_BYTE)


def _move_aliases(key: int, storage, byte_offset: int, owners, watch_key=None) -> None:
    """A storage the capture moved into the pool: its aliases follow it. The tensors that own
    it there (``owners``) poison it for them when they go; or, for a block Python's tensors own,
    the block does when it is freed (``watch_key``: its address)."""
    aliases = _live_aliases(key)
    _WEAK_ALIASES.pop(key, None)
    if not aliases:
        return
    with _disable_current_modes():
        for alias in aliases:
            alias.set_(storage, byte_offset // alias.element_size() + alias.storage_offset(),
                       alias.size(), alias.stride())
    new_key = watch_key if watch_key is not None else _storage_key(aliases[0])
    _WEAK_ALIASES.setdefault(new_key, []).extend(weakref.ref(a) for a in aliases)
    for owner in owners:
        weakref.finalize(owner, _poison_if_unowned, new_key)


class _Slot:
    """Stands for an internal tensor of the record while its liveness is decided."""

    __slots__ = ("k",)

    def __init__(self, k):
        self.k = k


class _Meta:
    __slots__ = ("storage", "key", "offset", "size", "stride", "dtype")

    def __init__(self, t: torch.Tensor):
        self.storage = t.untyped_storage()
        self.key = _storage_key(t)
        self.offset, self.size, self.stride, self.dtype = (t.storage_offset(), t.size(),
                                                           t.stride(), t.dtype)

    def view_of(self, storage, byte_offset: int = 0) -> torch.Tensor:
        t = torch.empty(0, dtype=self.dtype)
        return t.set_(storage, byte_offset // t.element_size() + self.offset, self.size,
                      self.stride)


def _storage_nbytes(storage) -> int:
    return max(_ALIGN, -(-storage.nbytes() // _ALIGN) * _ALIGN)


def _bytes_of(storage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _only_recorded_owners(storage, recorded: int, aliases: list) -> bool:
    """Whether the tensors holding ``storage`` are the ``recorded`` ones the capture made and
    the weak ``aliases`` of it (plus its one Python storage object)."""
    return torch._C._storage_Use_Count(storage._cdata) == 1 + recorded + len(aliases)


def _repoint(t: torch.Tensor, storage) -> None:
    """``t`` reads and writes ``storage`` (a copy of its own) from now on."""
    with _disable_current_modes(), torch.inference_mode(t.is_inference()):
        t.set_(storage, t.storage_offset(), t.size(), t.stride())


class SimGraph:
    """A captured graph: its prepared calls, cut into segments at ExternalEvent waits."""

    def __init__(self, streams: StreamPool):
        self._streams = streams
        self._holds_stream = False
        # Its last two replays, (stream, that stream's replay number): a task update must be
        # ordered after the previous one (sim/npu.py).
        self.last_replays: tuple = (None, None)
        self._extra_streams = 0  # one per communication group captured
        self._recorder: _Recorder | None = None
        self._next_group = 0
        self._inference = False
        self.segments: list = []  # [(calls, wait event or None)]
        self._group_calls: dict[int, list] = {}  # task group -> [(segment, index)]
        self._update_tasks: dict = {}  # (task group, op) -> its [(segment, index)]

    # -- capture ------------------------------------------------------------------------------
    def begin(self) -> None:
        if self.segments:
            raise GraphCaptureError("this graph was already captured; reset() it first")
        self._streams.acquire()
        self._holds_stream = True
        self._inference = torch.is_inference_mode_enabled()
        self._recorder = _Recorder()
        self._saved_methods = {name: getattr(torch.Tensor, name)
                               for name in (*_HOST_COPIES, "to")}
        for name, method in _HOST_COPIES.items():
            setattr(torch.Tensor, name, method)
        torch.Tensor.to = _to_refusing_host(self._saved_methods["to"])
        _ops.CAPTURING.active = True
        self._recorder.__enter__()

    def end(self, pool: GraphPool, failed: bool = False) -> None:
        recorder, self._recorder = self._recorder, None
        recorder.__exit__(None, None, None)
        _ops.CAPTURING.active = False
        for name, method in self._saved_methods.items():
            setattr(torch.Tensor, name, method)
        if recorder.group is not None and not failed:
            self.reset()
            raise GraphCaptureError("capture ended inside a task group: call "
                                    "graph_task_group_end first")
        if failed:
            self.reset()
            return
        nodes = recorder.nodes
        del recorder
        self._freeze(nodes, pool)

    def record_wait(self, event) -> None:
        self._recorder.nodes.append(_Wait(event))

    def record_host_call(self, fn) -> None:
        self._recorder.nodes.append(_HostCall(fn))

    def task_group_begin(self) -> None:
        if self._recorder.group is not None:
            raise RuntimeError("graph_task_group_begin: task groups do not nest")
        self._recorder.group = self._next_group
        self._next_group += 1

    def task_group_end(self) -> int:
        group, self._recorder.group = self._recorder.group, None
        if group is None:
            raise RuntimeError("graph_task_group_end without graph_task_group_begin")
        return group

    # -- freezing the record ------------------------------------------------------------------
    def _freeze(self, nodes: list, pool: GraphPool) -> None:
        metas, first_def, last_use, refs = _to_slots(nodes)
        frozen = nodes  # converted in place: the record no longer holds internal tensors
        # Which internal tensors does Python still hold (the output, what the caller kept)?
        alive = {k: t for k, t in ((k, r()) for k, r in enumerate(refs)) if t is not None}
        storages = {m.key: m.storage for m in metas}
        kept = {metas[k].key for k in alive}
        # Storages made in the graph go into the pool; one that Python still holds becomes a
        # block of its own there, unless something the record does not know holds it too (it
        # keeps its memory then, and the graph with it).
        stay = {key for key in kept if key not in first_def or not _only_recorded_owners(
            storages[key], sum(metas[k].key == key for k in alive), _live_aliases(key))}
        placed = sorted((key for key in first_def if key not in stay), key=first_def.get)
        sizes = {key: _storage_nbytes(storages[key]) for key in placed}
        by_def: dict[int, list[int]] = {}
        frees: dict[int, list[int]] = {}
        for key in placed:
            by_def.setdefault(first_def[key], []).append(key)
            if key not in kept:  # the graph's own: free after its last use
                frees.setdefault(last_use[key], []).append(key)
        where: dict[int, tuple[int, int]] = {}
        with _Placement(pool) as placement:
            for i in range(len(frozen)):
                for key in by_def.get(i, ()):
                    where[key] = placement.place(sizes[key])
                for key in frees.get(i, ()):
                    placement.release(*where[key], sizes[key])
        segments = [seg.untyped_storage() for seg in pool.segments]
        blocks = {}
        for key in kept - stay:  # Python's tensors own a block of the pool from now on
            blocks[key] = _block_storage(pool, *where[key], sizes[key])
            with _disable_current_modes():
                _bytes_of(blocks[key])[:storages[key].nbytes()].copy_(_bytes_of(storages[key]))
        tensors = {}
        for k, m in enumerate(metas):
            if m.key in where:
                seg, offset = where[m.key]
                tensors[k] = m.view_of(segments[seg], offset)
                if k in alive:
                    _repoint(alive[k], blocks[m.key])
            elif m.key in _BLOCKS:  # a view of an earlier capture's output, passed through
                segment, offset, _ = _BLOCKS[m.key]
                tensors[k] = m.view_of(segment.untyped_storage(), offset)
            elif k in alive:
                tensors[k] = alive[k]
            else:
                tensors[k] = m.view_of(m.storage)
        # Non-owning aliases of moved storages (upstream keeps FIA's query and output that way)
        # point where the graph now reads and writes them.
        for key in set(where) & set(_WEAK_ALIASES):
            seg, offset = where[key]
            if key in blocks:  # watched by the block: poisoned when it is freed
                _move_aliases(key, segments[seg], offset, (), watch_key=blocks[key].data_ptr())
            else:  # watched by the graph's tensors and the segment
                _move_aliases(key, segments[seg], offset,
                              [*(tensors[k] for k, m in enumerate(metas) if m.key == key),
                               pool.segments[seg]])
        del alive, metas, storages, blocks

        plain: dict[int, torch.Tensor] = {}

        def real(x):
            if isinstance(x, _Slot):
                return tensors[x.k]
            if isinstance(x, torch.Tensor) and _storage_key(x) in _BLOCKS:
                # An earlier capture's output, passed in: the graph reads the pool's memory
                # where it lies, without keeping the block allocated.
                if id(x) not in plain:
                    segment, offset, _ = _BLOCKS[_storage_key(x)]
                    plain[id(x)] = _Meta(x).view_of(segment.untyped_storage(), offset)
                return plain[id(x)]
            if isinstance(x, torch.Tensor) and type(x) is not torch.Tensor:
                # A tensor subclass made outside the graph (vLLM's weight Parameters define
                # __torch_function__): the device reads its memory, not its Python class, so the
                # kernel gets a plain tensor of the same storage.
                if id(x) not in plain:
                    plain[id(x)] = x.as_subclass(torch.Tensor)
                return plain[id(x)]
            return x

        segments, calls = [], []
        groups: set[str] = set()  # the communication groups the graph's collectives use
        ctx = torch.inference_mode() if self._inference else contextlib.nullcontext()
        with ctx:
            for entry in frozen:
                if isinstance(entry, _Wait):
                    segments.append((calls, entry.event))
                    calls = []
                    continue
                if isinstance(entry, _HostCall):
                    calls.append((entry.fn, (), {}, None))
                    continue
                kind, func, args, kwargs, outs, group = entry
                if func.namespace == "c10d":
                    kind = "collective"  # in place on its inputs, whatever its schema says
                elif kind == "view" or (kind == "compute" and func in _NO_REPLAY):
                    continue  # views are resolved once; undefined allocations need no work
                args, kwargs = _map(real, args), _map(real, kwargs)
                if kind == "collective":
                    calls.append((_collective(func), args, kwargs, group))
                    groups.update(_group_name(a) for a in tree_flatten((args, kwargs))[0]
                                  if isinstance(a, torch.ScriptObject) and
                                  "ProcessGroup" in str(a._type()))
                elif kind == "mutate":
                    calls.append((_kernel_of(func, func), args, kwargs, group))
                else:
                    calls.append(_compute_call(func, args, kwargs,
                                                    [real(o) for o in outs], group))
        segments.append((calls, None))
        # As on the chip, each communication group captured in a graph costs it one more stream.
        for _ in groups:
            self._streams.acquire()
            self._extra_streams += 1
        self.segments = segments
        self._group_calls, self._update_tasks = {}, {}
        for s, (seg_calls, _) in enumerate(segments):
            for i, call in enumerate(seg_calls):
                if call[3] is not None:
                    self._group_calls.setdefault(call[3], []).append((s, i))

    # -- task updates -------------------------------------------------------------------------
    def task_update(self, group: int, func, args: tuple, kwargs: dict):
        """Check a task update of the group's ``func`` node; returns the function that applies
        it (the node runs with the new host arguments from then on). Tensor arguments must be
        the captured ones (same address and shape)."""
        found = self._update_tasks.get((group, func))  # (an update keeps each node's kernel)
        if found is None:
            found = self._update_tasks[group, func] = [
                (s, i) for s, i in self._group_calls.get(group, ())
                if _DIRECT.get(self.segments[s][0][i][0], self.segments[s][0][i][0]) is func]
        if len(found) != 1:
            raise RuntimeError(f"graph_task_update: task group {group} holds {len(found)} "
                               f"{func} tasks, not 1: the update must re-issue the captured op")
        s, i = found[0]
        fn, old_args, old_kwargs, _ = self.segments[s][0][i]
        old = _flat_args(func, old_args, old_kwargs)
        new = _flat_args(func, args, kwargs)
        for name, value in new.items():
            was = old.get(name)
            if value is was:  # the same object (a tensor: the same address and shape now)
                continue
            if isinstance(was, torch.Tensor) != isinstance(value, torch.Tensor) or (
                    isinstance(value, torch.Tensor) and (value.data_ptr() != was.data_ptr()
                                                         or value.shape != was.shape)):
                raise RuntimeError(
                    f"graph_task_update: {name} is not the captured tensor (a task update may "
                    "change host arguments only; tensors must keep their address and shape)")
        call, segments = (fn, tuple(args), dict(kwargs), group), self.segments

        def apply():
            if self.segments is segments:  # not reset since (a reset graph has no tasks)
                segments[s][0][i] = call
        return apply

    # -- replay -------------------------------------------------------------------------------
    def run(self, start: int = 0) -> int | None:
        """Run the segments from ``start``; returns the segment index it is blocked at (its
        event not recorded), or None when the replay finished."""
        if _acl.any_unmapped():  # some device memory sleeps
            self._check_mapped(start)
        ctx = torch.inference_mode() if self._inference else contextlib.nullcontext()
        counting = _ledger.is_open()
        with ctx, _ledger.replaying():
            for s in range(start, len(self.segments)):
                calls, wait = self.segments[s]
                for fn, args, kwargs, _ in calls:
                    try:
                        if counting and _op_called(fn) is not None:
                            with _ledger.replayed_kernel(_op_called(fn)):
                                fn(*args, **kwargs)
                        else:
                            fn(*args, **kwargs)
                    except Exception as e:  # the op's own error, saying which replayed op
                        op = _DIRECT.get(fn, getattr(fn, "func", fn))
                        e.add_note(f"while replaying {op} with {_describe(args)} "
                                   f"{_describe(kwargs)}")
                        raise
                if wait is not None and not wait.consume_for(self, s + 1):
                    return s + 1
        return None

    def _check_mapped(self, start: int) -> None:
        """A replay reads and writes its tensors where they were at capture: on the chip, an
        address whose memory was unmapped (sleep mode) faults the AI core, reported at the next
        synchronize; here before anything runs."""
        for calls, _ in self.segments[start:]:
            for fn, args, kwargs, _ in calls:
                for t in _tensors((args, kwargs)):
                    storage = t.untyped_storage()
                    hole = _acl.unmapped_range_holding(storage.data_ptr(), storage.nbytes())
                    if hole is not None:
                        raise GraphReplayError(
                            f"ACL error {_acl.ACL_ERROR_RT_AICORE_EXCEPTION} (aicore exception): "
                            f"the graph's {getattr(fn, 'func', fn)} reads device memory at "
                            f"{storage.data_ptr():#x}, in a range whose physical memory is "
                            f"unmapped ({hole[0]:#x}, {hole[1]} bytes): the memory went to "
                            "sleep and was not woken up before the replay")

    def reset(self) -> None:
        self.segments = []
        self._group_calls, self._update_tasks = {}, {}
        if self._holds_stream:
            self._holds_stream = False
            self._streams.release()
        while self._extra_streams:
            self._extra_streams -= 1
            self._streams.release()

    def __del__(self):
        try:
            self.reset()
        except Exception:
            pass


def _compute_call(func, args, kwargs, targets, group):
    """A prepared call that recomputes ``func`` into ``targets`` (its captured outputs)."""
    if func in _COPIES:
        return (targets[0].copy_, (args[0],), {}, group)
    write = _writer(func, args, kwargs, targets)
    if write is not None:
        return (write, args, kwargs, group)
    fast = _binding_with_out(func, args, kwargs, targets)
    if fast is not None:
        return (fast, args, dict(kwargs, out=targets[0]), group)
    out = _out_overload(func)
    if out is not None:
        overload, names = out
        kw = dict(kwargs)
        kw.update(zip(names, targets))
        return (overload._op, args, kw, group)

    compute = _kernel_of(func, func._op)

    def run_then_copy(*a, **kw):
        for t, r in zip(targets, _tensors(compute(*a, **kw))):
            t.copy_(r)

    run_then_copy.func, run_then_copy.kernel = func, compute
    return (run_then_copy, args, kwargs, group)


# A replayed simulator kernel -> its op: a replay calls the kernel's Python function itself (the
# dispatcher's boxing of FIA's twenty arguments cost 13 of a decode call's 56 us).
_DIRECT: dict = {}


def _kernel_of(func, otherwise):
    """What a replay calls for ``func``: an ascend_sim op's replay form (ops.REPLAY) or Python
    kernel, else ``otherwise``."""
    if func.namespace != "ascend_sim":
        return otherwise
    overload = func._overloadname
    name = func._schema.name.split("::")[1] + ("" if overload == "default" else f".{overload}")
    fn = _ops.REPLAY.get(name) or _trace.KERNELS[name]
    _DIRECT[fn] = func
    return fn


def _writer(func, args, kwargs, targets):
    """A call that writes ``func``'s results into ``targets``, if the op has one: an ascend_sim
    op's kernel (ops.REPLAY_INTO), aten.linear's product (matmul.prepare_linear)."""
    if func._overloadname != "default":
        return None
    if func is torch.ops.aten.linear.default:
        kernel = _matmul.prepare_linear
        write = kernel(targets, *args, **kwargs)
    else:
        kernel = _ops.REPLAY_INTO.get(func._schema.name.split("::")[1]) \
            if func.namespace == "ascend_sim" else None
        if kernel is None:
            return None

        def write(*a, **kw):
            kernel(targets, *a, **kw)
    _DIRECT[kernel] = func
    write.func, write.kernel = func, kernel
    return write


def _op_called(fn):
    """The ascend_sim op a prepared call runs without the dispatcher, if any (for the ledger)."""
    return _DIRECT.get(getattr(fn, "kernel", fn))


def _describe(tree) -> str:
    return str(tree_map(lambda x: f"tensor{tuple(x.shape)}:{x.dtype}" if isinstance(
        x, torch.Tensor) else x, tree))


def _group_name(process_group: torch.ScriptObject) -> str:
    # The dispatcher passes each call a fresh wrapper of the same c10d ProcessGroup.
    return torch._C._distributed_c10d.ProcessGroup.unbox(process_group).group_name


def _collective(func):
    """A replayed collective: issue it again and wait for its completion (its Work)."""
    def run(*args, **kwargs):
        for x in tree_flatten(func._op(*args, **kwargs))[0]:
            if isinstance(x, torch.ScriptObject) and "Work" in str(x._type()):
                x.wait()
    return run


def _to_slots(nodes: list):
    """Replace, in place, each recorded op by (kind, func, args, kwargs, outs, group) in which
    the tensors the record produced are _Slots. Returns their metadata, the node allocating
    each storage, the last node using it, and weak references to the tensors."""
    internal: dict[int, int] = {}  # id(tensor) -> slot
    metas: list[_Meta] = []
    holders: list[torch.Tensor] = []  # keeps ids unique until the weak references are taken
    first_def: dict[int, int] = {}
    last_use: dict[int, int] = {}

    def slot(x):
        if isinstance(x, torch.Tensor) and id(x) in internal:
            return _Slot(internal[id(x)])
        return x

    for i, node in enumerate(nodes):
        if not isinstance(node, _Node):
            continue
        ins = _tensors((node.args, node.kwargs))
        in_keys = {_storage_key(t) for t in ins}
        for t in ins:
            if id(t) in internal:
                last_use[metas[internal[id(t)]].key] = i
        outs = _tensors(node.outs)
        mutable = node.func._schema.is_mutable
        aliased = [_storage_key(o) in in_keys for o in outs]
        if not mutable and any(aliased) and not all(aliased):
            raise GraphCaptureError(f"{node.func} returns a partial alias; not simulated")
        kind = "mutate" if mutable else ("view" if outs and all(aliased) else "compute")
        for o, alias in zip(outs, aliased):
            if id(o) in internal or (mutable and alias):
                continue  # an in-place op returns its (already known) input
            internal[id(o)] = len(metas)
            metas.append(_Meta(o))
            holders.append(o)
            key = metas[-1].key
            if kind != "view" and not alias:
                first_def.setdefault(key, i)
            last_use[key] = i
        nodes[i] = (kind, node.func, _map(slot, node.args), _map(slot, node.kwargs),
                    [slot(o) for o in outs], node.group)
    return metas, first_def, last_use, [weakref.ref(t) for t in holders]


_ARG_NAMES: dict = {}


def _flat_args(func, args, kwargs) -> dict:
    names = _ARG_NAMES.get(func)
    if names is None:
        names = _ARG_NAMES[func] = [a.name for a in func._schema.arguments]
    flat = dict(zip(names, args))
    flat.update(kwargs)
    return flat


def _alloc(free: list, top: int, size: int) -> tuple[int, int]:
    for k, (off, sz) in enumerate(free):
        if sz >= size:
            if sz == size:
                free.pop(k)
            else:
                free[k] = (off + size, sz - size)
            return off, top
    return top, top + size


def _release(free: list, off: int, size: int) -> None:
    free.append((off, size))
    free.sort()
    merged = []
    for o, s in free:
        if merged and merged[-1][0] + merged[-1][1] == o:
            merged[-1] = (merged[-1][0], merged[-1][1] + s)
        else:
            merged.append((o, s))
    free[:] = merged
