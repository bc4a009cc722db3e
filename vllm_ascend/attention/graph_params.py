"""FIA graph parameters: what each attention layer's captured FIA call needs to be re-issued.

Dense layers capture FIA v1 (attention/backend.py), MLA layers FIA v2 (attention/mla.py); each
call keeps the overload it was captured with and how a step's metadata changes its arguments.

At FULL capture every layer's FIA ``.out`` call runs inside a task group, after a wait on an
ExternalEvent; its handle, event and the tensors it reads are kept per batch descriptor, with one
workspace per descriptor. After each FULL replay is launched, ``update`` re-issues every layer's
FIA with the step's host lists through a task update on the update stream and records the
layer's event there: the replay's attention node waits for exactly that record, so it runs with
this step's lengths instead of the capture's. Before the replay is launched, ``before_replay``
makes the update stream wait for the current one: the updates then cannot rewrite the lists of
a previous replay still running, and the host never waits (async scheduling prepares the next
step while this one runs).
"""

import dataclasses
from typing import Any

import torch

from vllm_ascend.device import torch_npu

# The engine's graph state (compilation/acl_graph.GraphState) by its name in the engine's static
# forward context: attention layers find their engine's FIA calls there (``.fia``, a
# GraphParams), and the runner that owns the state registers it under this name.
GRAPH_STATE = "vllm_ascend.graph_state"


@dataclasses.dataclass
class FIACall:
    """A captured FIA call (v1 for dense attention, v2 for MLA). Its tensors are non-owning
    references (the graph owns them), as upstream keeps them through
    torch_npu._C._weak_ref_tensor."""
    handle: Any  # the task group of the captured .out call
    event: Any  # the ExternalEvent the call waits on
    op: Any  # the .out overload it was captured with
    inputs: tuple  # its positional tensors (v2: query, key, value; v1 takes all by keyword)
    args: dict  # its keyword arguments (tensors, mask, host lists, heads, ...)
    workspace: torch.Tensor
    out: torch.Tensor
    softmax_lse: torch.Tensor
    step_args: Any  # metadata -> the keyword arguments a step changes (host lists, block table)

    def __post_init__(self):
        weak = torch_npu._C._weak_ref_tensor
        self.inputs = tuple(weak(t) for t in self.inputs)
        self.workspace = weak(self.workspace)
        self.out, self.softmax_lse = weak(self.out), weak(self.softmax_lse)
        self.args = {k: weak(v) if isinstance(v, torch.Tensor) else v
                     for k, v in self.args.items()}


class GraphParams:
    """The FIA calls of one engine's FULL graphs, per batch descriptor (GraphState.fia)."""

    def __init__(self):
        self.calls: dict[Any, list[FIACall]] = {}  # batch descriptor -> one per layer, in order
        self.workspaces: dict[Any, torch.Tensor] = {}
        self._capturing_key = None
        self._stream = None

    def begin_capture(self, key) -> None:
        self._capturing_key = key
        self.calls[key] = []

    def end_capture(self) -> None:
        # As upstream: the workspace stays in the graph's pool, referenced weakly, so the pool
        # may give its memory to the next capture (graphs never run at once).
        key, self._capturing_key = self._capturing_key, None
        if key in self.workspaces:
            self.workspaces[key] = torch_npu._C._weak_ref_tensor(self.workspaces[key])

    def workspace(self, make) -> torch.Tensor:
        """The capture size's FIA workspace: made by the first layer, shared by all."""
        key = self._capturing_key
        if key not in self.workspaces:
            self.workspaces[key] = make()
        return self.workspaces[key]

    def capture(self, op, inputs: tuple, args: dict, out: torch.Tensor, make_workspace,
                step_args) -> None:
        """Upstream's FULL-graph protocol for one layer's FIA call (``op``, the ``.out``
        overload): the capture size's workspace (``make_workspace()`` the first time), a wait on
        an ExternalEvent that each update records, the call in a task group whose handle the
        update re-issues; ``step_args(metadata)`` gives what a step changes."""
        workspace = self.workspace(make_workspace)
        softmax_lse = torch.empty(1, dtype=out.dtype, device=out.device)
        stream = torch_npu.npu.current_stream()
        event = torch_npu.npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        torch_npu.npu.graph_task_group_begin(stream)
        op(*inputs, **args, workspace=workspace, out=[out, softmax_lse])
        handle = torch_npu.npu.graph_task_group_end(stream)
        self.calls[self._capturing_key].append(FIACall(
            handle=handle, event=event, op=op, inputs=inputs, args=args, workspace=workspace,
            out=out, softmax_lse=softmax_lse, step_args=step_args))

    @property
    def stream(self):
        """The update stream."""
        if self._stream is None:
            self._stream = torch_npu.npu.Stream()
        return self._stream

    def before_replay(self) -> None:
        """Right before a FULL replay is launched: the update stream's next work (this replay's
        updates) runs after all the current stream holds, the previous replay included, whose
        attention may not have read the host lists the updates rewrite. Ordered on the device,
        so the host does not wait (as upstream's V2 graph manager)."""
        self.stream.wait_stream(torch_npu.npu.current_stream())

    def update(self, key, metadata) -> None:
        """Re-issue each captured FIA of graph ``key`` with ``metadata``'s host lists."""
        stream = self.stream
        with torch_npu.npu.stream(stream):
            for c in self.calls[key]:
                torch_npu.npu.graph_task_update_begin(stream, c.handle)
                # The captured call, with this step's host lists and block table.
                c.op(*c.inputs, **dict(c.args, **c.step_args(metadata)),
                     workspace=c.workspace, out=[c.out, c.softmax_lse])
                torch_npu.npu.graph_task_update_end(stream)
                c.event.record(stream)

    def clear(self) -> None:
        self.calls.clear()
        self.workspaces.clear()
        self._stream = None
