"""NPUModelGraphManager: Model Runner V2's FULL-graph owner on Ascend.

V2 captures and replays FULL graphs in one place (vLLM's ModelCudaGraphManager: capture per
batch descriptor into ``torch.cuda.CUDAGraph``, dispatch, ``run_fullgraph``), while PIECEWISE
stays on the compile backend's wrappers (compilation/acl_graph.py), as in V1. On Ascend a FULL
graph is an ACL graph whose FIA calls re-issue the step's host lists before each replay's
attention runs (attention/graph_params.py), so this manager:

* captures into ``torch.npu.NPUGraph`` in the engine's graph pool, each capture opening a FIA
  task-group record keyed by its graph (the attention layers add their calls to it), and counts
  the graph in the engine's GraphState (streams, the start-up summary);
* replays FullGraphs, which issue the step's task updates (from the attention metadata the
  step built) right after each replay is launched, and count it; before each replay the update
  stream waits for the current one, so the updates never overtake the previous replay and the
  host never waits for the device.

NPUDraftGraphManager does the same for an EAGLE/MTP drafter's FULL graphs (vLLM's
SpeculatorCudaGraphManager: the draft prefill, and each draft decode step), counted as the
drafter's.
"""

import contextlib
from unittest import mock

import torch
from vllm.config import CUDAGraphMode
from vllm.distributed.parallel_state import GraphCaptureContext
from vllm.forward_context import get_forward_context
from vllm.v1.worker.gpu import cudagraph_utils
from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import (
    SpeculatorCudaGraphManager)

from vllm_ascend.compilation.acl_graph import (STREAM_EXHAUSTED, GraphCaptureFailed, GraphState,
                                               without_dp_sizes, capture_advice)
from vllm_ascend.device import torch_npu

FULL = CUDAGraphMode.FULL.name


@contextlib.contextmanager
def _graph_capture(device=None):
    """parallel_state.graph_capture's part on Ascend: a side stream, after the current one's
    work, to capture on (the communicators need nothing: collectives are captured as ops)."""
    stream = torch_npu.npu.Stream()
    stream.wait_stream(torch_npu.npu.current_stream())
    with torch_npu.npu.stream(stream):
        yield GraphCaptureContext(stream)


