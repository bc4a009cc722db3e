"""The simulator's ``torch.npu`` (``torch_npu.npu``): streams, events, ACL graphs, task groups.

The host is the device: torch ops run at once, in program order, as on the default stream.
The work the simulator issues itself on a side stream (task updates, event records) is queued on
that stream and runs only when something orders it: an event wait or synchronisation, a
``wait_stream``, a host synchronisation, a replayed graph node that waits on an ExternalEvent
the stream records, or, at the latest, the host thread leaving the stream's context. The chip
runs a side stream concurrently, so its work may land at any point up to that order; the
simulator takes the latest, so a replay that does not wait for its update runs with the stale
host lists (as it can on a chip) instead of the fresh ones. Only the host thread that issued the
work runs it: the device's work never runs in two host threads at once.

Launches on the default stream run at once, so a replay is over when the host goes on; on the chip
it may still run. The simulator tracks what the chip guarantees instead: which replays each
stream's next work is ordered after (``wait_stream``, an event recorded and waited on) and which
the host knows finished (a synchronisation of the device, the stream or an event). A task update
of a graph whose previous replay is not so ordered before it fails at once: on the chip it could
rewrite the host lists of an attention node that replay has yet to run (a wrong answer, not an
error).

What the chip's contracts make observable is kept: a graph captures only on a capturing
(non-default) stream; task groups open only there and task updates only on a non-capturing one;
an ExternalEvent captured as a wait holds the replay at that node until an update records it (the
replay resumes inside ``record``), and a replay left waiting on an event nobody records fails
loudly as soon as anything depends on it, where the chip would hang.
"""

import contextlib
import os
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_ascend.device.sim import graph as _graph
from vllm_ascend.device.sim import ledger as _ledger
from vllm_ascend.device.sim import matmul as _matmul
from vllm_ascend.device.sim import memory as _memory

STREAMS_ENV = "VLLM_ASCEND_SIM_STREAMS"
DEFAULT_STREAMS = 2048  # a 910-class chip's stream budget for the whole software stack
MEMORY_ENV = "VLLM_ASCEND_SIM_MEMORY_GB"


def stream_budget() -> int:
    value = os.environ.get(STREAMS_ENV, str(DEFAULT_STREAMS))
    if not value.isdigit() or int(value) <= 0:
        raise ValueError(f"{STREAMS_ENV}={value!r} must be a positive integer")
    return int(value)


_STREAM_POOL = _graph.StreamPool(stream_budget)


def streams_in_use() -> int:
    """Streams held by live captured graphs (the simulator's own count)."""
    return _STREAM_POOL.in_use


# -- streams ---------------------------------------------------------------------------------------

