"""The simulator's ``torch.npu`` (``torch_npu.npu``): what vllm-ascend calls of it, by its names.

Streams and events are in sim/streams.py and sim/events.py, the devices, their contexts and
memory queries in sim/devices.py, torch.npu.memory's pools in sim/mempool.py; they are named
here as torch.npu names them. What is here: ACL graphs (``NPUGraph``, ``graph``, the pool
handle), task groups and task updates, and a device context's opening and release, which also
install and drop the simulator's matrix products (sim/matmul.py), and install its exponential
random numbers (sim/rng.py).

A graph captures only on a capturing (non-default) stream; task groups open only there and
task updates only on a non-capturing one. A task update of a graph whose previous replay is not
ordered before it (a wait on its stream, or a host synchronisation) fails at once: on the chip
it could rewrite the host lists of an attention node that replay has yet to run.
"""

from vllm_ascend.device.sim import devices as _devices
from vllm_ascend.device.sim import graph as _graph
from vllm_ascend.device.sim import ledger as _ledger
from vllm_ascend.device.sim import matmul as _matmul
from vllm_ascend.device.sim import mempool as memory  # noqa: F401  (torch.npu.memory's pools)
from vllm_ascend.device.sim import rng as _rng
from vllm_ascend.device.sim.devices import (  # noqa: F401  (torch.npu's names)
    DEVICES_ENV, MEMORY_ENV, NODE_ENV, SOC_ENV, VISIBLE_ENV, DeviceContextError,
    configured_memory, current_device, device_count, devices_in_use, empty_cache,
    get_device_name, hold_device, is_initialized, max_memory_allocated, mem_get_info,
    memory_allocated, memory_reserved, memory_stats, opened, reset_peak_memory_stats,
    soc_generation, soc_name, total_memory)
from vllm_ascend.device.sim.errors import GraphReplayError
from vllm_ascend.device.sim.events import Event, ExternalEvent  # noqa: F401
from vllm_ascend.device.sim.graph_pool import GraphPool
from vllm_ascend.device.sim.streams import (  # noqa: F401  (torch.npu's names)
    DEFAULT_STREAMS, STREAM_POOL, STREAMS, STREAMS_ENV, WAITING, Stream, check_no_waiting_replay,
    current_stream, default_stream, hold, is_current_stream_capturing, ordered_before, pop_guard,
    set_stream, stream, stream_budget, streams_in_use, synchronize, waiting_replays)


def set_device(device) -> None:
    """Open this process's device context (sim/devices.py) and install the device's bf16/fp16
    matrix products and its exponential random numbers in it."""
    # A safe point: a guard that a failed wait left on the mode stack (the replay gave up inside
    # the guard's own dispatch, where it cannot pop itself) would keep Dynamo from compiling the
    # next engine's model in this process.
    if not waiting_replays():
        pop_guard()
    _devices.set_device(device)
    _matmul.install()
    _rng.install()


def release_device() -> None:
    """A worker using this process's device shut down (sim/devices.py); with the last one the
    weights' copies go too (sim/matmul.py)."""
    if _devices.release_device():
        _matmul.release_copies()


class _PoolHandle:
    """What graph_pool_handle() returns: an opaque id of one memory pool."""

    def __init__(self):
        self.pool = GraphPool()


def graph_pool_handle() -> _PoolHandle:
    return _PoolHandle()


class NPUGraph:
    """torch.npu.NPUGraph: capture_begin/capture_end around the work, replay(), reset()."""

    def __init__(self, keep_graph=False):
        self._graph = _graph.SimGraph(STREAM_POOL)
        self._pool: _PoolHandle | None = None
        self._stream: Stream | None = None

    def capture_begin(self, pool=None, capture_error_mode="global") -> None:
        opened("NPUGraph.capture_begin")
        check_no_waiting_replay("NPUGraph.capture_begin")
        s = current_stream()
        if s is STREAMS.default:
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
        check_no_waiting_replay("NPUGraph.replay")
        _ledger.note(_ledger.REPLAYS)
        s = current_stream()
        s.replays += 1
        self._graph.last_replays = (self._graph.last_replays[1], (s, s.replays))
        blocked_at = self._graph.run(0)
        if blocked_at is not None:
            hold(self._graph, blocked_at)

    def reset(self) -> None:
        self._graph.reset()

    def pool(self) -> _PoolHandle:
        return self._pool

    # The simulator's own introspection (not torch_npu API): for tests and logs.
    @property
    def sim_graph(self) -> _graph.SimGraph:
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
    served, previous = (last, before_last) if handle._graph in WAITING else (None, last)
    if served is not None and ordered_before(stream, served, host=False):
        raise GraphReplayError(
            "graph_task_update_begin: the update stream waits for the replay this update serves "
            "(wait_stream after the replay was launched), which waits for the update: on the chip "
            "both streams hang. Make the update stream wait before launching the replay")
    if previous is not None and not ordered_before(stream, previous):
        raise GraphReplayError(
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