class FullGraph(torch_npu.npu.NPUGraph):
    """An ACL graph whose replay issues the step's task updates right after it is launched,
    before vLLM reads its outputs (the replay's attention waits for them)."""

    def __init__(self, after_replay, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.after_replay = after_replay

    def replay(self) -> None:
        super().replay()
        self.after_replay(self)


class _StartsCapture(torch.nn.Module):
    """The model as vLLM's capture loop calls it: a pending FULL capture starts at the call."""

    def __init__(self, model: torch.nn.Module, manager: "NPUModelGraphManager"):
        super().__init__()
        self.model = model
        self.start_pending = manager.start_pending

    def forward(self, *args, **kwargs):
        self.start_pending()
        return self.model(*args, **kwargs)


class AclGraphs:
    """The ACL half of an NPU graph manager (mixed into vLLM's CUDA one): captures into
    ``torch.npu.NPUGraph`` in the engine's pool with a FIA task-group record per graph, replays
    that re-issue the step's FIA host lists, the counts, and freeing the graphs."""

    STARTS_AT_MODEL_CALL = False  # capture from the forward function's call (as CUDA's)
    DRAFTER = False  # whose counts its graphs go to

    def _init_acl(self, state: GraphState, step_metadata) -> None:
        self._pending = None  # (its exit stack, torch.npu.graph) of a capture not yet begun
        self.state = state
        state.wrappers.add(self)  # its graphs go with the engine's (GraphState.clear)
        self.pool = state.pool  # FULL and PIECEWISE graphs share one pool, as in V1
        self.step_metadata = step_metadata  # () -> the metadata this step's attention built
        # The engine's counts, and the drafter's share of them (as V1's wrappers count).
        self._captured = [state.captured] + ([state.drafter_captured] if self.DRAFTER else [])
        self._replayed = [state.replayed] + ([state.drafter_replayed] if self.DRAFTER else [])

    def _acl_capture(self) -> contextlib.ExitStack:
        """vLLM's capture loop with its CUDA parts resolved to ACL ones: the graph class, the
        capture context, and parallel_state's graph_capture (which asserts a CUDA or XPU
        communicator; upstream vllm-ascend swaps the class for its own around capture)."""
        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(torch.cuda, "CUDAGraph", self._new_graph))
        stack.enter_context(mock.patch.object(torch.cuda, "graph", self._acl_graph))
        stack.enter_context(mock.patch.object(cudagraph_utils, "graph_capture", _graph_capture))
        return stack

    def _capture_stream(self, desc) -> torch.cuda.Stream:
        # vLLM's asks vllm.utils.torch_utils.current_stream(), a cache that only CUDA's
        # set_stream keeps current: the stream _graph_capture made current is the device's.
        return torch_npu.npu.current_stream()

    def _new_graph(self, *args, **kwargs) -> FullGraph:
        return FullGraph(self._after_replay, *args, **kwargs)

    def _after_replay(self, graph: FullGraph) -> None:
        self.state.fia.update(graph, self.step_metadata())
        for counts in self._replayed:
            counts[FULL] += 1

    @contextlib.contextmanager
    def _acl_graph(self, graph, pool=None, stream=None, **kwargs):
        """torch.cuda.graph's part: a capture into ``graph`` (from the model's call when
        STARTS_AT_MODEL_CALL: ``start_pending``), recording the FIA calls it holds."""
        self.state.fia.begin_capture(graph)
        capture = contextlib.ExitStack()
        self._pending = (capture, torch_npu.npu.graph(
            graph, pool=self.state.pool if pool is None else pool, stream=stream, **kwargs))
        try:
            if not self.STARTS_AT_MODEL_CALL:
                self.start_pending()
            yield
        except Exception as e:
            capture.__exit__(type(e), e, e.__traceback__)
            if STREAM_EXHAUSTED in str(e):  # the chip's (and simulator's) error code
                raise GraphCaptureFailed(capture_advice(e, CUDAGraphMode.FULL)) from e
            raise
        else:
            if self._pending is not None:
                raise RuntimeError("a FULL capture in which the model was not called")
            capture.close()
            for counts in self._captured:
                counts[FULL] += 1
        finally:
            self._pending = None
            self.state.fia.end_capture()

    def start_pending(self) -> None:
        """Begin the pending capture, its DP sizes hidden from the layers while it captures (as
        in V1's wrapper, which captures inside the model call)."""
        if self._pending is None:
            return
        (capture, graph), self._pending = self._pending, None
        capture.enter_context(graph)
        if self.STARTS_AT_MODEL_CALL:  # (inside the forward context vLLM's loop set)
            capture.enter_context(without_dp_sizes(get_forward_context()))

    def run_fullgraph(self, desc):
        self.state.fia.before_replay()
        return super().run_fullgraph(desc)

    def clear_graphs(self) -> None:
        """Free the graphs now, and the streams they hold (GraphState.clear, at the end of the
        memory profile and at shutdown): a graph's replay hook refers back to this manager."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self._graphs_captured = False

    def release_graphs(self) -> None:
        self.clear_graphs()
        super().release_graphs()


class NPUModelGraphManager(AclGraphs, ModelCudaGraphManager):
    """The model's FULL graphs. A capture starts at the model's call, inside the forward
    context vLLM's loop set: the context's host-side set-up (the DP ranks' sizes, checked
    against the batch) stays out of the graph."""

    STARTS_AT_MODEL_CALL = True

    def __init__(self, *args, state: GraphState, step_metadata, request_rows, **kwargs):
        super().__init__(*args, **kwargs)
        self.request_rows = request_rows  # the runner's RequestRows
        self._init_acl(state, step_metadata)

    @classmethod
    def replacing(cls, manager: ModelCudaGraphManager, **kwargs) -> "NPUModelGraphManager":
        """This manager in place of the one vLLM's runner built (same mode and descriptors)."""
        return cls(manager.vllm_config, manager.device, manager.cudagraph_mode,
                   manager.decode_query_len, lora_capture_cases=manager.lora_capture_cases,
                   varlen_decode=manager.varlen_decode, ubatch_runner=manager.ubatch_runner,
                   **kwargs)

    def capture(self, model, *args, **kwargs) -> None:
        with self._acl_capture(), self._with_dummy_request():
            super().capture(_StartsCapture(model, self), *args, **kwargs)

    def _with_dummy_request(self):
        """vLLM's capture builds a mixed FULL graph's batch with the graph's request count; on
        Ascend FIA sees one request more at every replay, the dummy (worker/padding.py), so the
        captured batch has it too, empty (FIA's shapes and host lists stay those captured)."""
        if self.cudagraph_mode.mixed_mode() != CUDAGraphMode.FULL:
            return contextlib.nullcontext()
        rows = self.request_rows

        class WithDummyRequest(InputBatch):
            @classmethod
            def make_dummy(cls, num_reqs, num_tokens, input_buffers, *args, **kwargs):
                batch = InputBatch.make_dummy(num_reqs, num_tokens, input_buffers, *args,
                                              **kwargs)
                return rows.padded(batch, num_reqs + 1, scheduled=True)

        return mock.patch.object(cudagraph_utils, "InputBatch", WithDummyRequest)


class NPUDraftGraphManager(AclGraphs, SpeculatorCudaGraphManager):
    """An EAGLE/MTP drafter's FULL graphs: its prefill (the verify step's batch) and its decode
    steps (one token a request). A capture starts when vLLM calls the draft routine: the gathers
    before the drafter's model call belong to the graph."""

    DRAFTER = True

    def __init__(self, *args, state: GraphState, step_metadata, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_acl(state, step_metadata)

    @classmethod
    def replacing(cls, manager: SpeculatorCudaGraphManager, **kwargs) -> "NPUDraftGraphManager":
        return cls(manager.vllm_config, manager.device, manager.cudagraph_mode,
                   manager.decode_query_len, **kwargs)

    def capture(self, *args, **kwargs) -> None:
        with self._acl_capture():
            super().capture(*args, **kwargs)