class Stream:
    """A device stream. Streams come from a per-device pool, as torch's CUDA and NPU streams do,
    so creating one does not take a hardware stream of the budget; a captured graph does."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = torch.device("cpu")
        self.capturing: "_graph.SimGraph | None" = None  # the graph capturing on this stream
        self.update_handle = None  # the task group an update is open for
        self.update_issued = False
        self._queue: list = []  # deferred work: (sequence number, fn)
        self._issued = 0  # sequence number of the last work issued here
        self._owner: "int | None" = None  # the host thread that issued it
        self.replays = 0  # graph replays launched on this stream
        # The replays of each stream that this stream's next work is ordered after.
        self.ordered_after: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        _ALL_STREAMS.add(self)

    def knows(self) -> dict:
        """What work issued on this stream from now on is ordered after: its own replays so
        far and what it waited for."""
        knows = dict(self.ordered_after)
        knows[self] = self.replays
        return knows

    def defer(self, fn) -> None:
        """Issue ``fn`` as work of this stream: at once on the default stream, else queued."""
        if self is _STREAMS.default:
            fn()
            return
        self._owner = threading.get_ident()
        self._issued += 1
        self._queue.append((self._issued, fn))
        _PENDING[self] = None

    def flush(self, upto: "int | None" = None) -> None:
        """Run the queued work, up to sequence number ``upto`` (all of it when None). Only the
        thread that issued it runs it: the host is the device, and the device's work must not
        run in two host threads at once (another thread's sync finds it done in due course,
        as a chip's would)."""
        if self._owner != threading.get_ident():
            return
        while self._queue and (upto is None or self._queue[0][0] <= upto):
            _, fn = self._queue.pop(0)
            fn()
        if not self._queue:
            _PENDING.pop(self, None)

    def done(self, upto: int) -> bool:
        return not self._queue or self._queue[0][0] > upto

    def synchronize(self) -> None:
        _ledger.note(_ledger.SYNCS)
        _check_no_waiting_replay("synchronize")
        _memory.synchronized()
        _host_learns(self.knows())

    def wait_stream(self, stream) -> None:
        stream.flush()  # this stream's later work runs after all that ``stream`` holds now
        _merge(self.ordered_after, stream.knows())

    def wait_event(self, event) -> None:
        event.wait(self)

    def __repr__(self):
        return f"<sim npu Stream {id(self):#x}>"


class _Streams(threading.local):
    def __init__(self):
        self.default = Stream()
        self.stack = [self.default]


_ALL_STREAMS: weakref.WeakSet = weakref.WeakSet()
_STREAMS = _Streams()
_PENDING: dict = {}  # streams with queued work, in the order they got it


def _merge(into, knows: dict) -> None:
    for s, replays in knows.items():
        if into.get(s, 0) < replays:
            into[s] = replays


class _Host(threading.local):
    def __init__(self):
        # The replays this host thread knows finished (it synchronised after them).
        self.knows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_HOST = _Host()


def _host_learns(knows: dict) -> None:
    _merge(_HOST.knows, knows)


def _flush_all() -> None:
    """A host synchronisation: every stream's queued work runs (side streams progress on their
    own on the chip, so a host that blocks sees all of it done); the work this thread issued."""
    me = threading.get_ident()
    while True:
        mine = next((s for s in list(_PENDING) if s._owner == me), None)
        if mine is None:
            return
        mine.flush()


def current_stream(device=None) -> Stream:
    return _STREAMS.stack[-1]


def default_stream(device=None) -> Stream:
    return _STREAMS.default


@contextlib.contextmanager
def stream(s: "Stream | None"):
    if s is None:
        yield
        return
    _STREAMS.stack.append(s)
    try:
        yield
    finally:
        _STREAMS.stack.pop()
        if s not in _STREAMS.stack:
            # The latest point the simulator lets the stream's queued work wait for: it cannot
            # see every host read of device memory (a gloo send, .numpy()), so the work does
            # not outlive the context it was issued in.
            s.flush()


def set_stream(s: Stream) -> None:
    """The current stream becomes ``s`` (in place of the current one, as torch.npu.set_stream
    does); a stream set aside runs its queued work, as at a ``stream`` context's exit."""
    replaced, _STREAMS.stack[-1] = _STREAMS.stack[-1], s
    if replaced not in _STREAMS.stack:
        replaced.flush()


def synchronize(device=None) -> None:
    _ledger.note(_ledger.SYNCS)
    _check_no_waiting_replay("synchronize")
    _memory.synchronized()
    for s in list(_ALL_STREAMS):
        _host_learns({s: s.replays})


def _ordered_before(stream: Stream, replay: "tuple[Stream, int]", host: bool = True) -> bool:
    """Whether work issued on ``stream`` now runs after ``replay`` (its stream, its number):
    through the stream's waits, or (``host``) a host synchronisation after it."""
    s, number = replay
    return (s is stream or stream.ordered_after.get(s, 0) >= number
            or host and _HOST.knows.get(s, 0) >= number)


def is_current_stream_capturing() -> bool:
    return current_stream().capturing is not None


# -- events ----------------------------------------------------------------------------------------

class Event:
    """Marks a point in a stream's work: waiting on it (or synchronising it) runs that stream's
    queued work up to the mark."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **kwargs):
        self._mark: "tuple[Stream, int] | None" = None
        self._knows: dict = {}  # what the recording stream's work up to the mark came after

    def record(self, stream=None) -> None:
        s = stream or current_stream()
        self._mark = (s, s._issued)
        self._knows = s.knows()

    def wait(self, stream=None) -> None:
        if self._mark is not None:
            s, upto = self._mark
            s.flush(upto)
        _merge((stream or current_stream()).ordered_after, self._knows)

    def synchronize(self) -> None:
        _ledger.note(_ledger.SYNCS)
        if self._mark is not None:
            self._mark[0].flush(self._mark[1])
        _check_no_waiting_replay("Event.synchronize")
        _memory.synchronized()
        _host_learns(self._knows)

    def query(self) -> bool:
        return (self._mark is None or self._mark[0].done(self._mark[1])) and not _mine()


class ExternalEvent:
    """An event a graph can wait on (graph_external=True). ``wait`` may come before ``record``;
    ``reset`` is needed before the event is recorded again."""

    def __init__(self):
        self._recorded = False
        self._pending: "tuple[Stream, int] | None" = None  # a record queued on a side stream
        self._waiting: list = []  # replays held at this event: (graph, segment to resume at)

    def wait(self, stream=None) -> None:
        s = stream or current_stream()
        if s.capturing is None:
            self._run_pending_record()
            if not self._recorded:
                raise _deadlock("ExternalEvent.wait on a stream that is not capturing, with no "
                                "record() before it")
            return
        s.capturing.record_wait(self)

    def reset(self, stream=None) -> None:
        s = stream or current_stream()
        if s.capturing is not None:
            s.capturing.record_host_call(self._clear)
        else:
            self._clear()

    def record(self, stream=None) -> None:
        s = stream or current_stream()
        if s.capturing is not None:
            raise RuntimeError("ExternalEvent.record inside a capture is not simulated "
                               "(vllm-ascend records it on the update stream)")
        if self._recorded or self._pending is not None:
            raise RuntimeError(
                "ExternalEvent recorded twice without a reset: an update was issued before the "
                "graph replay that waits on the previous one consumed it. Replay (or update) once "
                "per step, in order.")
        if s is not _STREAMS.default:
            self._pending = (s, s._issued + 1)
        s.defer(self._record_now)

    def _record_now(self) -> None:
        self._pending = None
        self._recorded = True
        waiting, self._waiting = self._waiting, []
        for graph, resume_at in waiting:
            _resume(graph, resume_at)

    def _run_pending_record(self) -> None:
        if self._pending is not None:
            s, upto = self._pending
            s.flush(upto)

    def _clear(self) -> None:
        self._recorded = False

    def consume_for(self, graph, resume_at: int) -> bool:
        """At a captured wait during replay: go on once recorded (running the recording stream's
        work up to the record), else hold the replay here."""
        self._run_pending_record()
        if self._recorded:
            return True
        self._waiting.append((graph, resume_at))
        return False


# -- replays waiting on an event -------------------------------------------------------------------

_WAITING: dict = {}  # graph -> (the segment it resumes at, the host thread that replayed it)


def _mine() -> list:
    """The replays this host thread launched that wait on an event."""
    me = threading.get_ident()
    return [g for g, (_, thread) in list(_WAITING.items()) if thread == me]


class _WaitingReplayGuard(TorchDispatchMode):
    """On this thread's mode stack while a replay it launched waits: any device op issued now
    would queue behind the graph on the chip and hang with it; here it fails loudly instead of
    reading the graph's stale outputs. Once nothing waits it passes ops through until the next
    safe point pops it (a mode cannot leave the stack from inside its own dispatch)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _mine():
            # The side streams' queued records may release the replays.
            _LOCAL.dispatching = True
            try:
                _flush_all()
            finally:
                _LOCAL.dispatching = False
        if _mine():
            raise _give_up_waiting(f"the device op {func}")
        return func(*args, **(kwargs or {}))


class _Local(threading.local):
    def __init__(self):
        self.guard: "_WaitingReplayGuard | None" = None  # pushed on this thread's mode stack
        self.dispatching = False  # inside the guard's own dispatch


_LOCAL = _Local()


def _pop_guard() -> None:
    """At a safe point (not inside the guard's own dispatch)."""
    if _LOCAL.guard is not None and not _LOCAL.dispatching:
        guard, _LOCAL.guard = _LOCAL.guard, None
        guard.__exit__(None, None, None)


def _deadlock(what: str) -> RuntimeError:
    return _graph.GraphReplayError(
        f"{what}: a replayed ACL graph waits on an ExternalEvent that no task update recorded. "
        "On the chip this stream hangs. Before (or right after) every FULL replay, re-issue each "
        "captured attention op between graph_task_update_begin/end on the update stream and "
        "record its event there.")


def _give_up_waiting(what: str) -> RuntimeError:
    """Drop this thread's waiting replays (their work is lost, as on a chip that timed out)."""
    waiting = _mine()
    for graph_ in waiting:
        _WAITING.pop(graph_, None)
        stream, number = graph_.last_replays[1]
        _host_learns({stream: number})  # it is over: the host saw it fail
        for _, event in graph_.segments:
            if event is not None:
                event._waiting = [w for w in event._waiting if w[0] is not graph_]
    return _deadlock(f"{what} was issued while {len(waiting)} replay(s) wait")


def _check_no_waiting_replay(what: str) -> None:
    """A host synchronisation: every stream's queued work runs; a replay still waiting then
    waits forever. (A sync in another host thread leaves this thread's replays to it.)"""
    _flush_all()
    if _mine():
        error = _give_up_waiting(what)
        _pop_guard()
        raise error
    _pop_guard()


def _hold(graph, resume_at: int) -> None:
    # One replay at a time can wait: a second one would run behind it on the same stream.
    _check_no_waiting_replay("a second graph replay")
    _WAITING[graph] = (resume_at, threading.get_ident())
    if _LOCAL.guard is None:  # (inside the guard's own dispatch it is still pushed)
        _LOCAL.guard = _WaitingReplayGuard()
        _LOCAL.guard.__enter__()


def _resume(graph, resume_at: int) -> None:
    _WAITING.pop(graph, None)
    _pop_guard()
    blocked_at = graph.run(resume_at)
    if blocked_at is not None:
        _hold(graph, blocked_at)


# -- graphs --------------------------------------------------------------------------------------

class _PoolHandle:
    """What graph_pool_handle() returns: an opaque id of one memory pool."""

    def __init__(self):
        self.pool = _graph.GraphPool()


def graph_pool_handle() -> _PoolHandle:
    return _PoolHandle()


class NPUGraph:
    """torch.npu.NPUGraph: capture_begin/capture_end around the work, replay(), reset()."""

    def __init__(self, keep_graph=False):
        self._graph = _graph.SimGraph(_STREAM_POOL)
        self._pool: _PoolHandle | None = None
        self._stream: Stream | None = None

    def capture_begin(self, pool=None, capture_error_mode="global") -> None:
        _opened("NPUGraph.capture_begin")
        _check_no_waiting_replay("NPUGraph.capture_begin")
        s = current_stream()
        if s is _STREAMS.default:
            raise RuntimeError("NPU graphs must be captured on a non-default stream (enter "
                               "torch.npu.graph(), or a torch.npu.stream() of your own)")
        if s.capturing is not None:
            raise RuntimeError("a capture is already under way on this stream")
        self._pool = pool if pool is not None else _PoolHandle()
        self._graph.begin()
        s.capturing = self._graph
        self._stream = s

    def capture_end(self) -> None:
        s, self._stream = self._stream, None
        s.capturing = None
        self._graph.end(self._pool.pool, failed=False)

    def _capture_failed(self) -> None:
        s, self._stream = self._stream, None
        if s is not None:
            s.capturing = None
            self._graph.end(self._pool.pool, failed=True)

    def replay(self) -> None:
        if not self._graph.segments:
            raise RuntimeError("replay() of an NPUGraph that holds no capture")
        _check_no_waiting_replay("NPUGraph.replay")
        _ledger.note(_ledger.REPLAYS)
        s = current_stream()
        s.replays += 1
        self._graph.last_replays = (self._graph.last_replays[1], (s, s.replays))
        blocked_at = self._graph.run(0)
        if blocked_at is not None:
            _hold(self._graph, blocked_at)

    def reset(self) -> None:
        self._graph.reset()

    def pool(self) -> _PoolHandle:
        return self._pool

    # The simulator's own introspection (not torch_npu API): for tests and logs.
    @property
    def sim_graph(self) -> "_graph.SimGraph":
        return self._graph


class graph:
    """Context manager capturing the work inside into ``npu_graph`` (torch.npu.graph)."""

    default_capture_stream: "Stream | None" = None

    def __init__(self, npu_graph: NPUGraph, pool=None, stream=None, auto_dispatch_capture=False,
                 capture_error_mode="global"):
        if auto_dispatch_capture:
            raise NotImplementedError("auto_dispatch_capture is not simulated")
        cls = type(self)
        if cls.default_capture_stream is None:
            cls.default_capture_stream = Stream()
        self.npu_graph, self.pool = npu_graph, pool
        self.capture_stream = stream if stream is not None else cls.default_capture_stream

    def __enter__(self):
        synchronize()
        self._stream_ctx = stream(self.capture_stream)
        self._stream_ctx.__enter__()
        try:
            self.npu_graph.capture_begin(self.pool)
        except BaseException:
            self._stream_ctx.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self.npu_graph.capture_end()
            else:
                self.npu_graph._capture_failed()
        finally:
            self._stream_ctx.__exit__(exc_type, exc, tb)


class _NPUTaskGroupHandle:
    def __init__(self, graph_, group: int):
        self.task_group = group
        self._graph = graph_


def graph_task_group_begin(stream: Stream) -> None:
    if stream.capturing is None:
        raise RuntimeError("graph_task_group_begin needs a stream that is capturing a graph")
    stream.capturing.task_group_begin()


def graph_task_group_end(stream: Stream) -> _NPUTaskGroupHandle:
    if stream.capturing is None:
        raise RuntimeError("graph_task_group_end needs a stream that is capturing a graph")
    return _NPUTaskGroupHandle(stream.capturing, stream.capturing.task_group_end())


def graph_task_update_begin(stream: Stream, handle: _NPUTaskGroupHandle) -> None:
    if stream.capturing is not None:
        raise RuntimeError("graph_task_update_begin needs a stream that is not capturing (an "
                           "update stream of its own)")
    if stream.update_handle is not None:
        raise RuntimeError("graph_task_update_begin: an update is already open on this stream")
    if not isinstance(handle, _NPUTaskGroupHandle) or not handle._graph.segments:
        raise RuntimeError("graph_task_update_begin: the handle is not a task group of a "
                           "captured graph")
    # The update is for the graph's last replay if that one waits at an event (launched
    # first, as vllm-ascend does), else for its next one; the replay before must have run.
    before_last, last = handle._graph.last_replays
    served, previous = (last, before_last) if handle._graph in _WAITING else (None, last)
    if served is not None and _ordered_before(stream, served, host=False):
        raise _graph.GraphReplayError(
            "graph_task_update_begin: the update stream waits for the replay this update serves "
            "(wait_stream after the replay was launched), which waits for the update: on the chip "
            "both streams hang. Make the update stream wait before launching the replay")
    if previous is not None and not _ordered_before(stream, previous):
        raise _graph.GraphReplayError(
            "graph_task_update_begin: the graph's previous replay may still run on the device "
            "(the host launched it and did not wait), and nothing orders this update after it: "
            "on the chip the update can rewrite the host lists of an attention node that replay "
            "has yet to run. Before launching the replay, make the update stream wait for the "
            "stream it replays on (update_stream.wait_stream(current_stream()))")
    stream.update_handle = handle
    stream.update_issued = False


def graph_task_update_end(stream: Stream) -> None:
    handle, stream.update_handle = stream.update_handle, None
    if handle is None:
        raise RuntimeError("graph_task_update_end without graph_task_update_begin")
    if not stream.update_issued:
        raise RuntimeError(
            "graph_task_update_end: no task was issued on the update stream between "
            "graph_task_update_begin and graph_task_update_end (was the op issued under "
            "torch.npu.stream(update_stream)?)")


def open_task_update():
    """The (stream, handle) of a task update open on the current stream, or None (used by the
    simulator's ops: an op issued now re-parameterises the captured task instead of running)."""
    s = current_stream()
    return (s, s.update_handle) if s.update_handle is not None else None


def issue_task_update(func, args: tuple, kwargs: dict) -> None:
    """Checked when issued; applied when the update stream's work runs (see the module doc).
    Host arguments are copied at issue, as a launch copies them: later changes to a list the
    caller passed do not reach the device."""
    s, handle = open_task_update()
    if s.update_issued:
        raise RuntimeError("a task update re-issues exactly one op")
    kwargs = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in kwargs.items()}
    apply = handle._graph.task_update(handle.task_group, func, args, kwargs)
    s.update_issued = True
    _ledger.note(_ledger.UPDATES)
    s.defer(apply)


