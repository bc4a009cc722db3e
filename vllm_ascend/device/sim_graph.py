"""The simulator's ACL graphs: capture records device ops, replay runs only the record.

Capture runs the callable once, eagerly, under a dispatcher-level recorder. Each device op is kept
with its tensor arguments by identity and every other argument (ints, lists, floats) by value.
Ops implemented in Python (vLLM's attention and KV-update custom ops, which read the forward
context) are not recorded whole: their CPU kernel runs under the recorder, so the device ops they
issue are what is recorded. After capture the record is frozen:

* tensors made outside the graph (inputs, weights, KV cache) are referenced at their addresses;
* tensors returned by the callable keep their storage: replay overwrites them in place;
* every other intermediate moves into the pool's scratch arena, reusing bytes by liveness; all
  graphs of a pool share that arena (they never run at once), so capturing the largest size first
  keeps the memory of all sizes near that of the largest;
* views are resolved once; replay is a flat list of prepared kernel calls (``.out`` overloads
  where the op has one), with no Python of the model in it.

A host synchronisation during capture (``.item()``, ``.tolist()``) raises, as on the chip. Each
live graph holds one stream of the device's budget; exhausting it raises error 207008.
"""

import contextlib
import threading

import torch
from torch._C import DispatchKey
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

STREAM_EXHAUSTED_CODE = 207008
_RECORDED_NAMESPACES = {"aten", "prims", "ascend_sim"}
# Allocations whose contents are undefined: nothing to redo on replay.
_NO_REPLAY = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
              torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default}
_ALIGN = 64
# Ops that read a device value on the host: a capture cannot contain them.
_HOST_SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
               torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}


class GraphCaptureError(RuntimeError):
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
            # first so this happens once.
            self.arena = torch.zeros(nbytes, dtype=torch.uint8)
        return self.arena

    @property
    def nbytes(self) -> int:
        return self.arena.numel()


class _Node:
    __slots__ = ("func", "args", "kwargs", "outs", "kind", "group")

    def __init__(self, func, args, kwargs, outs, group):
        self.func, self.args, self.kwargs, self.outs, self.group = func, args, kwargs, outs, group
        self.kind = None


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.nodes: list[_Node] = []
        self.group = None  # open task group id, if any

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_SYNCS:
            raise GraphCaptureError(
                "a host synchronisation (.item() / bool(tensor)) happened during graph capture; "
                "on the chip this fails the capture. Move the host read out of the captured "
                "region (compute it before the forward) or run this model eagerly.")
        if func.namespace not in _RECORDED_NAMESPACES:
            # Implemented in Python: record the device ops it issues, not the call itself.
            with self:
                return func._op_dk(DispatchKey.CPU, *args, **kwargs)
        out = func(*args, **kwargs)
        self.nodes.append(_Node(func, args, kwargs, out, self.group))
        return out


def _tolist_during_capture(self, *args, **kwargs):
    raise GraphCaptureError(
        "a host synchronisation (.tolist()) happened during graph capture; on the chip this fails "
        "the capture. Read host values before the captured region.")


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


# Ops whose result is a copy of their first argument.
_COPIES = {torch.ops.aten.contiguous.default, torch.ops.aten.clone.default}


def _binding_with_out(func, args, kwargs, targets):
    """torch's own Python binding with out= (the cheapest call), if it computes the same thing."""
    if len(targets) != 1 or func.namespace != "aten":
        return None
    fn = getattr(torch._C._VariableFunctions, func.overloadpacket.__name__, None)
    if fn is None:
        return None
    try:
        expected = func(*args, **kwargs)
        fn(*args, **kwargs, out=targets[0])
    except Exception:
        return None
    if not isinstance(expected, torch.Tensor) or not torch.equal(expected, targets[0]):
        return None
    return fn


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


class TaskUpdateError(RuntimeError):
    pass


