"""The runner's padding decision for one step: a pure function of the step and its graph.

vLLM pads a step's tokens up to a captured size and, for a FULL graph, its requests up to the
graph's request count with *empty* requests. That serves CUDA kernels; FIA in TND layout also
checks that the query's token count equals the last cumulative query length, so every padding
token must belong to a request, and a FULL graph re-issues its FIA calls with tensors of the
shapes it was captured with, so the batch FIA sees must be the same at capture and replay:

* uniform decode graphs (every request has the same query length q: 1, or K+1 under
  speculative decoding): the padding requests are whole q-token fake requests, which fill the
  graph exactly (its size is its request count times q);
* mixed graphs (FULL mode): the padding requests take one token each while padding lasts, and
  one dummy request always follows them and takes the rest (beyond one request's block-table
  row, the padding requests take it), so FIA always sees the graph's request count plus one;
* PIECEWISE and eager steps: attention runs eagerly on the real tokens; nothing is padded.

A fake or dummy request attends to its own tokens only (its KV length is its query length, read
through the null block); padding tokens write no KV (slot -1).
"""

import dataclasses

from vllm.config import CUDAGraphMode


@dataclasses.dataclass(frozen=True)
class StepPadding:
    mode: CUDAGraphMode  # the runtime mode of the step
    num_tokens: int  # scheduled tokens
    num_tokens_padded: int  # tokens the forward runs (the graph's size)
    num_reqs: int  # scheduled requests
    padding_query_lens: tuple[int, ...] = ()  # FULL steps: the fake requests, then any dummy

    @property
    def pads_attention(self) -> bool:
        return self.mode == CUDAGraphMode.FULL

    @property
    def num_reqs_padded(self) -> int:
        """Requests FIA sees: the scheduled ones, then the padding ones."""
        return self.num_reqs + len(self.padding_query_lens)


def decide_padding(mode: CUDAGraphMode, num_tokens: int, num_reqs: int, num_tokens_padded: int,
                   graph_num_reqs: int | None, uniform: bool, query_len: int,
                   max_query_len: int) -> StepPadding:
    """The step's padding.

    ``num_tokens_padded`` and ``graph_num_reqs`` come from the graph the step dispatches to (its
    batch descriptor, after any data-parallel padding); ``uniform`` says whether it is a uniform
    decode graph of ``query_len`` tokens per request; ``max_query_len`` is the most one request
    can hold (its block-table row)."""
    if num_tokens_padded < num_tokens:
        raise ValueError(f"{num_tokens} tokens do not fit a graph of {num_tokens_padded}")
    if mode != CUDAGraphMode.FULL:
        return StepPadding(mode, num_tokens, num_tokens_padded, num_reqs)
    graph_num_reqs = num_reqs if graph_num_reqs is None else graph_num_reqs
    if graph_num_reqs < num_reqs:
        raise ValueError(f"{num_reqs} requests do not fit a graph of {graph_num_reqs}")
    left = num_tokens_padded - num_tokens
    fake_len = query_len if uniform else 1
    lens = []
    for _ in range(graph_num_reqs - num_reqs):
        lens.append(min(fake_len, left))
        left -= lens[-1]
    if uniform:
        if left or any(n != query_len for n in lens):
            raise ValueError(
                f"a uniform decode graph of {num_tokens_padded} tokens and {graph_num_reqs} "
                f"requests cannot hold {num_reqs} requests of {num_tokens} tokens in whole "
                f"{query_len}-token requests")
    else:
        lens.append(0)  # the dummy request
        for i in [len(lens) - 1] + list(range(len(lens) - 1)):  # the dummy first
            take = min(max_query_len - lens[i], left)
            lens[i] += take
            left -= take
        if left:
            raise ValueError(
                f"cannot place {num_tokens_padded - num_tokens} padding tokens in "
                f"{len(lens)} requests of at most {max_query_len} tokens: raise max_model_len "
                "or lower the capture sizes")
    return StepPadding(mode, num_tokens, num_tokens_padded, num_reqs, tuple(lens))
