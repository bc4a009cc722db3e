"""Tensor parallelism in graph mode, through vLLM's multiprocessing executor with gloo: the
collectives inside captured graphs are replayed, each rank's graphs hold a stream for the
tensor-parallel group, and greedy output equals HF transformers' (TP=1) greedy output."""

import pytest

from tests.e2e.conftest import (PROMPTS, check_logprobs_close, engine, expected_replays,
                                hf_greedy, max_tokens_for, model_path, replays, vllm_greedy)

MODE = "FULL_AND_PIECEWISE"  # FULL graphs for decode steps, PIECEWISE for the rest


@pytest.fixture(scope="module")
def tp2_llm():
    with engine(model_path("llama"), tensor_parallel_size=2, distributed_executor_backend="mp",
                max_num_seqs=4, compilation_config={"cudagraph_mode": MODE}) as llm:
        yield llm


def test_tp2_greedy_output_equals_tp1_with_graph_replays_on_every_rank(tp2_llm):
    n = max_tokens_for("llama")
    with replays(tp2_llm) as made:
        outs = vllm_greedy(tp2_llm, PROMPTS, n)
    for prompt, out in zip(PROMPTS, outs):
        check_logprobs_close(hf_greedy(model_path("llama"), prompt, n), out, f"TP=2 {prompt!r}")
    config = tp2_llm.llm_engine.vllm_config
    layers = config.model_config.hf_config.num_hidden_layers
    max_size = config.compilation_config.max_cudagraph_capture_size
    assert len(made["ranks"]) == 2
    for rank, made_here in enumerate(made["ranks"]):
        expected = expected_replays(MODE, made_here["steps"], layers, max_size)
        assert made_here["replayed"] == expected and expected.get("FULL"), (rank, made_here)


def test_each_graph_holds_a_stream_for_the_tensor_parallel_group(tp2_llm):
    def probe(worker):
        from vllm_ascend import device

        return (sum(worker.model_runner.graph_state.captured.values()),
                device.current.streams_in_use())

    for graphs, streams in tp2_llm.collective_rpc(probe):
        assert graphs > 0 and streams == 2 * graphs  # the graph's own, and its TP group's
