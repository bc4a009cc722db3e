"""The simulator's device events: ``Event`` (a point in a stream's work, waited on or
synchronised) and ``ExternalEvent`` (graph_external=True: a graph captures a wait on it, and a
replay holds at that node until a task update records it). Their ordering rules are those of
sim/streams.py (../shared/TORCH_NPU_CONTRACTS.md sections 4 and 8)."""

from vllm_ascend.device.sim import ledger as _ledger
from vllm_ascend.device.sim import memory as _memory
from vllm_ascend.device.sim.streams import (STREAMS, Stream, check_no_waiting_replay,
                                            current_stream, deadlock_error, host_learns,
                                            merge_order, resume, waiting_replays)


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
        merge_order((stream or current_stream()).ordered_after, self._knows)

    def synchronize(self) -> None:
        _ledger.note(_ledger.SYNCS)
        if self._mark is not None:
            self._mark[0].flush(self._mark[1])
        check_no_waiting_replay("Event.synchronize")
        _memory.synchronized()
        host_learns(self._knows)

    def query(self) -> bool:
        return (self._mark is None or self._mark[0].done(self._mark[1])) and not waiting_replays()


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
                raise deadlock_error("ExternalEvent.wait on a stream that is not capturing, "
                                     "with no record() before it")
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
        if s is not STREAMS.default:
            self._pending = (s, s._issued + 1)
        s.defer(self._record_now)

    def _record_now(self) -> None:
        self._pending = None
        self._recorded = True
        waiting, self._waiting = self._waiting, []
        for graph, resume_at in waiting:
            resume(graph, resume_at)

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
