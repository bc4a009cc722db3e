"""Graph modes through the real engine, on the tiny Llama (PIECEWISE and FULL on its W8A8
exports, dynamic and static): it equals HF transformers (and so eager; for an export, the fp32
reference with the same quantization), for batches that hit a capture size, fall between sizes
(padding) and exceed the largest (no graph: the eager path), and for a prefill that fits a
graph; every check also counts the graphs that replayed, so an eager fallback fails it."""

import pytest

from tests.e2e.conftest import (OUR_CLASSES, PROMPTS, QUANTIZED, chip_cost_per_decode_step,
                                check_close_with_replays, check_plan, engine, graph_counts,
                                loaded_class, MAX_TOKENS, model_path, num_layers)
from vllm_ascend.device.sim.ledger import LAUNCHES, PLUGIN_SYNCS, REPLAYS, UPDATES

CAPTURE_SIZES = [1, 2, 4]
MODES = ["PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
MAX_NUM_SEQS = 8
# Llama in PIECEWISE, FULL and FULL_AND_PIECEWISE: what a mode does is family-independent (the
# family's model file runs inside the same graphs), and FULL_DECODE_ONLY's graphs are
# FULL_AND_PIECEWISE's FULL ones (the MoE families run it, in test_moe.py). The Qwen families
# against HF: test_spec_decode.py (Qwen2 and Qwen3, in graph modes) and test_moe.py (Qwen3-MoE
# in float16, the other dtype FIA computes in); DeepSeek: test_mla.py. SmolLM2's real weights in
# graph mode against HF: test_defaults.py (every mode) and test_parallel.py (TP=3).
# A mode does the same to a quantized model's layers (their operators run inside the pieces and
# graphs like any other), so PIECEWISE and FULL run the W8A8 exports of the tiny Llama: every
# check below also holds for W8A8_DYNAMIC and W8A8 layers (test_quantization.py: the other modes).
CASES = [("llama-w8a8-dynamic", "PIECEWISE"), ("llama-w8a8", "FULL"),
         ("llama", "FULL_AND_PIECEWISE")]


def dtype_of(family: str) -> str:
    return QUANTIZED[family][2] if family in QUANTIZED else "bfloat16"


def base_family(family: str) -> str:
    return QUANTIZED[family][0] if family in QUANTIZED else family

SHORT = "Hi there"  # 2 tokens: a prefill within the largest capture size


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def graph_llm(request):
    family, mode = request.param
    with engine(model_path(family), max_num_seqs=MAX_NUM_SEQS,
                dtype=dtype_of(family), compilation_config={
                    "cudagraph_mode": mode, "cudagraph_capture_sizes": CAPTURE_SIZES}) as llm:
        yield family, mode, llm


def check(llm, family, mode, prompts, label) -> dict:
    """Greedy output close to HF's, and exactly the replays the steps call for."""
    return check_close_with_replays(llm, model_path(family), dtype_of(family), mode, prompts,
                                    label, max(CAPTURE_SIZES))


def test_async_scheduling_is_on_the_engine_schedules_a_step_ahead(graph_llm):
    """vLLM's default in graph mode, kept: the engine core steps through its batch queue (the
    next step scheduled while the device runs this one)."""
    _, _, llm = graph_llm
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    core = llm.llm_engine.engine_core.engine_core
    assert core.batch_queue_size == 2 and core.step_fn == core.step_with_batch_queue


def test_graphs_captured_per_piece_and_size_on_our_backend(graph_llm):
    family, mode, llm = graph_llm
    assert llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name == mode
    assert str(llm.llm_engine.vllm_config.model_config.dtype) == \
        f"torch.{dtype_of(family)}"
    assert loaded_class(llm) == OUR_CLASSES[base_family(family)]  # the family file, its fusions

    def probe(worker):
        from vllm_ascend import device

        runner = worker.model_runner
        backends = {g.backend.get_name() for groups in runner.attn_groups for g in groups}
        return device.current.name, type(runner).__name__, sorted(backends)

    assert llm.collective_rpc(probe) == [("sim", "NPUModelRunner", ["ASCEND"])]
    counts = graph_counts(llm)
    pieces = (num_layers(llm) + 1) * len(CAPTURE_SIZES)  # one graph per piece per size
    full = len(CAPTURE_SIZES)  # one FULL graph per size (all sizes <= max_num_seqs here)
    expected = {"PIECEWISE": {"PIECEWISE": pieces}, "FULL": {"FULL": full},
                "FULL_DECODE_ONLY": {"FULL": full},
                "FULL_AND_PIECEWISE": {"PIECEWISE": pieces, "FULL": full}}[mode]
    assert counts["captured"] == expected
    assert counts["streams_in_use"] == sum(counts["captured"].values())
    check_plan(llm.collective_rpc("startup_figures")[0], f"{family} {mode}")


def test_short_prefill_replays_a_graph_where_the_mode_has_one(graph_llm):
    family, mode, llm = graph_llm
    made = check(llm, family, mode, [SHORT], f"{mode} short")
    assert made["steps"][0] == (2, 1), made  # the prefill: 2 tokens, 1 request
    if mode != "FULL_DECODE_ONLY":  # a prefill is not a uniform decode batch
        assert made["replayed"].get("FULL" if mode == "FULL" else "PIECEWISE"), made


def test_batch_between_capture_sizes_is_padded_and_equals_hf(graph_llm):
    family, mode, llm = graph_llm
    made = check(llm, family, mode, PROMPTS, f"{mode} 3->4")  # 3 decodes padded to size 4
    assert (3, 3) in made["steps"] and made["replayed"]


def test_one_request_replays_a_graph_every_decode_step(graph_llm):
    family, mode, llm = graph_llm
    made = check(llm, family, mode, ["Question 0: what comes after 0?"], f"{mode} 1")
    # A deterministic schedule: one prefill (above every size), then one decode per token.
    n = MAX_TOKENS
    assert made["steps"][1:] == [(1, 1)] * (n - 1)
    per_step = {"FULL": 1} if "FULL" in mode else {"PIECEWISE": num_layers(llm) + 1}
    assert made["replayed"] == {m: k * (n - 1) for m, k in per_step.items()}


def test_batch_at_a_capture_size_equals_hf(graph_llm):
    family, mode, llm = graph_llm
    prompts = [f"Question {i}: what comes after {i}?" for i in range(4)]
    made = check(llm, family, mode, prompts, f"{mode} 4")
    assert (4, 4) in made["steps"] and made["replayed"]


def test_batch_larger_than_the_largest_size_runs_without_graphs(graph_llm):
    family, mode, llm = graph_llm
    prompts = [f"Item {i} of the list is" for i in range(6)]
    made = check(llm, family, mode, prompts, f"{mode} 6")
    assert (6, 6) in made["steps"]  # 6 tokens per step > 4: these steps run without graphs


# What a decode step of one request launches outside the model (the simulator's ledger;
# benchmarks/step_profile.py prints it): vLLM's input preparation (with the plugin's slot
# mapping and attention metadata), the LM head and sampling. (vLLM's own waits and copies are
# not asserted: under async scheduling their number depends on how far the host ran ahead of
# the device.)
VLLM_DECODE_LAUNCHES = 37
# The step's RoPE rows, gathered in the model's pre-hook (worker/model_runner.py): launched
# before the pieces in PIECEWISE, captured into the graph in FULL.
STEP_ROPE_LAUNCHES = 5


def test_a_decode_step_costs_the_chip_what_its_mode_promises(graph_llm):
    family, mode, llm = graph_llm
    layers = num_layers(llm)
    if mode == "PIECEWISE":
        # The pieces replay; between them each layer's KV-cache write and FIA are launched.
        expected = {LAUNCHES: VLLM_DECODE_LAUNCHES + STEP_ROPE_LAUNCHES + 2 * layers,
                    REPLAYS: layers + 1, UPDATES: 0, PLUGIN_SYNCS: 0}
    else:
        # One replay and one task update per attention layer, nothing of the model launched on
        # its own (the RoPE gather included); the plugin never waits: the updates are ordered
        # after the previous replay on the device (the simulator refuses an update that is not).
        expected = {LAUNCHES: VLLM_DECODE_LAUNCHES, REPLAYS: 1, UPDATES: layers,
                    PLUGIN_SYNCS: 0}
    cost = chip_cost_per_decode_step(llm)
    assert {row: cost[row] for row in expected} == expected, cost
