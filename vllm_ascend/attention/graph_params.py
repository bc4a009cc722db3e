"""FIA graph parameters: what each attention layer's captured FIA call needs to be re-issued.

At FULL capture every layer's FIA ``.out`` call runs inside a task group, after a wait on an
ExternalEvent; its handle, event and the tensors it reads are kept per batch descriptor, with one
workspace per descriptor. After each FULL replay is launched, ``update`` re-issues every layer's
FIA with the step's host lists through a task update on the update stream and records the
layer's event there: the replay's attention node waits for exactly that record, so it runs with
this step's lengths instead of the capture's.
"""

import dataclasses
from typing import Any

import torch

from vllm_ascend.device import torch_npu


@dataclasses.dataclass
class FIACall:
    handle: Any  # the task group of the captured .out call
    event: Any  # the ExternalEvent the call waits on
    query: torch.Tensor
    args: dict  # the captured call's other keyword arguments (caches, mask, lists, heads, ...)
    workspace: torch.Tensor
    out: torch.Tensor
    softmax_lse: torch.Tensor


class GraphParams:
    def __init__(self):
        self.calls: dict[Any, list[FIACall]] = {}  # batch descriptor -> one per layer, in order
        self.workspaces: dict[Any, torch.Tensor] = {}
        self._capturing_key = None
        self._stream = None

    def begin_capture(self, key) -> None:
        self._capturing_key = key
        self.calls[key] = []

    def end_capture(self) -> None:
        self._capturing_key = None

    def workspace(self, make) -> torch.Tensor:
        """The capture size's FIA workspace: made by the first layer, shared by all."""
        key = self._capturing_key
        if key not in self.workspaces:
            self.workspaces[key] = make()
        return self.workspaces[key]

    def record(self, call: FIACall) -> None:
        self.calls[self._capturing_key].append(call)

    def update(self, key, metadata) -> None:
        """Re-issue each captured FIA of graph ``key`` with ``metadata``'s host lists."""
        if self._stream is None:
            self._stream = torch_npu.npu.Stream()
        stream = self._stream
        with torch_npu.npu.stream(stream):
            for c in self.calls[key]:
                torch_npu.npu.graph_task_update_begin(stream, c.handle)
                # The captured call, with this step's host lists and block table.
                args = dict(c.args, block_table=metadata.block_table,
                            actual_seq_lengths=metadata.actual_seq_lengths_q,
                            actual_seq_lengths_kv=metadata.seq_lens_list)
                torch_npu.npu_fused_infer_attention_score.out(
                    query=c.query, **args, workspace=c.workspace, out=[c.out, c.softmax_lse])
                torch_npu.npu.graph_task_update_end(stream)
                c.event.record(stream)

    def clear(self) -> None:
        self.calls.clear()
        self.workspaces.clear()


GRAPH_PARAMS = GraphParams()


def pad_for_graph(q_lens: list[int], kv_lens: list[int], num_real_reqs: int,
                  num_tokens_padded: int, capacity: int, decode_query_len: int = 1):
    """FIA lengths for a batch padded to a captured graph (a pure function).

    ``q_lens``/``kv_lens`` cover the runner's padded requests (those after ``num_real_reqs``
    have no tokens). FIA in TND needs the query's token count to equal the last cumulative
    length, and a FULL graph needs the batch it was captured with. So: the padded requests
    become whole fake decode requests, one more dummy request always follows them (so the batch
    is the same at capture and replay), and any tokens left go to the dummy, then round the
    fake requests, never past the block-table ``capacity``. A fake request attends to its own
    tokens only (its KV length equals its query length); padded tokens write no KV.
    Returns (cumulative query lengths, KV lengths), one entry longer than the inputs.
    """
    q = list(q_lens[:num_real_reqs]) + [0] * (len(q_lens) - num_real_reqs) + [0]
    kv = list(kv_lens[:num_real_reqs]) + [0] * (len(q) - num_real_reqs)
    pad = num_tokens_padded - sum(q_lens[:num_real_reqs])
    if pad < 0:
        raise ValueError(f"{sum(q_lens[:num_real_reqs])} tokens do not fit a graph of "
                         f"{num_tokens_padded}")
    fake = list(range(num_real_reqs, len(q)))
    for i in fake[:-1]:
        take = min(decode_query_len, pad, capacity)
        q[i] += take
        pad -= take
    for i in [fake[-1]] + fake[:-1]:
        take = min(capacity - q[i], pad)
        q[i] += take
        pad -= take
    if pad:
        raise ValueError(f"cannot place {pad} padding tokens: raise max_model_len or lower "
                         "the capture sizes")
    for i in fake:
        kv[i] = q[i]
    cu, total = [], 0
    for n in q:
        total += n
        cu.append(total)
    return cu, kv
