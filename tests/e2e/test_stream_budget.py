"""A deliberately small stream budget: start-up captures exactly the sizes the budget function
keeps; when not one size fits, FULL_AND_PIECEWISE falls back to FULL and says so. (A budget the
device does not have is refused at start-up: test_startup_plan.py; capture's 207008 and its
advice: tests/ut/test_sim_graph.py.)"""


import pytest
from vllm.config import CUDAGraphMode

from tests.e2e.conftest import (check_logprobs_close, engine, graph_counts, hf_greedy,
                                model_path, platform_log, replays, vllm_greedy)
from vllm_ascend.compilation.capture_sizes import plan_capture_sizes

SIZES = [1, 2, 4, 8, 16]
STREAMS = 10  # a 2-layer model costs 3 streams per PIECEWISE size: 3 sizes fit


@pytest.fixture
def small_budget(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_SIM_STREAMS", str(STREAMS))  # read by the device at capture


def start(multiprocess=False, **extra):
    return engine(model_path("llama"), max_num_seqs=16, multiprocess=multiprocess,
                  additional_config={"graph_stream_total": STREAMS, "graph_stream_reserve": 0,
                                     **extra},
                  compilation_config={"cudagraph_mode": "PIECEWISE",
                                      "cudagraph_capture_sizes": SIZES})


def test_small_budget_captures_exactly_the_kept_sizes(small_budget):
    plan = plan_capture_sizes(SIZES, CUDAGraphMode.PIECEWISE, 2, stream_total=STREAMS,
                              stream_reserve=0)
    assert plan.kept == [1, 4, 16] and plan.streams_needed == 9
    with start() as llm:
        assert llm.llm_engine.vllm_config.compilation_config.cudagraph_capture_sizes == plan.kept
        counts = graph_counts(llm)
        assert counts["captured"] == {"PIECEWISE": plan.streams_needed}
        assert counts["streams_in_use"] == plan.streams_needed
        prompt = "The capital of France is"
        with replays(llm) as made:
            out = vllm_greedy(llm, [prompt], 8)[0]
        check_logprobs_close(hf_greedy(model_path("llama"), prompt, 8), out)
        # 8 steps (the prefill fits the size-16 graph too), 3 pieces each
        assert made["replayed"] == {"PIECEWISE": 8 * 3}


def test_when_not_one_size_fits_full_and_piecewise_falls_back_to_full():
    """2 streams: a FULL_AND_PIECEWISE size costs 4 (3 pieces + 1 FULL graph), a FULL one 1:
    the mode narrows to FULL, says so, and its two sizes replay."""
    with platform_log() as log, engine(
            model_path("llama"), max_num_seqs=4,
            additional_config={"graph_stream_total": 2, "graph_stream_reserve": 0},
            compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE",
                                "cudagraph_capture_sizes": [1, 2, 4, 8]}) as llm:
        cc = llm.llm_engine.vllm_config.compilation_config
        assert cc.cudagraph_mode == CUDAGraphMode.FULL and cc.cudagraph_capture_sizes == [1, 8]
        assert graph_counts(llm)["captured"] == {"FULL": 2}
        prompt = "The capital of France is"
        with replays(llm) as made:
            out = vllm_greedy(llm, [prompt], 8)[0]
        check_logprobs_close(hf_greedy(model_path("llama"), prompt, 8), out)
        assert made["replayed"] == {"FULL": 8}  # the 6-token prefill too (size 8), 7 decodes
    assert ("vllm-ascend: graph mode FULL (configured FULL_AND_PIECEWISE): as configured "
            "(vLLM's default unless set); not one FULL_AND_PIECEWISE capture size fits the "
            "stream budget (4 streams per size, 2 usable): FULL instead") in log