# -- devices and their contexts -------------------------------------------------------------------
#
# A node has $VLLM_ASCEND_SIM_DEVICES devices (default 8, as a 910 server), of which a process sees
# those $ASCEND_RT_VISIBLE_DEVICES lists, in that order (the CANN runtime's rule). A process opens
# one device context, with set_device, before anything else touches the device: torch_npu would
# otherwise open one on device 0 implicitly, holding memory on a device that belongs to another
# worker. The simulator makes that an error, and one context per process, and one live process
# per device on the node (a second worker on a device would share its memory and HBM budget and
# break HCCL's one-rank-per-device rule): each open device is claimed in a file of the node's
# registry, released at the worker's shutdown or when its process is gone. Several simulated
# nodes can share one machine (a Ray cluster rehearsed on one host): $VLLM_ASCEND_SIM_NODE names
# the node a process runs on, and each name has its own devices and registry.

DEVICES_ENV = "VLLM_ASCEND_SIM_DEVICES"
VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"
NODE_ENV = "VLLM_ASCEND_SIM_NODE"
DEFAULT_DEVICES = 8


class DeviceContextError(RuntimeError):
    pass


_context: "int | None" = None  # the physical device this process opened


def _node_devices() -> int:
    value = os.environ.get(DEVICES_ENV, str(DEFAULT_DEVICES))
    if not value.isdigit() or int(value) <= 0:
        raise ValueError(f"{DEVICES_ENV}={value!r} must be a positive integer")
    return int(value)