class SimGraph:
    """torch.npu.NPUGraph's contract on the CPU: capture(pool) / replay() / reset()."""

    capturing: "SimGraph | None" = None  # the graph being captured in this process, if any

    def __init__(self, streams: StreamPool):
        self._streams = streams
        self._holds_stream = False
        self._calls: list = []
        self._nodes: list[_Node] = []
        self._inference = False
        self.scratch_bytes = 0
        self.num_groups = 0
        self._group_nodes: dict[int, list[int]] = {}
        self._pending: dict[int, tuple] = {}
        self._recorder = None

    # -- capture ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self, pool: GraphPool | None = None, outputs=None):
        """Record what runs inside. ``outputs`` are not known before: the tensors that are still
        referenced from Python after the block (returned by the callable) keep their storage."""
        if self._calls:
            raise GraphCaptureError("this graph was already captured; reset() it first")
        self._streams.acquire()
        self._holds_stream = True
        self._inference = torch.is_inference_mode_enabled()
        recorder = _Recorder()
        self._recorder = recorder
        self._next_group = 0
        SimGraph.capturing = self
        saved_tolist = torch.Tensor.tolist
        torch.Tensor.tolist = _tolist_during_capture
        ok = False
        try:
            with recorder:
                yield self
            ok = True
        finally:
            torch.Tensor.tolist = saved_tolist
            SimGraph.capturing = None
            self._recorder = None
            if not ok:
                self.reset()
        self._captured = (recorder.nodes, pool or GraphPool())

    def finalize(self, outputs) -> None:
        """Freeze the record; ``outputs`` (any pytree of tensors) keep their storage."""
        nodes, pool = self._captured
        del self._captured
        self._freeze(nodes, pool, _tensors(outputs))

    def _freeze(self, nodes: list[_Node], pool: GraphPool, outputs: list[torch.Tensor]):
        produced: dict[int, tuple[int, torch.Tensor]] = {}  # id -> (node index, tensor)
        root_of: dict[int, int | None] = {}  # id(internal tensor) -> storage root id
        last_use: dict[int, int] = {}  # root id -> last node index using it
        root_tensor: dict[int, torch.Tensor] = {}

        def root(t):
            return root_of.get(id(t)) if id(t) in produced else None

        for i, node in enumerate(nodes):
            ins = _tensors((node.args, node.kwargs))
            outs = _tensors(node.outs)
            in_storages = {}
            for t in ins:
                in_storages.setdefault(_storage_key(t), t)
                r = root(t)
                if r is not None:
                    last_use[r] = i
            mutable = node.func._schema.is_mutable
            aliased = [_storage_key(o) in in_storages for o in outs]
            if mutable:
                node.kind = "mutate"
            elif outs and all(aliased):
                node.kind = "view"
            elif any(aliased):
                raise GraphCaptureError(f"{node.func} returns a partial alias; not simulated")
            else:
                node.kind = "compute"
            for o in outs:
                if id(o) in produced and node.kind != "compute":
                    continue  # in-place ops return their (already known) input
                produced[id(o)] = (i, o)
                if node.kind == "compute":
                    root_of[id(o)] = id(o)
                    root_tensor[id(o)] = o
                    last_use.setdefault(id(o), i)
                else:
                    src = in_storages.get(_storage_key(o))
                    root_of[id(o)] = root(src) if src is not None else None
            for o in outs:
                r = root_of.get(id(o))
                if r is not None:
                    last_use[r] = max(last_use.get(r, i), i)

        keep = {root_of[id(t)] for t in outputs if id(t) in produced and root_of.get(id(t))}
        # Liveness allocation of the other roots inside the shared scratch arena.
        defs: dict[int, list[int]] = {}
        for r in root_tensor:
            if r not in keep:
                defs.setdefault(produced[r][0], []).append(r)
        frees: dict[int, list[int]] = {}
        for r, i in last_use.items():
            if r in root_tensor and r not in keep:
                frees.setdefault(i, []).append(r)
        free: list[tuple[int, int]] = []  # (offset, size), sorted
        top = 0
        offset_of: dict[int, int] = {}

        def alloc(size):
            nonlocal top
            for k, (off, sz) in enumerate(free):
                if sz >= size:
                    if sz == size:
                        free.pop(k)
                    else:
                        free[k] = (off + size, sz - size)
                    return off
            off = top
            top += size
            return off

        def release(off, size):
            free.append((off, size))
            free.sort()
            merged = []
            for o, s in free:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + s)
                else:
                    merged.append((o, s))
            free[:] = merged

        def nbytes(t):
            size = t.untyped_storage().nbytes()
            return max(_ALIGN, -(-size // _ALIGN) * _ALIGN)

        for i in range(len(nodes)):
            for r in defs.get(i, ()):
                offset_of[r] = alloc(nbytes(root_tensor[r]))
            for r in frees.get(i, ()):
                release(offset_of[r], nbytes(root_tensor[r]))
        arena = pool.arena_for(top)
        self.scratch_bytes = top

        # Rebind in place: each internal tensor object now views its bytes in the arena, so the
        # objects seen at capture (and kept by callers, e.g. for task updates) are the graph's.
        ctx = torch.inference_mode() if self._inference else contextlib.nullcontext()
        storage = arena.untyped_storage()
        with ctx:
            for r, off in offset_of.items():
                t = root_tensor[r]
                t.set_(storage, off // t.element_size() + t.storage_offset(), t.size(), t.stride())
            calls = []
            for node in nodes:
                outs = _tensors(node.outs)
                if node.kind == "view":
                    # Re-derive views of moved storage once; replay never recomputes them.
                    if any(root_of.get(id(o)) in offset_of for o in outs):
                        again = _tensors(node.func(*node.args, **node.kwargs))
                        for o, a in zip(outs, again):
                            if root_of.get(id(o)) in offset_of:
                                o.set_(a.untyped_storage(), a.storage_offset(), a.size(),
                                       a.stride())
                    continue
                if node.kind == "mutate":
                    calls.append((node.func, node.args, node.kwargs, node.group))
                    continue
                if node.func in _NO_REPLAY:
                    continue
                calls.append(self._compute_call(node.func, node.args, node.kwargs, outs,
                                                node.group))
        self._calls = calls
        self._group_nodes = {}
        for k, (_, _, _, group) in enumerate(calls):
            if group is not None:
                self._group_nodes.setdefault(group, []).append(k)

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

    # -- task groups and updates --------------------------------------------------------------
    def task_group_begin(self) -> None:
        if self._recorder is None:
            raise TaskUpdateError("task_group_begin outside a graph capture")
        if self._recorder.group is not None:
            raise TaskUpdateError("task groups do not nest")
        self._recorder.group = self._next_group
        self._next_group += 1

    def task_group_end(self) -> tuple["SimGraph", int]:
        group, self._recorder.group = self._recorder.group, None
        if group is None:
            raise TaskUpdateError("task_group_end without task_group_begin")
        return (self, group)

    def stage_update(self, group: int, func, args: tuple) -> None:
        """Replace the host arguments of the group's ``func`` node for the next replay.

        Tensor arguments must be the captured ones (same address and shape): only host values
        can change. The update lands on the update stream; the node waits for it at the next
        replay, and a second update before that replay consumed the first is an ordering bug.
        """
        calls = [k for k in self._group_nodes.get(group, ()) if
                 getattr(self._calls[k][0], "func", self._calls[k][0]) is func]
        if len(calls) != 1:
            raise TaskUpdateError(f"task group {group} holds {len(calls)} {func} nodes, not 1")
        k = calls[0]
        fn, old_args, kwargs, _ = self._calls[k]
        for new, old in zip(args, old_args):
            if isinstance(old, torch.Tensor) != isinstance(new, torch.Tensor) or (
                    isinstance(old, torch.Tensor) and (old.data_ptr() != new.data_ptr()
                                                       or old.shape != new.shape)):
                raise TaskUpdateError(
                    "a task update may change host arguments only; a tensor argument moved "
                    "or changed shape since capture")
        if k in self._pending:
            raise TaskUpdateError(
                "a second task update reached the graph before a replay consumed the first: "
                "the update stream must wait for the previous replay (event ordering)")
        self._pending[k] = (fn, tuple(args), kwargs, group)

    # -- replay -------------------------------------------------------------------------------
    def replay(self) -> None:
        if not self._calls:
            raise GraphCaptureError("replay() of a graph that holds no capture")
        if self._pending:  # the attention nodes wait for their updates, then consume them
            for k, call in self._pending.items():
                self._calls[k] = call
            self._pending.clear()
        if self._inference:
            with torch.inference_mode():
                for fn, args, kwargs, _ in self._calls:
                    fn(*args, **kwargs)
        else:
            for fn, args, kwargs, _ in self._calls:
                fn(*args, **kwargs)

    def reset(self) -> None:
        self._calls = []
        self._group_nodes = {}
        self._pending = {}
        if self._holds_stream:
            self._holds_stream = False
            self._streams.release()

    def __del__(self):
        try:
            self.reset()
        except Exception:
            pass

    @property
    def num_ops(self) -> int:
        return len(self._calls)
