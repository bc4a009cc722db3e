"""A log of the torch_npu calls a process makes, for checking them against upstream's call sites.

With ``VLLM_ASCEND_SIM_CALL_LOG=<path>`` set when a process imports the simulator or prepares
an engine, every call into the simulated torch_npu surface (while the setting stays) appends one
JSON line per distinct call shape: the API name, and for each argument (positional in order,
then keywords) its kind: a tensor's dtype, rank and contiguity, a host list, a string's value, a
stream's state. A call made from Python (an eager step, attention between graph pieces, a
capture or a task update) is logged as its call site made it; a compiled piece calls the
operators directly, and those calls are logged by the operator (``kernel``) as the dispatcher
hands them over, with ``"in": "graph"``. The simulator's own setting: the product does not know
of it.
"""

import functools
import json
import os
import threading

import torch

CALL_LOG_ENV = "VLLM_ASCEND_SIM_CALL_LOG"
_seen: set = set()
_lock = threading.Lock()


def describe(value):
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype).removeprefix("torch."), "dim": value.dim(),
                "contiguous": value.is_contiguous()}
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return "list[int]"
        return [describe(v) for v in value]
    if isinstance(value, str):
        return value
    capturing = getattr(value, "capturing", ...)
    if capturing is not ...:  # a stream
        return "stream(capturing)" if capturing is not None else "stream"
    return type(value).__name__


_local = threading.local()  # depth of logged Python calls: their operators are not logged again


def _log(name: str, args, kwargs, where: str | None = None) -> None:
    if torch.compiler.is_compiling():
        # Dynamo is tracing the call into a compiled piece: the piece later calls the op
        # itself, not this wrapper, so only calls made from Python (eager steps, the attention
        # op between pieces, captures and updates) are logged.
        return
    path = os.environ.get(CALL_LOG_ENV)
    if not path:
        return
    record = {"api": name, "args": [describe(a) for a in args],
              "kwargs": {k: describe(v) for k, v in kwargs.items()}}
    if where:
        record["in"] = where
    line = json.dumps(record, sort_keys=True)
    with _lock:
        if (path, line) in _seen:
            return
        _seen.add((path, line))
        with open(path, "a") as f:
            f.write(line + "\n")


def _call_logged(name: str, fn, args, kwargs, bound=()):
    _log(name, args, kwargs)
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        return fn(*bound, *args, **kwargs)
    finally:
        _local.depth -= 1


def traced(name: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        return _call_logged(name, fn, args, kwargs)

    return call


# "name" or "name.overload" of each ascend_sim op -> its CPU kernel: a graph replay calls it
# without the dispatcher (sim/replay.py), as a captured task runs without its host launch.
KERNELS: dict = {}


def kernel(name: str, fn):
    """An operator's implementation, logging the calls no Python call site logged: a compiled
    piece's."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        # Only once the Python surface logs (else an eager call would pass for a graph's).
        if _installed and not getattr(_local, "depth", 0) and os.environ.get(CALL_LOG_ENV):
            _log(name, args, kwargs, where="graph")
        return fn(*args, **kwargs)

    KERNELS[name] = call
    return call


_installed = False


def install_if_requested(torch_npu_module, npu_module) -> None:
    """Wrap the simulated torch_npu and torch.npu surfaces, once, if the log is on."""
    global _installed
    if os.environ.get(CALL_LOG_ENV) and not _installed:
        _installed = True
        install(torch_npu_module, npu_module)


def install(torch_npu_module, npu_module) -> None:
    fias = (torch_npu_module.npu_fused_infer_attention_score,
            torch_npu_module.npu_fused_infer_attention_score_v2)
    # Every operator the simulated torch_npu names, so that a new one is logged without a list
    # to keep (Gated DeltaNet's were once missed); FIA v1 and v2, one class, are wrapped below.
    for name in [n for n in dir(torch_npu_module) if n.startswith(("npu_", "_npu_"))]:
        fn = getattr(torch_npu_module, name)
        if callable(fn) and not any(fn is fia for fia in fias):
            setattr(torch_npu_module, name, traced(name, fn))
    call = type(fias[0]).__call__  # one class for v1 and v2: logged under each one's name

    @functools.wraps(call)
    def traced_call(self, *args, **kwargs):
        return _call_logged(self.name, call, args, kwargs, bound=(self,))

    type(fias[0]).__call__ = traced_call
    for fia in fias:
        fia.out = traced(f"{fia.name}.out", fia.out)
    for name in ("graph_task_group_begin", "graph_task_group_end", "graph_task_update_begin",
                 "graph_task_update_end", "graph", "graph_pool_handle", "current_stream",
                 "stream", "synchronize", "is_current_stream_capturing"):
        setattr(npu_module, f"{name}", traced(f"npu.{name}", getattr(npu_module, name)))
    event = npu_module.ExternalEvent
    for name in ("wait", "reset", "record"):
        method = getattr(event, name)
        setattr(event, name, _traced_method(f"npu.ExternalEvent.{name}", method))
    for cls, names in ((npu_module.NPUGraph, ("replay", "capture_begin", "capture_end")),
                       (npu_module.Stream, ("synchronize", "wait_stream"))):
        for name in names:
            setattr(cls, name, _traced_method(f"npu.{cls.__name__}.{name}", getattr(cls, name)))


def _traced_method(name, method):
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        _log(name, args, kwargs)
        return method(self, *args, **kwargs)

    return call