def _visible() -> list[int]:
    """The physical devices this process may open, by visible ordinal."""
    count = _node_devices()
    value = os.environ.get(VISIBLE_ENV, "").strip()
    if not value:
        return list(range(count))
    ids = []
    for item in value.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) >= count:
            raise DeviceContextError(
                f"{VISIBLE_ENV}={value!r}: {item!r} is not a device of this node (devices 0 to "
                f"{count - 1}; {DEVICES_ENV}={count})")
        ids.append(int(item))
    return ids


def device_count() -> int:
    return len(_visible())


def _registry() -> str:
    import tempfile

    node = os.environ.get(NODE_ENV, "")
    if node and not node.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"{NODE_ENV}={node!r}: a node name is letters, digits, '-' and '_'")
    path = os.path.join(tempfile.gettempdir(),
                        f"vllm-ascend-sim-{os.getuid()}" + (f"-{node}" if node else ""))
    os.makedirs(path, exist_ok=True)
    return path


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs. A process that has exited but not been reaped (a zombie: vLLM
    SIGKILLs an engine core that outlives its 5 s of grace and never waits for it) holds no
    device: the driver releases a device when the process's files close, at exit."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]  # the field after "(comm)"
    except (OSError, IndexError):
        return True  # no /proc: a live pid holds its device
    return state not in ("Z", "X")


