"""`vllm serve` with data parallelism over tensor parallelism (DP=2 x TP=2, four workers) in
FULL_AND_PIECEWISE: 16 concurrent requests answer as HF transformers (TP=1) does, every worker
captured its graphs with a stream for its TP group, and an uneven load (every request pinned to
one DP rank while the other idles) finishes, after which the idle rank still answers."""

import concurrent.futures
import re

import pytest
import requests

from tests.e2e.conftest import (check_logprobs_close, hf_greedy, model_path, served_completion,
                                vllm_server)

NAME = "tiny-llama"
TOKENS = 16


@pytest.fixture(scope="module")
def server():
    with vllm_server(model_path("llama"), NAME, "--tensor-parallel-size", "2",
                     "--data-parallel-size", "2", "--max-model-len", "512",
                     "--max-num-seqs", "16", "--compilation-config",
                     '{"cudagraph_mode": "FULL_AND_PIECEWISE"}', start_s=420) as served:
        yield served


def answers_as_hf(base, prompts, headers=None):
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: served_completion(base, NAME, p, TOKENS, headers), prompts))
    for prompt, out in zip(prompts, outs):
        check_logprobs_close(hf_greedy(model_path("llama"), prompt, TOKENS), out, repr(prompt))


def finished_per_engine(base) -> dict[str, float]:
    """Requests each DP engine finished so far (vLLM's Prometheus counter, by engine label)."""
    counts: dict[str, float] = {}
    for line in requests.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = re.search(r'engine="(\d+)"', line).group(1)
            counts[engine] = counts.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def test_every_worker_captured_with_a_stream_for_its_tp_group(server):
    _, log = server
    summaries = re.findall(r"graph mode FULL_AND_PIECEWISE on TP rank (\d) of 2: captured (\d+) "
                           r"graphs .* streams used (\d+) of", log)
    assert len(summaries) == 4, log[-4000:]  # 2 DP engines x 2 TP ranks
    assert sorted(rank for rank, _, _ in summaries) == ["0", "0", "1", "1"]
    for _, graphs, streams in summaries:
        assert int(graphs) > 0 and int(streams) == 2 * int(graphs)


def test_16_concurrent_requests_answer_as_tp1_on_both_engines(server):
    base, _ = server
    before = finished_per_engine(base)
    answers_as_hf(base, [f"Request {i} of sixteen: the answer is" for i in range(16)])
    after = finished_per_engine(base)
    served = {e: after[e] - before.get(e, 0.0) for e in after}
    assert sum(served.values()) == 16 and set(served) == {"0", "1"} and all(served.values()), \
        served


def test_a_load_pinned_to_one_rank_finishes_and_the_idle_rank_still_answers(server):
    base, _ = server
    before = finished_per_engine(base)
    answers_as_hf(base, [f"Pinned {i}: one, two," for i in range(8)],
                  headers={"X-data-parallel-rank": "0"})
    middle = finished_per_engine(base)
    assert middle["0"] - before["0"] == 8 and middle["1"] == before["1"], (before, middle)
    answers_as_hf(base, ["After idling, rank one says"], headers={"X-data-parallel-rank": "1"})
    assert finished_per_engine(base)["1"] == middle["1"] + 1
