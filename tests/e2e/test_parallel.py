"""Tensor and pipeline parallelism in graph mode, through vLLM's multiprocessing executor with
gloo: greedy output equals HF transformers' (TP=1) greedy output, every rank replays the graphs
its steps call for (the collectives inside them included), and each graph holds the streams its
communication groups cost. Data parallelism: test_serve.py.

Two engines (each spawns two workers, ~20 s) cover every kind of graph: TP=2 in FULL replays
FULL graphs for decode, prefill and mixed batches, with an all-reduce per layer inside them, on
a mixture-of-experts model with expert parallelism (each rank computes its half of the experts,
the all-reduce sums them) exported in W8A8; PP=2 in FULL_AND_PIECEWISE replays FULL decode
graphs and, for a prefill that fits the largest size, PIECEWISE pieces, on both stages (the tiny
Llama). Prefills above the largest size run eagerly (NONE) in both. FULL_DECODE_ONLY captures
the same FULL decode graphs, PIECEWISE the same pieces; `scripts/check_parallel.py` runs all
four modes at TP=2 or more by hand, with or without expert parallelism."""

import re

import pytest

from tests.e2e.conftest import (PROMPTS, QUANTIZED, check_logprobs_close, engine,
                                expected_replays,
                                graph_counts_per_rank, hf_greedy, MAX_TOKENS, model_path,
                                platform_log, replays, vllm_greedy)

# TP=2 on a mixture-of-experts model with expert parallelism: attention and the shared expert
# split over the ranks, the routed experts shared out (4 of 8 each), one all-reduce for both.
# In float16 (docs/moe.md#tests-and-figures): in bfloat16 a rounding swaps two of the tiny
# model's experts whose router scores tie (a gap of 0.003 at one token of these prompts), and the
# output then differs from HF's for a reason that is not a bug.
# The model is a W8A8 export (static in layer 0, dynamic in layer 1, experts FLOAT): the int8
# weights, their per-channel scales and W8A8's int32 quant_bias split by column and by row (the
# row-split layers add quant_bias on rank 0 only), against the fp32 reference with the same
# quantization.
LAYOUTS = {"TP=2 EP": ("qwen2_moe-w8a8-mixed", {"tensor_parallel_size": 2, "dtype": "float16",
                                                "enable_expert_parallel": True}),
           "PP=2": ("llama", {"pipeline_parallel_size": 2})}
CASES = [("TP=2 EP", "FULL"), ("PP=2", "FULL_AND_PIECEWISE")]
CAPTURE_SIZES = [1, 2, 4]
SHORT = "Hi there"  # 2 tokens: a prefill within the largest capture size


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def parallel_llm(request):
    layout, mode = request.param
    family, args = LAYOUTS[layout]
    with engine(model_path(family), distributed_executor_backend="mp", max_num_seqs=4,
                compilation_config={"cudagraph_mode": mode,
                                    "cudagraph_capture_sizes": CAPTURE_SIZES}, **args) as llm:
        yield layout, mode, llm


def rank_layers(llm) -> list[int]:
    """The decoder layers each rank holds (all of them under TP, its stage's under PP)."""
    def probe(worker):
        runner = worker.model_runner
        return runner.model_config.get_num_layers(runner.parallel_config)

    return llm.collective_rpc(probe)


