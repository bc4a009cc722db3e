"""The simulator's device streams: their queued work and its order, the host's synchronisations,
the stream budget that captured graphs draw on (``StreamPool``), and the replays held at an
ExternalEvent (events are in sim/events.py, graphs in sim/npu.py and sim/graph.py), as
../shared/TORCH_NPU_CONTRACTS.md sections 4 and 8 describe the chip's.

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

from vllm_ascend.device.sim import ledger as _ledger
from vllm_ascend.device.sim import memory as _memory
from vllm_ascend.device.sim.errors import (STREAM_EXHAUSTED_CODE, GraphReplayError,
                                           StreamResourceError)

STREAMS_ENV = "VLLM_ASCEND_SIM_STREAMS"
DEFAULT_STREAMS = 2048  # a 910-class chip's stream budget for the whole software stack


def stream_budget() -> int:
    value = os.environ.get(STREAMS_ENV, str(DEFAULT_STREAMS))
    if not value.isdigit() or int(value) <= 0:
        raise ValueError(f"{STREAMS_ENV}={value!r} must be a positive integer")
    return int(value)


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


STREAM_POOL = StreamPool(stream_budget)


def streams_in_use() -> int:
    """Streams held by live captured graphs (the simulator's own count)."""
    return STREAM_POOL.in_use


# -- streams ---------------------------------------------------------------------------------------

class Stream:
    """A device stream. Streams come from a per-device pool, as torch's CUDA and NPU streams do,
    so creating one does not take a hardware stream of the budget; a captured graph does."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = torch.device("cpu")
        self.capturing = None  # the graph capturing on this stream
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
        if self is STREAMS.default:
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
        check_no_waiting_replay("synchronize")
        _memory.synchronized()
        host_learns(self.knows())

    def wait_stream(self, stream) -> None:
        stream.flush()  # this stream's later work runs after all that ``stream`` holds now
        merge_order(self.ordered_after, stream.knows())

    def wait_event(self, event) -> None:
        event.wait(self)

    def __repr__(self):
        return f"<sim npu Stream {id(self):#x}>"


class _Streams(threading.local):
    def __init__(self):
        self.default = Stream()
        self.stack = [self.default]


_ALL_STREAMS: weakref.WeakSet = weakref.WeakSet()
STREAMS = _Streams()
_PENDING: dict = {}  # streams with queued work, in the order they got it


def merge_order(into, knows: dict) -> None:
    for s, replays in knows.items():
        if into.get(s, 0) < replays:
            into[s] = replays


class _Host(threading.local):
    def __init__(self):
        # The replays this host thread knows finished (it synchronised after them).
        self.knows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_HOST = _Host()


def host_learns(knows: dict) -> None:
    merge_order(_HOST.knows, knows)


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
    return STREAMS.stack[-1]


def default_stream(device=None) -> Stream:
    return STREAMS.default


@contextlib.contextmanager
def stream(s: "Stream | None"):
    if s is None:
        yield
        return
    STREAMS.stack.append(s)
    try:
        yield
    finally:
        STREAMS.stack.pop()
        if s not in STREAMS.stack:
            # The latest point the simulator lets the stream's queued work wait for: it cannot
            # see every host read of device memory (a gloo send, .numpy()), so the work does
            # not outlive the context it was issued in.
            s.flush()


def set_stream(s: Stream) -> None:
    """The current stream becomes ``s`` (in place of the current one, as torch.npu.set_stream
    does); a stream set aside runs its queued work, as at a ``stream`` context's exit."""
    replaced, STREAMS.stack[-1] = STREAMS.stack[-1], s
    if replaced not in STREAMS.stack:
        replaced.flush()


def synchronize(device=None) -> None:
    _ledger.note(_ledger.SYNCS)
    check_no_waiting_replay("synchronize")
    _memory.synchronized()
    for s in list(_ALL_STREAMS):
        host_learns({s: s.replays})


def ordered_before(stream: Stream, replay: "tuple[Stream, int]", host: bool = True) -> bool:
    """Whether work issued on ``stream`` now runs after ``replay`` (its stream, its number):
    through the stream's waits, or (``host``) a host synchronisation after it."""
    s, number = replay
    return (s is stream or stream.ordered_after.get(s, 0) >= number
            or host and _HOST.knows.get(s, 0) >= number)


def is_current_stream_capturing() -> bool:
    return current_stream().capturing is not None


# -- replays waiting on an event -------------------------------------------------------------------

WAITING: dict = {}  # graph -> (the segment it resumes at, the host thread that replayed it)


def waiting_replays() -> list:
    """The replays this host thread launched that wait on an event."""
    me = threading.get_ident()
    return [g for g, (_, thread) in list(WAITING.items()) if thread == me]


class _WaitingReplayGuard(TorchDispatchMode):
    """On this thread's mode stack while a replay it launched waits: any device op issued now
    would queue behind the graph on the chip and hang with it; here it fails loudly instead of
    reading the graph's stale outputs. Once nothing waits it passes ops through until the next
    safe point pops it (a mode cannot leave the stack from inside its own dispatch)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if waiting_replays():
            # The side streams' queued records may release the replays.
            _LOCAL.dispatching = True
            try:
                _flush_all()
            finally:
                _LOCAL.dispatching = False
        if waiting_replays():
            raise _give_up_waiting(f"the device op {func}")
        return func(*args, **(kwargs or {}))


class _Local(threading.local):
    def __init__(self):
        self.guard: "_WaitingReplayGuard | None" = None  # pushed on this thread's mode stack
        self.dispatching = False  # inside the guard's own dispatch


_LOCAL = _Local()


def pop_guard() -> None:
    """At a safe point (not inside the guard's own dispatch)."""
    if _LOCAL.guard is not None and not _LOCAL.dispatching:
        guard, _LOCAL.guard = _LOCAL.guard, None
        guard.__exit__(None, None, None)


def deadlock_error(what: str) -> RuntimeError:
    return GraphReplayError(
        f"{what}: a replayed ACL graph waits on an ExternalEvent that no task update recorded. "
        "On the chip this stream hangs. Before (or right after) every FULL replay, re-issue each "
        "captured attention op between graph_task_update_begin/end on the update stream and "
        "record its event there.")


def _give_up_waiting(what: str) -> RuntimeError:
    """Drop this thread's waiting replays (their work is lost, as on a chip that timed out)."""
    waiting = waiting_replays()
    for graph_ in waiting:
        WAITING.pop(graph_, None)
        stream, number = graph_.last_replays[1]
        host_learns({stream: number})  # it is over: the host saw it fail
        for _, event in graph_.segments:
            if event is not None:
                event._waiting = [w for w in event._waiting if w[0] is not graph_]
    return deadlock_error(f"{what} was issued while {len(waiting)} replay(s) wait")


def check_no_waiting_replay(what: str) -> None:
    """A host synchronisation: every stream's queued work runs; a replay still waiting then
    waits forever. (A sync in another host thread leaves this thread's replays to it.)"""
    _flush_all()
    if waiting_replays():
        error = _give_up_waiting(what)
        pop_guard()
        raise error
    pop_guard()


def hold(graph, resume_at: int) -> None:
    # One replay at a time can wait: a second one would run behind it on the same stream.
    check_no_waiting_replay("a second graph replay")
    WAITING[graph] = (resume_at, threading.get_ident())
    if _LOCAL.guard is None:  # (inside the guard's own dispatch it is still pushed)
        _LOCAL.guard = _WaitingReplayGuard()
        _LOCAL.guard.__enter__()


def resume(graph, resume_at: int) -> None:
    WAITING.pop(graph, None)
    pop_guard()
    blocked_at = graph.run(resume_at)
    if blocked_at is not None:
        hold(graph, blocked_at)