def devices_in_use() -> dict[int, int]:
    """Physical device -> pid of the live process that holds it, on this node."""
    held = {}
    for name in os.listdir(_registry()):
        if name.startswith("device-"):
            try:
                with open(os.path.join(_registry(), name)) as f:
                    pid = int(f.read().strip() or 0)
            except (OSError, ValueError):
                continue
            if pid and _alive(pid):
                held[int(name.removeprefix("device-"))] = pid
    return held


def _claim(physical: int) -> bool:
    """Take ``physical`` for this process; whether it was not already this process's."""
    path = os.path.join(_registry(), f"device-{physical}")
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            holder = devices_in_use().get(physical)
            if holder == os.getpid():
                return False
            if holder is not None:
                raise DeviceContextError(
                    f"NPU {physical} is already in use by process {holder} (another engine, or "
                    "another worker of this one): two processes on one device share its "
                    "memory, and HCCL takes one rank per device. Stop the other engine, or give "
                    f"each worker its own device ({VISIBLE_ENV}, or fewer ranks per node).")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # its process is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True


def set_device(device) -> None:
    """Open this process's device context on visible ordinal ``device`` (an int, or a
    torch.device; the simulator's CPU device without an index means the process's own device)."""
    global _context
    # A safe point: a guard that a failed wait left on the mode stack (the replay gave up inside
    # the guard's own dispatch, where it cannot pop itself) would keep Dynamo from compiling the
    # next engine's model in this process.
    if not _mine():
        _pop_guard()
    index = device if isinstance(device, int) else torch.device(device).index
    visible = _visible()
    if index is None:
        index = visible.index(_context) if _context in visible else 0
    if not 0 <= index < len(visible):
        raise DeviceContextError(f"set_device({index}): invalid device ordinal, this process "
                                 f"sees {len(visible)} device(s) ({VISIBLE_ENV}, "
                                 f"{DEVICES_ENV})")
    physical = visible[index]
    if _context is not None and _context != physical:
        raise DeviceContextError(
            f"set_device({index}) opens device {physical}, but this process already opened "
            f"device {_context}: one device context per process (one worker per device).")
    if _claim(physical):
        _memory.open_device()  # a worker's device: what the process holds now is host memory
    _context = physical
    _matmul.install()  # the device's bf16/fp16 matrix products


