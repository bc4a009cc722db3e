"""FULL graphs where they are hardest: mixed prefill/decode steps, a full batch, chunked prefill
and prefix caching, and the stale-length bug the FIA update prevents."""

import pytest
from vllm import SamplingParams

from tests.e2e.conftest import assert_close_to, engine, hf_greedy, model_path, vllm_greedy
from tests.e2e.test_graph_modes import graph_stats

FAMILY = "llama"


def words(n, seed):
    pool = ["amber", "brook", "cedar", "delta", "ember", "fjord", "grove", "haven", "isle"]
    return " ".join(pool[(i * 5 + seed) % len(pool)] for i in range(n))


def equal_hf(llm, prompts, n, label):
    for prompt, out in zip(prompts, vllm_greedy(llm, prompts, n)):
        assert_close_to(hf_greedy(model_path(FAMILY), prompt, n), out, f"{label} {prompt[:30]!r}")


@pytest.fixture(scope="module")
def full_llm():
    # max_num_batched_tokens 32: a long prompt is prefilled in chunks while the short ones
    # decode, so steps mix prefill and decode, and every step fits the 32-token FULL graph.
    with engine(model_path(FAMILY), max_num_seqs=8, max_num_batched_tokens=32,
                enable_prefix_caching=True, compilation_config={
                    "cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}
                ) as llm:
        yield llm


def test_mixed_prefill_and_decode_steps_replay_full_graphs(full_llm):
    before = graph_stats(full_llm)["replayed"].get("FULL", 0)
    prompts = [words(3, 1), words(90, 2), words(5, 3)]
    equal_hf(full_llm, prompts, 12, "FULL mixed")
    assert graph_stats(full_llm)["replayed"]["FULL"] - before >= 12


def test_full_batch_of_different_lengths(full_llm):
    prompts = [words(n, n) for n in (1, 2, 3, 4, 5, 6, 7, 8)]  # num_reqs == max_num_seqs
    equal_hf(full_llm, prompts, 10, "FULL full batch")


def test_chunked_prefill_and_prefix_caching_under_full_and_piecewise():
    with engine(model_path(FAMILY), max_num_seqs=8, max_num_batched_tokens=64,
                enable_prefix_caching=True, compilation_config={
                    "cudagraph_mode": "FULL_AND_PIECEWISE",
                    "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]}) as llm:
        long_prompt = words(300, 4)  # > 2 blocks: chunked, then cached
        equal_hf(llm, [long_prompt, words(4, 5)], 10, "F&P chunked")
        again = llm.generate([long_prompt], SamplingParams(max_tokens=10, temperature=0,
                                                          ignore_eos=True), use_tqdm=False)[0]
        assert again.num_cached_tokens >= 256
        equal_hf(llm, [long_prompt], 10, "F&P prefix-cached")
        stats = graph_stats(llm)["replayed"]
        assert stats.get("FULL", 0) > 0 and stats.get("PIECEWISE", 0) > 0


def test_without_the_fia_update_full_graphs_replay_stale_lengths():
    """The negative test: the very same FULL graphs, minus the per-step FIA update, give wrong
    tokens (each decode attends over the capture's lengths); with it they equal HF above."""
    prompt = words(6, 7)
    with engine(model_path(FAMILY), max_num_seqs=4, additional_config={
            "debug_skip_fia_update": True}, compilation_config={
            "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]}) as llm:
        tokens, _ = vllm_greedy(llm, [prompt], 12)[0]
        assert graph_stats(llm)["replayed"]["FULL"] >= 10
    ref_tokens, _ = hf_greedy(model_path(FAMILY), prompt, 12)
    assert tokens[0] == ref_tokens[0]  # the first token comes from the (eager) prefill
    assert tokens != ref_tokens
