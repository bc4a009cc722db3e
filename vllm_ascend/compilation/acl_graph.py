"""ACLGraphWrapper: one captured ACL graph per BatchDescriptor, replayed when the forward context
says so. vLLM wraps each PIECEWISE piece with it (the platform's static graph wrapper) and the
runner wraps the whole model with it for FULL modes.

Like upstream's CUDAGraphWrapper it trusts the forward context (runtime mode, batch descriptor)
and passes through when the runtime mode is not its own. Unlike it, the input-address check is
always on: a replay reads its inputs at the captured addresses, whatever was passed.
"""

import collections
import dataclasses
import weakref
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest.mock import patch

import torch
from vllm.compilation.counter import compilation_counter
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.compilation.monitor import validate_cudagraph_capturing_enabled

from vllm_ascend.attention.graph_params import GRAPH_STATE, GraphParams
from vllm_ascend.device import torch_npu
from vllm_ascend.logger import get_logger

logger = get_logger(__name__)


STREAM_EXHAUSTED = "207008"


class GraphCaptureFailed(RuntimeError):
    pass


# vLLM's compile tags for speculative drafters' models (EAGLE/MTP heads; draft models).
DRAFTER_MODEL_TAGS = ("eagle_head", "draft_model")


class GraphState:
    """One engine's graphs, owned by its NPUModelRunner: their pool, the wrappers holding them,
    the FIA calls FULL graphs re-issue, and how many graphs were captured and replayed.

    It is registered by name in the engine's static forward context (the per-engine table where
    vLLM's forward-pass objects find each other), so the wrappers and attention layers of one
    engine find its state and no other engine's; ``release`` frees its graphs and their streams.
    """

    def __init__(self):
        self.pool = torch_npu.npu.graph_pool_handle()  # captures run largest first
        self.wrappers: weakref.WeakSet = weakref.WeakSet()
        self.fia = GraphParams()
        self.captured: collections.Counter = collections.Counter()  # runtime mode -> graphs
        self.replayed: collections.Counter = collections.Counter()  # runtime mode -> replays
        # The speculative drafter's share of those.
        self.drafter_captured: collections.Counter = collections.Counter()
        self.drafter_replayed: collections.Counter = collections.Counter()
        # The runner's padding decisions (worker/padding.StepPadding) of the latest steps, to
        # check the replays against the schedule.
        self.recent_steps: collections.deque = collections.deque(maxlen=1024)

    @staticmethod
    def of(vllm_config: VllmConfig) -> "GraphState":
        state = vllm_config.compilation_config.static_forward_context.get(GRAPH_STATE)
        if state is None:
            raise RuntimeError("ACL graphs need vllm-ascend's NPUModelRunner, which owns their "
                               "state; this engine has none (was the worker replaced?)")
        return state

    def counts(self) -> dict:
        counts = {"captured": dict(self.captured), "replayed": dict(self.replayed)}
        if self.drafter_captured:
            counts["drafter"] = {"captured": dict(self.drafter_captured),
                                 "replayed": dict(self.drafter_replayed)}
        return counts

    def clear(self) -> None:
        """Drop every captured graph (and the streams they hold) and the counts; the wrappers
        stay, to capture again."""
        for wrapper in list(self.wrappers):
            wrapper.clear_graphs()
        self.fia.clear()
        for counter in (self.captured, self.replayed, self.drafter_captured,
                        self.drafter_replayed):
            counter.clear()
        self.recent_steps.clear()

    def release(self) -> None:
        self.clear()
        self.wrappers.clear()
        self.pool = None


class GraphHooks:
    """What the owner of a wrapper does around its captures and replays (default: nothing)."""

    def capture_begin(self, desc) -> None:
        pass

    def capture_end(self) -> None:
        pass

    def before_replay(self, desc) -> None:
        """Right before a replay is launched (FULL graphs: order the updates after the last)."""

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


@contextmanager
def without_dp_sizes(ctx):
    """Hide the step's per-rank token counts while a graph is captured: a graph step runs the
    same padded token count on every data-parallel rank (vLLM pads them alike whenever the
    synced mode has graphs), so an MoE layer needs none; and host values read during capture
    would be frozen into the graph. (vLLM's MoE runner reads them with .tolist().)"""
    dp_metadata, ctx.dp_metadata = ctx.dp_metadata, None
    try:
        yield
    finally:
        ctx.dp_metadata = dp_metadata


class ACLGraphWrapper:
    def __init__(self, runnable, vllm_config: VllmConfig, runtime_mode: CUDAGraphMode,
                 cudagraph_options=None, hooks: "GraphHooks | None" = None, **kwargs):
        assert runtime_mode != CUDAGraphMode.NONE
        self.runnable = runnable
        self.vllm_config = vllm_config
        self.runtime_mode = runtime_mode
        self.gc_disable = bool(cudagraph_options and cudagraph_options.gc_disable)
        self.state = GraphState.of(vllm_config)
        self.state.wrappers.add(self)
        self.entries: dict = {}
        self.hooks = hooks or GraphHooks()
        # A piece of a speculative drafter's model, by the tag vLLM compiles it under.
        backend = getattr(runnable, "vllm_backend", None)
        self.drafter = getattr(backend, "prefix", "") in DRAFTER_MODEL_TAGS

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
        self.hooks.before_replay(desc)
        entry.graph.replay()
        self.hooks.after_replay(desc)
        self.state.replayed[mode.name] += 1
        if self.drafter:
            self.state.drafter_replayed[mode.name] += 1
        return entry.output

    def _capture(self, desc, args, kwargs):
        validate_cudagraph_capturing_enabled()
        graph = torch_npu.npu.NPUGraph()
        with ExitStack() as stack:
            if self.gc_disable:  # one gc per forward is enough while capturing many pieces
                stack.enter_context(patch("gc.collect", lambda *a, **k: None))
            stack.enter_context(without_dp_sizes(get_forward_context()))
            try:
                self.hooks.capture_begin(desc)
                with torch_npu.npu.graph(graph, pool=self.state.pool):
                    output = self.runnable(*args, **kwargs)
            except Exception as e:
                if STREAM_EXHAUSTED in str(e):  # the chip's (and simulator's) error code
                    raise GraphCaptureFailed(capture_advice(e, self.runtime_mode)) from e
                raise
            finally:
                self.hooks.capture_end()
        self.entries[desc] = _Entry(graph, weak_ref_tensors(output), _input_addresses(args))
        compilation_counter.num_cudagraph_captured += 1
        self.state.captured[self.runtime_mode.name] += 1
        if self.drafter:
            self.state.drafter_captured[self.runtime_mode.name] += 1
        return output
