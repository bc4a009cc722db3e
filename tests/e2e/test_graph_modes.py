"""Graph modes through the real engine: each family equals HF transformers (and so eager), for
batches that hit a capture size, fall between sizes (padding) and exceed the largest (no graph);
graphs and replays are counted."""

import pytest

from tests.e2e.conftest import (FAMILIES, OUR_CLASSES, PROMPTS, check_logprobs_close, engine,
                                hf_greedy, loaded_class, max_tokens_for, model_path, vllm_greedy)

CAPTURE_SIZES = [1, 2, 4]
MODES = ["PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]  # NONE: test_eager.py
MAX_NUM_SEQS = 8


def graph_stats(llm) -> dict:
    def probe(worker):
        from vllm_ascend.compilation.acl_graph import STATS

        return STATS.as_dict()

    return llm.collective_rpc(probe)[0]


def num_layers(llm) -> int:
    return llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers


@pytest.fixture(scope="module", params=[(f, m) for m in MODES for f in FAMILIES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def graph_llm(request):
    family, mode = request.param
    with engine(model_path(family), max_num_seqs=MAX_NUM_SEQS, compilation_config={
            "cudagraph_mode": mode, "cudagraph_capture_sizes": CAPTURE_SIZES}) as llm:
        yield family, mode, llm


def check(llm, family, prompts, label):
    n = max_tokens_for(family)
    for prompt, out in zip(prompts, vllm_greedy(llm, prompts, n)):
        check_logprobs_close(hf_greedy(model_path(family), prompt, n), out, f"{label} {prompt!r}")


def test_graphs_captured_per_piece_and_size(graph_llm):
    family, mode, llm = graph_llm
    assert llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name == mode
    assert loaded_class(llm) == OUR_CLASSES[family]
    stats = graph_stats(llm)
    pieces = (num_layers(llm) + 1) * len(CAPTURE_SIZES)  # one graph per piece per size
    full = len(CAPTURE_SIZES)  # one FULL graph per size (all sizes <= max_num_seqs here)
    expected = {"PIECEWISE": {"PIECEWISE": pieces}, "FULL": {"FULL": full},
                "FULL_DECODE_ONLY": {"FULL": full},
                "FULL_AND_PIECEWISE": {"PIECEWISE": pieces, "FULL": full}}[mode]
    assert stats["captured"] == expected
    assert stats["streams_in_use"] == sum(stats["captured"].values())


def test_batch_between_capture_sizes_is_padded_and_equals_hf(graph_llm):
    family, mode, llm = graph_llm
    before = graph_stats(llm)["replayed"]
    check(llm, family, PROMPTS, f"{mode} 3->4")  # 3 decodes padded to the size-4 graph
    after = graph_stats(llm)["replayed"]
    assert sum(after.values()) > sum(before.values()), "decode steps must replay graphs"


@pytest.mark.parametrize("batch", [1, 4])
def test_batch_at_a_capture_size_equals_hf(graph_llm, batch):
    family, mode, llm = graph_llm
    prompts = [f"Question {i}: what comes after {i}?" for i in range(batch)]
    check(llm, family, prompts, f"{mode} {batch}")


def test_batch_larger_than_the_largest_size_runs_without_graphs(graph_llm):
    family, mode, llm = graph_llm
    prompts = [f"Item {i} of the list is" for i in range(6)]
    before = sum(graph_stats(llm)["replayed"].values())
    check(llm, family, prompts, f"{mode} 6")
    replays = sum(graph_stats(llm)["replayed"].values()) - before
    # 6 tokens per step > 4: every one of the 16 steps runs without graphs. (The count may
    # still take in one step of the previous test's batch, read just before this one.)
    assert replays <= num_layers(llm) + 1, f"{replays} replays for a batch above every size"
