"""The simulator's ACL graphs (``SimGraph``, behind torch.npu.NPUGraph in sim/npu.py): capture
records device ops, replay runs only the record.

Between ``begin`` and ``end`` the ops run once, eagerly, under the recorder (sim/recorder.py),
except the matrix products and attention, which are recorded unrun, as the chip records a
captured task. At ``end`` the record is frozen as a graph pool would leave it:

* tensors made outside the graph (inputs, weights, the KV cache) are read at their addresses;
* every storage the graph made moves into its pool (sim/graph_pool.py: a caching allocator's
  private pool, shared by the graphs of an engine), placed by liveness: what dies inside the
  graph shares bytes with what comes later, and what Python still holds when the capture ends
  (the callable's output, a workspace kept for updates) becomes a block that its tensors own;
  when they go, the block returns to the pool for the next capture, while this graph keeps
  reading and writing it at replay (outputs are overwritten in place by every replay, and by a
  later graph's replay once the block is someone else's). Capturing the largest size first keeps
  the memory of all sizes near that of the largest;
* replay is a flat list of prepared calls (sim/replay.py), with no Python of the model in it,
  cut where a node waits on an ExternalEvent.

A task update replaces the host arguments of one captured op of a task group (``task_update``).
Each live graph holds one stream of the device's budget (sim/streams.py); exhausting it raises
error 207008. The chip's graph APIs and their order: ../shared/TORCH_NPU_CONTRACTS.md sections 4
and 8; their call sites: docs/torch_npu_calls.md, "Graphs".
"""

import contextlib

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from vllm_ascend.device.sim import acl as _acl
from vllm_ascend.device.sim import ledger as _ledger
from vllm_ascend.device.sim.aclnn import CAPTURING
from vllm_ascend.device.sim.errors import GraphCaptureError, GraphReplayError
from vllm_ascend.device.sim.graph_pool import (BLOCKS, WEAK_ALIASES, GraphPool, Placement,
                                               block_storage, bytes_of, live_aliases,
                                               move_aliases, storage_key, storage_nbytes)
from vllm_ascend.device.sim.recorder import (HOST_COPIES, HostCall, Meta, Recorder, Slot, Wait,
                                             map_leaves, tensors_in, to_refusing_host, to_slots)
from vllm_ascend.device.sim.replay import (DIRECT, NO_REPLAY, collective, compute_call,
                                           describe, flat_args, group_name, kernel_of, op_called)
