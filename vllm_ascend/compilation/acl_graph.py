"""ACLGraphWrapper: one captured ACL graph per BatchDescriptor, replayed when the forward context
says so. vLLM wraps each PIECEWISE piece with it (the platform's static graph wrapper) and the
runner wraps the whole model with it for FULL modes.

Like upstream's CUDAGraphWrapper it trusts the forward context (runtime mode, batch descriptor)
and passes through when the runtime mode is not its own. Unlike it, the input-address check is
always on: a replay reads its inputs at the captured addresses, whatever was passed.
"""

import dataclasses
import weakref
from contextlib import ExitStack
from typing import Any, ClassVar
from unittest.mock import patch

import torch
from vllm.compilation.counter import compilation_counter
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.compilation.monitor import validate_cudagraph_capturing_enabled
from vllm.platforms import current_platform

from vllm_ascend import device
from vllm_ascend.device import torch_npu
from vllm_ascend.logger import get_logger

logger = get_logger(__name__)


STREAM_EXHAUSTED = "207008"


class GraphCaptureFailed(RuntimeError):
    pass


@dataclasses.dataclass
class GraphStats:
    """Process-wide counts, for logs and tests."""
    captured: dict = dataclasses.field(default_factory=dict)  # runtime mode name -> graphs
    replayed: dict = dataclasses.field(default_factory=dict)  # runtime mode name -> replays

    def as_dict(self) -> dict:
        return {"captured": dict(self.captured), "replayed": dict(self.replayed),
                "streams_in_use": device.current.streams_in_use()}


STATS = GraphStats()


class GraphHooks:
    """What the owner of a wrapper does around its captures and replays (default: nothing)."""

    def capture_begin(self, desc) -> None:
        pass

    def capture_end(self) -> None:
        pass

    def after_replay(self, desc) -> None:
        """Right after a replay was launched (FULL graphs: issue the step's task updates)."""


@dataclasses.dataclass
class _Entry:
    graph: Any
    output: Any
    input_addresses: list[int]


def weak_ref_tensors(outputs):
    """Non-owning references to a capture's outputs (the graph's pool owns them), as upstream's
    vllm_ascend.utils.weak_ref_tensors does through torch_npu._C._weak_ref_tensor."""
    if isinstance(outputs, torch.Tensor):
        return torch_npu._C._weak_ref_tensor(outputs)
    if isinstance(outputs, (list, tuple)):
        return type(outputs)(weak_ref_tensors(x) for x in outputs)
    return outputs


def _input_addresses(args) -> list[int]:
    return [x.data_ptr() for x in args if isinstance(x, torch.Tensor)]


def capture_advice(error: Exception, runtime_mode: CUDAGraphMode) -> str:
    return (
        f"Capturing a {runtime_mode.name} ACL graph failed: {error}\n"
        "Each captured graph holds a device stream. Capture fewer graphs: lower the capture "
        "sizes (--compilation-config '{\"cudagraph_capture_sizes\": [1, 2, 4, 8]}' or "
        "'{\"max_cudagraph_capture_size\": 16}'), choose a mode with fewer graphs "
        "('{\"cudagraph_mode\": \"FULL_DECODE_ONLY\"}'), or run eagerly with --enforce-eager.")


class ACLGraphWrapper:
    _all_instances: ClassVar[weakref.WeakSet] = weakref.WeakSet()

    @classmethod
    def clear_all_graphs(cls) -> None:
        for instance in list(cls._all_instances):
            instance.clear_graphs()

    def __init__(self, runnable, vllm_config: VllmConfig, runtime_mode: CUDAGraphMode,
                 cudagraph_options=None, hooks: "GraphHooks | None" = None, **kwargs):
        assert runtime_mode != CUDAGraphMode.NONE
        self.runnable = runnable
        self.vllm_config = vllm_config
        self.runtime_mode = runtime_mode
        self.gc_disable = bool(cudagraph_options and cudagraph_options.gc_disable)
        # One pool for every graph of the process, as upstream (captures run largest first).
        self.graph_pool = current_platform.get_global_graph_pool()
        self.entries: dict = {}
        self.hooks = hooks or GraphHooks()
        ACLGraphWrapper._all_instances.add(self)

    def __getattr__(self, key: str) -> Any:
        if key != "runnable" and hasattr(self.runnable, key):
            return getattr(self.runnable, key)
        raise AttributeError(key)

    def unwrap(self):
        runnable = self.runnable
        return runnable.unwrap() if hasattr(runnable, "unwrap") else runnable

    def clear_graphs(self) -> None:
        for entry in self.entries.values():
            entry.graph.reset()
        self.entries.clear()

    def __call__(self, *args, **kwargs):
        if not is_forward_context_available():
            return self.runnable(*args, **kwargs)
        ctx = get_forward_context()
        mode, desc = ctx.cudagraph_runtime_mode, ctx.batch_descriptor
        if mode == CUDAGraphMode.NONE or mode != self.runtime_mode:
            return self.runnable(*args, **kwargs)
        entry = self.entries.get(desc)
        if entry is None:
            return self._capture(desc, args, kwargs)
        addresses = _input_addresses(args)
        if addresses != entry.input_addresses:
            raise RuntimeError(
                f"{self.runtime_mode.name} graph for {desc} replayed with inputs at other "
                f"addresses than at capture ({addresses} vs {entry.input_addresses}): the graph "
                "would read stale buffers. Inputs must live in the runner's persistent buffers.")
        if self.runtime_mode == CUDAGraphMode.FULL:
            # As upstream: the host must not run ahead of the previous replay, whose attention
            # may still wait for its update.
            torch_npu.npu.current_stream().synchronize()
        entry.graph.replay()
        self.hooks.after_replay(desc)
        STATS.replayed[mode.name] = STATS.replayed.get(mode.name, 0) + 1
        return entry.output

    def _capture(self, desc, args, kwargs):
        validate_cudagraph_capturing_enabled()
        graph = torch_npu.npu.NPUGraph()
        with ExitStack() as stack:
            if self.gc_disable:  # one gc per forward is enough while capturing many pieces
                stack.enter_context(patch("gc.collect", lambda *a, **k: None))
            try:
                self.hooks.capture_begin(desc)
                with torch_npu.npu.graph(graph, pool=self.graph_pool):
                    output = self.runnable(*args, **kwargs)
            except Exception as e:
                if STREAM_EXHAUSTED in str(e):  # the chip's (and simulator's) error code
                    raise GraphCaptureFailed(capture_advice(e, self.runtime_mode)) from e
                raise
            finally:
                self.hooks.capture_end()
        self.entries[desc] = _Entry(graph, weak_ref_tensors(output), _input_addresses(args))
        compilation_counter.num_cudagraph_captured += 1
        name = self.runtime_mode.name
        STATS.captured[name] = STATS.captured.get(name, 0) + 1
        return output
