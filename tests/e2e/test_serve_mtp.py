"""DeepSeek-V3 as Ascend deploys it with MTP, served: a tiny DeepSeek-V3 (MLA with a query LoRA,
an MoE layer routed by grouped sigmoid scores) as a ModelSlim W8A8 export (every linear layer
but kv_b_proj, and the routed experts, W8A8_DYNAMIC) whose MTP layer, itself an MoE layer, is
carried FLOAT, at DP=2 x TP=2 with EP=4 in FULL_DECODE_ONLY, drafting 2 tokens a step. Its MTP
layer is fitted to agree with the model (scripts/models.py agreeing_mtp_dir), so most drafts
are accepted and the accepted-token path runs on every rank. The answers are the export's
dequantized HF reference's (TP=1) under the logprob-closeness rule, verify steps replay FULL
graphs, and an engine without requests runs its dummy batches, drafter included, in lockstep
with the busy one (the MTP layer's MoE all-gathers all ranks' tokens too). Every request has a
timeout: a rank hung in a collective fails the test, not the suite. (MTP on one device and in
the other graph modes: test_spec_decode.py; DeepSeek-V2-Lite's W8A8 export served the same way
in FULL_AND_PIECEWISE, without MTP, which V2 does not have: test_serve.py.)"""

import concurrent.futures
import json

import pytest
import requests

from scripts.models import fit_prompts
from tests.e2e.conftest import (check_logprobs_close, hf_greedy, served_completion,
                                served_graph_counts, served_rpc, spec_target,
                                speculative_config, vllm_server)

# The full tier only: a served DP=2 x TP=2 engine (an API server, two engine cores, four
# workers, each with its drafter).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FAMILY = "deepseek_v3_moe_mtp-w8a8-dynamic"
METHOD = "mtp-agreeing"
K = 2  # tokens drafted a step
NAME = "tiny-deepseek-v3-w8a8-mtp"
TOKENS = 16
PROMPTS = fit_prompts("deepseek_v3_moe_mtp")  # those its MTP layer was fitted on


@pytest.fixture(scope="module")
def server():
    with vllm_server(spec_target(FAMILY, METHOD), NAME, "--tensor-parallel-size", "2",
                     "--data-parallel-size", "2", "--enable-expert-parallel",
                     "--max-model-len", "512", "--max-num-seqs", "16", "--api-server-count", "1",
                     "--speculative-config", json.dumps(speculative_config(FAMILY, METHOD, K)),
                     "--compilation-config", json.dumps({"cudagraph_mode": "FULL_DECODE_ONLY"}),
                     start_s=420) as served:
        yield served


def answers_as_hf(base, headers=None, one_request=False):
    """The prompts as concurrent requests, or as one request of three prompts (``one_request``:
    the server adds them to the engine together, so they run as one batch)."""
    if one_request:
        outs = served_completion(base, NAME, PROMPTS, TOKENS, headers)
    else:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            outs = list(pool.map(lambda p: served_completion(base, NAME, p, TOKENS, headers),
                                 PROMPTS))
    for prompt, out in zip(PROMPTS, outs):
        check_logprobs_close(hf_greedy(spec_target(FAMILY, METHOD), prompt, TOKENS), out,
                             repr(prompt), dtype="bfloat16")


def spec_counts(base) -> dict[str, float]:
    """vLLM's drafted and accepted token counters, summed over the DP engines."""
    metrics = requests.get(f"{base}/metrics", timeout=10).text
    counts = {"draft": 0.0, "accepted": 0.0}
    for line in metrics.splitlines():
        for key in counts:
            if line.startswith(f"vllm:spec_decode_num_{key}_tokens_total{{"):
                counts[key] += float(line.rsplit(" ", 1)[1])
    return counts


def test_start_up_log_says_the_graph_mode_and_why_async_scheduling_is_off(server):
    _, log = server
    assert "graph mode FULL_DECODE_ONLY (configured FULL_DECODE_ONLY)" in log
    assert "async scheduling turned off: speculative decoding needs exact host KV lengths" in log


def test_drafts_are_accepted_and_answers_are_hfs_with_full_verify_graphs(server):
    base, _ = server
    before, was = spec_counts(base), served_graph_counts(base)
    answers_as_hf(base)
    after, now = spec_counts(base), served_graph_counts(base)
    drafted, accepted = (after[k] - before[k] for k in ("draft", "accepted"))
    # measured: 30 of 32 (the export's int8 rounding moves the model a little off the float
    # path the MTP layer was fitted on)
    assert drafted > 0 and accepted >= 0.8 * drafted, (drafted, accepted)
    for rank, (w, n) in enumerate(zip(was, now)):  # DP engine 0's two TP ranks
        assert n["replayed"].get("FULL", 0) > w["replayed"].get("FULL", 0), (rank, w, n)


def test_the_idle_rank_runs_the_busy_ranks_verify_steps_and_drafter_in_lockstep(server):
    """The prompts pinned to DP rank 1 while rank 0 has none: every step of rank 0 is a dummy
    batch of one request of K + 1 tokens, run through the FULL graph of rank 1's padded size
    when rank 1 verifies its drafts (measured: 12 for three requests' 9 tokens, then 6 and 3
    as they finish), and its drafter runs its dummy passes with rank 1's: the MTP layer's MoE
    all-gathers every rank's tokens, so a rank that skipped one would leave the other waiting,
    and the requests would time out. The prompts go as one request: three concurrent requests
    may reach a loaded machine's engine one after the other (seen in CI: rank 1 verified one
    request at a time, and rank 0 never saw a padded size above 3)."""
    base, _ = server
    served_rpc(base, "recent_steps", clear=True)
    answers_as_hf(base, headers={"X-data-parallel-rank": "1"}, one_request=True)
    for rank, steps in enumerate(served_rpc(base, "recent_steps")):  # DP engine 0's workers
        assert steps and all((s["num_tokens"], s["num_reqs"]) == (K + 1, 1) for s in steps), \
            steps
        verify = {s["num_tokens_padded"] for s in steps if s["mode"] == "FULL"}
        assert verify and all(size % (K + 1) == 0 for size in verify), (rank, steps)
        assert max(verify) > len(PROMPTS) * (K + 1), (rank, steps)  # all three, padded
