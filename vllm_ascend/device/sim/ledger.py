"""The chip-cost ledger: what a stretch of work would cost a chip in launches and host waits.

While a ``Ledger`` is entered (``with Ledger() as ledger:``), the simulator counts:

* ``kernel launches``: device ops launched one at a time, i.e. dispatched outside a graph replay.
  Views and allocations launch nothing. A collective counts as one launch, and so does a
  simulated Triton kernel (``one_kernel``), whatever host ops implement it. An op implemented in
  Python (vLLM's attention custom op) is not itself counted; the device ops it issues are.
* ``graph replays``: ``NPUGraph.replay()`` calls, one launch each however many nodes they hold.
* ``task updates``: FIA re-issues through ``graph_task_update_begin/end``.
* ``blocking syncs``: the host waiting for the device: ``synchronize()`` of the device, a stream
  or an event, and a host read of a device value (``.item()``, ``bool(tensor)``); of them,
  ``blocking syncs by vllm-ascend`` those the plugin's own code asks for.
* ``host-to-device copies``: ``copy_(..., non_blocking=True)``, the staged copy vLLM and the
  plugin make from host buffers to device buffers (on the simulator both are CPU tensors, so
  the non-blocking flag is what names the direction).

The simulator's introspection, not torch_npu API: for benchmarks/step_profile.py and tests.
"""

import collections
import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

LAUNCHES, REPLAYS, UPDATES, SYNCS, H2D = ("kernel launches", "graph replays", "task updates",
                                          "blocking syncs", "host-to-device copies")
# The blocking syncs the plugin's own code asks for (the rest are vLLM's, whose number under
# async scheduling depends on how far the host ran ahead of the device).
PLUGIN_SYNCS = "blocking syncs by vllm-ascend"
ROWS = (LAUNCHES, REPLAYS, UPDATES, SYNCS, PLUGIN_SYNCS, H2D)
_COUNTED_NAMESPACES = {"aten", "prims", "ascend_sim", "c10d"}
# Ops that read a device value on the host (recorder.py refuses them during capture).
HOST_SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
              torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}
_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default}

_active: "Ledger | None" = None
_replaying = threading.local()


def note(row: str) -> None:
    """Count one ``row`` event if a ledger is open."""
    if _active is not None:
        _active.counts[row] += 1
        if row == SYNCS and _asked_by_plugin():
            _active.counts[PLUGIN_SYNCS] += 1


def _asked_by_plugin() -> bool:
    """Whether the innermost caller outside torch and the simulator is vllm-ascend's code."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module.startswith("vllm_ascend.device") or module.split(".")[0] == "torch"):
            return module.split(".")[0] == "vllm_ascend"
        frame = frame.f_back
    return False


class replaying:
    """Around a graph replay's execution: its nodes are not launches of their own."""

    def __enter__(self):
        _replaying.depth = getattr(_replaying, "depth", 0) + 1

    def __exit__(self, *exc):
        _replaying.depth -= 1


class one_kernel:
    """Around a simulated kernel (sim/v2_kernels.py: one Triton kernel on a chip): one launch;
    the ops and host reads that implement it on the host are neither launches nor syncs."""

    def __enter__(self):
        if getattr(_replaying, "depth", 0) == 0 and not getattr(_replaying, "kernel", 0):
            note(LAUNCHES)
        _replaying.kernel = getattr(_replaying, "kernel", 0) + 1

    def __exit__(self, *exc):
        _replaying.kernel -= 1


def is_open() -> bool:
    return _active is not None


class replayed_kernel(one_kernel):
    """Around a simulated kernel a graph replay calls without the dispatcher: one replayed op,
    under its op's name; the host ops that implement it are not counted."""

    def __init__(self, func):
        self.name = func._schema.name

    def __enter__(self):
        _active.replayed_ops[self.name] += 1
        super().__enter__()


class Ledger:
    """``with Ledger() as ledger:`` ... ``ledger.counts``: the rows above, counted meanwhile."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.replayed_ops: collections.Counter = collections.Counter()
        self.launched_ops: collections.Counter = collections.Counter()  # outside replays
        self._mode = _Counting(self.counts, self.replayed_ops, self.launched_ops)

    def __enter__(self) -> "Ledger":
        global _active
        if _active is not None:
            raise RuntimeError("a chip-cost ledger is already open")
        _active = self
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        global _active
        _active = None
        self._mode.__exit__(*exc)


class _Counting(TorchDispatchMode):
    def __init__(self, counts: collections.Counter, replayed_ops: collections.Counter,
                 launched_ops: collections.Counter):
        super().__init__()
        self.counts, self.replayed_ops, self.launched_ops = counts, replayed_ops, launched_ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace not in _COUNTED_NAMESPACES:
            # Implemented in Python: count the device ops it issues, not the call.
            with self:
                return func._op_dk(torch._C.DispatchKey.CPU, *args, **kwargs)
        if getattr(_replaying, "kernel", 0):
            pass  # the host's implementation of a simulated kernel, counted once
        elif getattr(_replaying, "depth", 0) == 0:
            if func in HOST_SYNCS:
                note(SYNCS)
            elif func is torch.ops.aten.copy_.default and kwargs.get(
                    "non_blocking", args[2] if len(args) > 2 else False):
                self.counts[H2D] += 1
            elif not (func.is_view or func in _ALLOCATIONS):
                self.counts[LAUNCHES] += 1
                self.launched_ops[func._schema.name] += 1
        else:
            self.replayed_ops[func._schema.name] += 1  # without the overload (.out)
        return func(*args, **kwargs)
