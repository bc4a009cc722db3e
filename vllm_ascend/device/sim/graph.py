"""The simulator's ACL graphs: capture records device ops, replay runs only the record.

Between ``capture_begin`` and ``capture_end`` the ops run once, eagerly, under a dispatcher-level
recorder. Each device op is kept with its tensor arguments by identity and every other argument
(ints, lists, floats) by value. Ops implemented in Python (vLLM's attention and KV-update custom
ops, which read the forward context) are not recorded whole: their CPU kernel runs under the
recorder, so the device ops they issue are what is recorded. At ``capture_end`` the record is
frozen as a graph pool would leave it:

* tensors made outside the graph (inputs, weights, the KV cache) are read at their addresses;
* tensors still referenced from Python when the capture ends (the callable's output, whatever
  the caller kept) keep their storage: replay overwrites them in place;
* every other intermediate moves into the pool's scratch arena, reusing bytes by liveness; all
  graphs of a pool share the arena (they never run at once), so capturing the largest size first
  keeps the memory of all sizes near that of the largest;
* replay is a flat list of prepared kernel calls (``.out`` overloads where the op has one), with
  no Python of the model in it, cut where a node waits on an ExternalEvent.

A host synchronisation during capture (``.item()``, ``.tolist()``) or a device-to-host copy
(``.cpu()``, ``.numpy()``, ``.to("cpu")``) raises, as on the chip. Each
live graph holds one stream of the device's budget; exhausting it raises error 207008.
"""

import contextlib
import threading
import weakref

import torch
from torch._C import DispatchKey
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from vllm_ascend.device.sim import acl as _acl
from vllm_ascend.device.sim import ledger as _ledger

STREAM_EXHAUSTED_CODE = 207008
_RECORDED_NAMESPACES = {"aten", "prims", "ascend_sim"}
_UNCAPTURABLE_NAMESPACES = {"_c10d_functional", "_c10d_functional_autograd", "c10d_functional"}
# Allocations whose contents are undefined: nothing to redo on replay.
_NO_REPLAY = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
              torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default}