def test_greedy_output_equals_tp1_with_graph_replays_on_every_rank(parallel_llm):
    layout, mode, llm = parallel_llm
    n, family = MAX_TOKENS, LAYOUTS[layout][0]
    with replays(llm) as made:
        outs = vllm_greedy(llm, PROMPTS, n) + vllm_greedy(llm, [SHORT], n)
    dtype = LAYOUTS[layout][1].get("dtype", "bfloat16")
    for prompt, out in zip(PROMPTS + [SHORT], outs):
        check_logprobs_close(hf_greedy(model_path(family), prompt, n), out,
                             f"{layout} {mode} {prompt!r}", dtype=dtype,
                             quantized=family in QUANTIZED)
    assert len(made["ranks"]) == 2
    for rank, (made_here, layers) in enumerate(zip(made["ranks"], rank_layers(llm))):
        assert len(made_here["steps"]) >= 2 * n, (rank, made_here)  # a step per token, at least
        expected = expected_replays(mode, made_here["steps"], layers, max(CAPTURE_SIZES))
        assert made_here["replayed"] == expected, (rank, made_here)
        # FULL graphs everywhere; PIECEWISE pieces for the short prefill in FULL_AND_PIECEWISE
        assert set(expected) == ({"FULL", "PIECEWISE"} if "PIECEWISE" in mode else {"FULL"}), \
            (rank, made_here)
        assert any(tokens > max(CAPTURE_SIZES) for tokens, _ in made_here["steps"])  # eager
        if mode == "FULL":  # the short prompt's prefill: a FULL graph of a mixed batch
            assert (2, 1) in made_here["steps"], (rank, made_here)


def test_expert_parallel_ranks_hold_one_half_of_the_experts_each(parallel_llm):
    layout, mode, llm = parallel_llm
    if layout != "TP=2 EP":
        pytest.skip("no expert parallelism in this layout")
    ranges = llm.collective_rpc(lambda worker: sorted({
        m.ascend_expert_range for m in worker.model_runner.get_model().modules()
        if hasattr(m, "ascend_expert_range")}))
    assert ranges == [[(0, 4)], [(4, 8)]], ranges  # 8 experts, every layer alike


def test_each_graph_holds_a_stream_per_communication_group_it_captured(parallel_llm):
    layout, mode, llm = parallel_llm
    # TP: the graph's own stream and its TP group's (an all-reduce per layer is captured; the
    # experts' partial sums ride on it too: expert parallelism over TP adds no collective).
    # PP: the graph's own only (a stage sends and receives between steps, outside graphs).
    per_graph = 2 if layout.startswith("TP") else 1
    for rank, counts in enumerate(graph_counts_per_rank(llm)):
        graphs = sum(counts["captured"].values())
        assert graphs > 0 and counts["streams_in_use"] == per_graph * graphs, (rank, counts)


def test_speculative_decoding_with_pipeline_parallelism_is_refused_at_start_up():
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=(
            r"Speculative decoding \(ngram\) does not run with pipeline_parallel_size=2 in vLLM "
            r"0.32: the drafter exists on the last pipeline stage only, and the other stages "
            r"fail in their first step. Split the model with tensor_parallel_size instead")):
        EngineArgs(model_path("llama"), max_model_len=256, pipeline_parallel_size=2,
                   distributed_executor_backend="mp", speculative_config={
                       "method": "ngram", "num_speculative_tokens": 3,
                       "prompt_lookup_min": 2, "prompt_lookup_max": 4}).create_engine_config()


@pytest.mark.parametrize("mode,streams", [("PIECEWISE", 3), ("FULL", 1), ("FULL_DECODE_ONLY", 1),
                                          ("FULL_AND_PIECEWISE", 4)])
def test_data_parallel_engines_of_a_dense_model_keep_every_graph_mode(mode, streams):
    """vLLM runs a dense model's DP ranks as independent engines (test_serve.py serves DP=2 in
    the default mode): each keeps the requested mode and sizes, and its graphs are charged no
    stream for a DP group, as at DP=1 (2 layers: 3 pieces and/or 1 FULL graph per size)."""
    from vllm.engine.arg_utils import EngineArgs

    with platform_log() as log:
        config = EngineArgs(model_path("llama"), max_model_len=256, data_parallel_size=2,
                            compilation_config={"cudagraph_mode": mode,
                                                "cudagraph_capture_sizes": CAPTURE_SIZES}
                            ).create_engine_config()
    assert config.compilation_config.cudagraph_mode.name == mode
    assert config.compilation_config.cudagraph_capture_sizes == CAPTURE_SIZES
    plan = re.search(r"capture sizes \[1, 2, 4\] kept, none dropped \(all sizes fit; (\d+) "
                     r"streams per size", "\n".join(log))
    assert plan and int(plan.group(1)) == streams, log