from vllm_ascend.device.sim.streams import StreamPool


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
        self._recorder: Recorder | None = None
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
        self._recorder = Recorder()
        self._saved_methods = {name: getattr(torch.Tensor, name)
                               for name in (*HOST_COPIES, "to")}
        for name, method in HOST_COPIES.items():
            setattr(torch.Tensor, name, method)
        torch.Tensor.to = to_refusing_host(self._saved_methods["to"])
        CAPTURING.active = True
        self._recorder.__enter__()

    def end(self, pool: GraphPool, failed: bool = False) -> None:
        recorder, self._recorder = self._recorder, None
        recorder.__exit__(None, None, None)
        CAPTURING.active = False
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
        self._recorder.nodes.append(Wait(event))

    def record_host_call(self, fn) -> None:
        self._recorder.nodes.append(HostCall(fn))

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
        metas, first_def, last_use, refs = to_slots(nodes)
        frozen = nodes  # converted in place: the record no longer holds internal tensors
        # Which internal tensors does Python still hold (the output, what the caller kept)?
        alive = {k: t for k, t in ((k, r()) for k, r in enumerate(refs)) if t is not None}
        storages = {m.key: m.storage for m in metas}
        kept = {metas[k].key for k in alive}
        # Storages made in the graph go into the pool; one that Python still holds becomes a
        # block of its own there, unless something the record does not know holds it too (it
        # keeps its memory then, and the graph with it).
        stay = {key for key in kept if key not in first_def or not _only_recorded_owners(
            storages[key], sum(metas[k].key == key for k in alive), live_aliases(key))}
        placed = sorted((key for key in first_def if key not in stay), key=first_def.get)
        sizes = {key: storage_nbytes(storages[key]) for key in placed}
        by_def: dict[int, list[int]] = {}
        frees: dict[int, list[int]] = {}
        for key in placed:
            by_def.setdefault(first_def[key], []).append(key)
            if key not in kept:  # the graph's own: free after its last use
                frees.setdefault(last_use[key], []).append(key)
        where: dict[int, tuple[int, int]] = {}
        with Placement(pool) as placement:
            for i in range(len(frozen)):
                for key in by_def.get(i, ()):
                    where[key] = placement.place(sizes[key])
                for key in frees.get(i, ()):
                    placement.release(*where[key], sizes[key])
        segments = [seg.untyped_storage() for seg in pool.segments]
        blocks = {}
        for key in kept - stay:  # Python's tensors own a block of the pool from now on
            blocks[key] = block_storage(pool, *where[key], sizes[key])
            with _disable_current_modes():
                bytes_of(blocks[key])[:storages[key].nbytes()].copy_(bytes_of(storages[key]))
        tensors = {}
        for k, m in enumerate(metas):
            if m.key in where:
                seg, offset = where[m.key]
                tensors[k] = m.view_of(segments[seg], offset)
                if k in alive:
                    _repoint(alive[k], blocks[m.key])
            elif m.key in BLOCKS:  # a view of an earlier capture's output, passed through
                segment, offset, _ = BLOCKS[m.key]
                tensors[k] = m.view_of(segment.untyped_storage(), offset)
            elif k in alive:
                tensors[k] = alive[k]
            else:
                tensors[k] = m.view_of(m.storage)
        # Non-owning aliases of moved storages (upstream keeps FIA's query and output that way)
        # point where the graph now reads and writes them.
        for key in set(where) & set(WEAK_ALIASES):
            seg, offset = where[key]
            if key in blocks:  # watched by the block: poisoned when it is freed
                move_aliases(key, segments[seg], offset, (), watch_key=blocks[key].data_ptr())
            else:  # watched by the graph's tensors and the segment
                move_aliases(key, segments[seg], offset,
                              [*(tensors[k] for k, m in enumerate(metas) if m.key == key),
                               pool.segments[seg]])
        del alive, metas, storages, blocks

        plain: dict[int, torch.Tensor] = {}

        def real(x):
            if isinstance(x, Slot):
                return tensors[x.k]
            if isinstance(x, torch.Tensor) and storage_key(x) in BLOCKS:
                # An earlier capture's output, passed in: the graph reads the pool's memory
                # where it lies, without keeping the block allocated.
                if id(x) not in plain:
                    segment, offset, _ = BLOCKS[storage_key(x)]
                    plain[id(x)] = Meta(x).view_of(segment.untyped_storage(), offset)
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
                if isinstance(entry, Wait):
                    segments.append((calls, entry.event))
                    calls = []
                    continue
                if isinstance(entry, HostCall):
                    calls.append((entry.fn, (), {}, None))
                    continue
                kind, func, args, kwargs, outs, group = entry
                if func.namespace == "c10d":
                    kind = "collective"  # in place on its inputs, whatever its schema says
                elif kind == "view" or (kind == "compute" and func in NO_REPLAY):
                    continue  # views are resolved once; undefined allocations need no work
                args, kwargs = map_leaves(real, args), map_leaves(real, kwargs)
                if kind == "collective":
                    calls.append((collective(func), args, kwargs, group))
                    groups.update(group_name(a) for a in tree_flatten((args, kwargs))[0]
                                  if isinstance(a, torch.ScriptObject) and
                                  "ProcessGroup" in str(a._type()))
                elif kind == "mutate" and not (func.namespace == "ascend_sim" and any(
                        r.alias_info is None for r in func._schema.returns)):
                    # (a simulator op that updates a state in place and returns a new result,
                    # as the recurrent delta rule, writes that result into the graph's output)
                    calls.append((kernel_of(func, func), args, kwargs, group))
                else:
                    calls.append(compute_call(func, args, kwargs,
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
                if DIRECT.get(self.segments[s][0][i][0], self.segments[s][0][i][0]) is func]
        if len(found) != 1:
            raise RuntimeError(f"graph_task_update: task group {group} holds {len(found)} "
                               f"{func} tasks, not 1: the update must re-issue the captured op")
        s, i = found[0]
        fn, old_args, old_kwargs, _ = self.segments[s][0][i]
        old = flat_args(func, old_args, old_kwargs)
        new = flat_args(func, args, kwargs)
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
                        if counting and op_called(fn) is not None:
                            with _ledger.replayed_kernel(op_called(fn)):
                                fn(*args, **kwargs)
                        else:
                            fn(*args, **kwargs)
                    except Exception as e:  # the op's own error, saying which replayed op
                        op = DIRECT.get(fn, getattr(fn, "func", fn))
                        e.add_note(f"while replaying {op} with {describe(args)} "
                                   f"{describe(kwargs)}")
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
                for t in tensors_in((args, kwargs)):
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