_workers = 0  # the workers of this process that hold its device (engines run in-process)


def hold_device() -> None:
    """A worker of this process uses its device until it calls ``release_device``."""
    global _workers
    _workers += 1


def release_device() -> None:
    """A worker using this process's device shut down: when it was the last, another process
    may open the device, and a worker that opens it next starts from an empty device."""
    global _workers
    _workers = max(_workers - 1, 0)
    if _workers:
        return
    _matmul.release_packs()
    if _context is not None and devices_in_use().get(_context) == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(_registry(), f"device-{_context}"))


def is_initialized() -> bool:
    return _context is not None


def current_device() -> int:
    return _visible().index(_opened("current_device"))


def _opened(what: str) -> int:
    """The device this process opened; touching the device before that is an error."""
    if _context is None:
        raise DeviceContextError(
            f"torch.npu.{what}() in a process that has not called torch.npu.set_device: on the "
            "chip this opens a context on device 0, holding its memory, from a process that "
            "does not own it (an API server, an engine core whose workers are other "
            "processes). Ask the device only in the worker, after set_device.")
    return _context


# The chip the simulator answers as: $VLLM_ASCEND_SIM_SOC names an Atlas A2 (Ascend910B*) or A3
# (Ascend910_93*) SoC, as torch_npu's get_device_name returns it, and the simulated operators
# whose contract differs by chip (MC2, sim/mc2.py) check that chip's limits. Unset, the device
# is no chip of those, and the chip-specific operators refuse to run.
SOC_ENV = "VLLM_ASCEND_SIM_SOC"
DEFAULT_SOC = "Ascend simulator (CPU)"
SOC_PREFIXES = {"Ascend910B": "A2", "Ascend910_93": "A3"}