_ALIGN = 64
# Ops whose result is a copy of their first argument.
_COPIES = {torch.ops.aten.contiguous.default, torch.ops.aten.clone.default}


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
        self._lock = threading.Lock()

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
    """Memory shared by graphs: one scratch arena for their intermediates."""

    def __init__(self):
        self.arena = torch.empty(0, dtype=torch.uint8)

    def arena_for(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.arena.numel():
            # Older graphs keep their views of the previous arena alive; capture large sizes
            # first so that this happens once.
            self.arena = torch.zeros(nbytes, dtype=torch.uint8)
        return self.arena


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
    try:
        expected = func(*args, **kwargs)
        written = fn(*args, **kwargs, out=targets[0])
    except Exception:
        return None
    # The binding must write into out= and return it: some (__and__, __or__) accept out= and
    # return NotImplemented without writing, while the target still holds the captured value.
    if written is not targets[0] or not isinstance(expected, torch.Tensor) or \
            not torch.equal(expected, targets[0]):
        return None
    return fn


def _storage_key(t: torch.Tensor) -> int:
    storage = t.untyped_storage()
    # Empty storages may all sit at address 0: each is its own, aliasing nothing.
    return storage.data_ptr() if storage.nbytes() else -id(t)


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


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
    elsewhere, such as a view, is not: while it lives the memory counts as owned)."""
    with _disable_current_modes():  # not part of a graph being captured
        alias = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    key = _storage_key(t)
    _WEAK_ALIASES.setdefault(key, []).append(weakref.ref(alias))
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


def _move_aliases(key: int, storage, byte_offset: int, owners) -> None:
    """A storage the capture moved into the pool's arena: its aliases follow it, and the
    tensors that own it there (``owners``) poison it for them when they go."""
    aliases = _live_aliases(key)
    _WEAK_ALIASES.pop(key, None)
    if not aliases:
        return
    with _disable_current_modes():
        for alias in aliases:
            alias.set_(storage, byte_offset // alias.element_size() + alias.storage_offset(),
                       alias.size(), alias.stride())
    new_key = _storage_key(aliases[0])  # the arena's: one watch per owner, not per alias
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


class SimGraph:
    """A captured graph: its prepared calls, cut into segments at ExternalEvent waits."""

    def __init__(self, streams: StreamPool):
        self._streams = streams
        self._holds_stream = False
        self._extra_streams = 0  # one per communication group captured
        self._recorder: _Recorder | None = None
        self._next_group = 0
        self._inference = False
        self.segments: list = []  # [(calls, wait event or None)]
        self._group_calls: dict[int, list] = {}  # task group -> [(segment, index)]
        self.scratch_bytes = 0

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
        self._recorder.__enter__()

    def end(self, pool: GraphPool, failed: bool = False) -> None:
        recorder, self._recorder = self._recorder, None
        recorder.__exit__(None, None, None)
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
        kept = {metas[k].key for k in alive}
        # Storages allocated in the graph and dead at its end share the arena by liveness.
        moved = sorted((key for key in first_def if key not in kept), key=first_def.get)
        sizes = {}
        for m in metas:
            if m.key in first_def and m.key not in kept:
                sizes[m.key] = _storage_nbytes(m.storage)
        frees: dict[int, list[int]] = {}
        for key in moved:
            frees.setdefault(last_use[key], []).append(key)
        offset_of = {}
        free: list[tuple[int, int]] = []
        top = 0
        by_def: dict[int, list[int]] = {}
        for key in moved:
            by_def.setdefault(first_def[key], []).append(key)
        for i in range(len(frozen)):
            for key in by_def.get(i, ()):
                offset_of[key], top = _alloc(free, top, sizes[key])
            for key in frees.get(i, ()):
                _release(free, offset_of[key], sizes[key])
        arena = pool.arena_for(top).untyped_storage()
        self.scratch_bytes = top
        tensors = {}
        for k, m in enumerate(metas):
            if k in alive:
                tensors[k] = alive[k]
            elif m.key in offset_of:
                tensors[k] = m.view_of(arena, offset_of[m.key])
            else:
                tensors[k] = m.view_of(m.storage)
        # Non-owning aliases of moved storages (upstream keeps FIA's query and output that way)
        # point where the graph now reads and writes them.
        moved_with_aliases = set(offset_of) & set(_WEAK_ALIASES)
        if moved_with_aliases:
            owners: dict[int, list] = {}
            for k, m in enumerate(metas):
                if m.key in moved_with_aliases:
                    owners.setdefault(m.key, []).append(tensors[k])
            for key in moved_with_aliases:
                _move_aliases(key, arena, offset_of[key], [*owners[key], pool.arena])
        del alive, metas

        plain: dict[int, torch.Tensor] = {}

        def real(x):
            if isinstance(x, _Slot):
                return tensors[x.k]
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
                args, kwargs = tree_map(real, args), tree_map(real, kwargs)
                if kind == "collective":
                    calls.append((_collective(func), args, kwargs, group))
                    groups.update(_group_name(a) for a in tree_flatten((args, kwargs))[0]
                                  if isinstance(a, torch.ScriptObject) and
                                  "ProcessGroup" in str(a._type()))
                elif kind == "mutate":
                    calls.append((func, args, kwargs, group))
                else:
                    calls.append(self._compute_call(func, args, kwargs,
                                                    [real(o) for o in outs], group))
        segments.append((calls, None))
        # As on the chip, each communication group captured in a graph costs it one more stream.
        for _ in groups:
            self._streams.acquire()
            self._extra_streams += 1
        self.segments = segments
        self._group_calls = {}
        for s, (seg_calls, _) in enumerate(segments):
            for i, call in enumerate(seg_calls):
                if call[3] is not None:
                    self._group_calls.setdefault(call[3], []).append((s, i))

    @staticmethod
    def _compute_call(func, args, kwargs, targets, group):
        """A prepared call that recomputes ``func`` into ``targets`` (its captured outputs)."""
        if func in _COPIES:
            return (targets[0].copy_, (args[0],), {}, group)
        fast = _binding_with_out(func, args, kwargs, targets)
        if fast is not None:
            return (fast, args, dict(kwargs, out=targets[0]), group)
        out = _out_overload(func)
        if out is not None:
            overload, names = out
            kw = dict(kwargs)
            kw.update(zip(names, targets))
            return (overload._op, args, kw, group)

        def run_then_copy(*a, **kw):
            for t, r in zip(targets, _tensors(func._op(*a, **kw))):
                t.copy_(r)

        run_then_copy.func = func
        return (run_then_copy, args, kwargs, group)

    # -- task updates -------------------------------------------------------------------------
    def task_update(self, group: int, func, args: tuple, kwargs: dict):
        """Check a task update of the group's ``func`` node; returns the function that applies
        it (the node runs with the new host arguments from then on). Tensor arguments must be
        the captured ones (same address and shape)."""
        found = [(s, i) for s, i in self._group_calls.get(group, ())
                 if self.segments[s][0][i][0] is func]
        if len(found) != 1:
            raise RuntimeError(f"graph_task_update: task group {group} holds {len(found)} "
                               f"{func} tasks, not 1: the update must re-issue the captured op")
        s, i = found[0]
        fn, old_args, old_kwargs, _ = self.segments[s][0][i]
        old = _flat_args(func, old_args, old_kwargs)
        new = _flat_args(func, args, kwargs)
        for name, value in new.items():
            was = old.get(name)
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
        with ctx, _ledger.replaying():
            for s in range(start, len(self.segments)):
                calls, wait = self.segments[s]
                for fn, args, kwargs, _ in calls:
                    try:
                        fn(*args, **kwargs)
                    except Exception as e:  # the op's own error, saying which replayed op
                        e.add_note(f"while replaying {getattr(fn, 'func', fn)} with "
                                   f"{_describe(args)} {_describe(kwargs)}")
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
        self._group_calls = {}
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
        nodes[i] = (kind, node.func, tree_map(slot, node.args), tree_map(slot, node.kwargs),
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
