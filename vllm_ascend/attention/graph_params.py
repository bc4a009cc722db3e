"""FIA graph parameters: what each attention layer's captured FIA call needs to be re-issued.

At FULL capture every layer's FIA runs inside a task group; its handle and the tensors it reads
are kept per batch descriptor. Before each FULL replay, ``update`` re-issues every layer's FIA
with the step's host lists through a task update, on an update stream, so that the replay's
attention nodes run with this step's lengths instead of the capture's.
"""

import dataclasses
from typing import Any

import torch

from vllm_ascend import device


@dataclasses.dataclass
class FIACall:
    handle: Any
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    atten_mask: torch.Tensor
    out: torch.Tensor
    num_heads: int
    num_kv_heads: int
    scale: float


class GraphParams:
    def __init__(self):
        self.calls: dict[Any, list[FIACall]] = {}  # batch descriptor -> one per layer, in order
        self._capturing_key = None
        self._stream = None

    def begin_capture(self, key) -> None:
        self._capturing_key = key
        self.calls[key] = []

    def end_capture(self) -> None:
        self._capturing_key = None

    @property
    def capturing(self) -> bool:
        return self._capturing_key is not None

    def record(self, call: FIACall) -> None:
        self.calls[self._capturing_key].append(call)

    def update(self, key, metadata) -> None:
        """Re-issue each captured FIA of graph ``key`` with ``metadata``'s host lists."""
        backend = device.current
        if self._stream is None:
            self._stream = backend.new_stream()
        for c in self.calls[key]:
            backend.task_update_begin(self._stream, c.handle)
            try:
                backend.fused_infer_attention_score(
                    c.query, c.key_cache, c.value_cache,
                    actual_seq_lengths=metadata.actual_seq_lengths_q,
                    actual_seq_lengths_kv=metadata.seq_lens_list, block_table=c.block_table,
                    block_size=c.key_cache.shape[1], num_heads=c.num_heads,
                    num_key_value_heads=c.num_kv_heads, scale=c.scale, input_layout="TND",
                    sparse_mode=3, atten_mask=c.atten_mask, out=c.out)
            finally:
                backend.task_update_end(self._stream)

    def clear(self) -> None:
        self.calls.clear()


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