def soc_name() -> str:
    value = os.environ.get(SOC_ENV, "").strip()
    if value and not any(value.startswith(p) for p in SOC_PREFIXES):
        raise ValueError(f"{SOC_ENV}={value!r} is not a simulated SoC: name an Atlas A2 "
                         "(Ascend910B1 ... Ascend910B4) or A3 (Ascend910_9382, ...) chip, or "
                         "leave it unset")
    return value or DEFAULT_SOC


def soc_generation() -> str | None:
    """``A2``, ``A3``, or None for the default simulator."""
    name = soc_name()
    return next((g for p, g in SOC_PREFIXES.items() if name.startswith(p)), None)


def get_device_name(device=None) -> str:
    _opened("get_device_name")
    return soc_name()


def total_memory() -> int:
    """The simulated device memory: $VLLM_ASCEND_SIM_MEMORY_GB, default a quarter of RAM."""
    _opened("mem_get_info")
    return configured_memory()


def configured_memory() -> int:
    """What ``total_memory`` gives a process that opens a device (without opening one)."""
    import psutil

    value = os.environ.get(MEMORY_ENV)
    if value:
        try:
            gb = float(value)
        except ValueError:
            gb = -1
        if gb <= 0:
            raise ValueError(f"{MEMORY_ENV}={value!r} must be a positive number of GiB")
        return int(gb * (1 << 30))
    return psutil.virtual_memory().total // 4


def _check_memory(what: str) -> tuple[int, int]:
    """(torch's allocation now, its peak), after the out-of-memory check: the simulator cannot
    see allocations, so an excess is found when memory is next asked about."""
    return _memory.check_capacity(total_memory(), _opened(what))


# torch's allocator (sim/memory.py: the heap this process gained since it opened its device) and
# the whole device (that, plus what is held outside torch's allocator).
def memory_allocated(device=None) -> int:
    return _check_memory("memory_allocated")[0]


def memory_reserved(device=None) -> int:
    return _check_memory("memory_reserved")[0]  # no cache: the heap returns what torch frees


def max_memory_allocated(device=None) -> int:
    return _check_memory("max_memory_allocated")[1]


def reset_peak_memory_stats(device=None) -> None:
    _opened("reset_peak_memory_stats")
    _memory.reset_peak()


def memory_stats(device=None) -> dict:
    current, peak = _check_memory("memory_stats")
    return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": current, "reserved_bytes.all.peak": peak}


def empty_cache() -> None:
    """Nothing is cached: the heap takes back what torch frees at once."""


def mem_get_info(device=None) -> tuple[int, int]:
    current, _ = _check_memory("mem_get_info")
    total = total_memory()
    return max(total - current - _memory.outside_torch(), 0), total


from vllm_ascend.device.sim import mempool as memory  # noqa: E402  (torch.npu.memory's pools)
