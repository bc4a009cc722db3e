"""vLLM's Model Runner V2 on the plugin (``VLLM_USE_V2_MODEL_RUNNER=1``): NPUModelRunnerV2 with
vLLM's V2 input preparation and sampling (its Triton kernels run as the simulator's torch
implementations, device/sim/v2_kernels.py), PIECEWISE graphs on the compile backend's wrappers
and FULL graphs through the ACL graph manager (worker/v2/graphs.py), whose replays re-issue FIA's
host lists; the runner pads a FULL step with fake requests (and a mixed FULL graph's batch with
its dummy request, at capture too) as V1 does.

The tiny Llama and Qwen3-MoE (float16: routing ties, docs/moe.md) in PIECEWISE, FULL,
FULL_DECODE_ONLY and FULL_AND_PIECEWISE, and DeepSeek-V2-MoE (MLA) in FULL_DECODE_ONLY: close to
HF transformers,
for batches between capture sizes (padding), one request decoding, and batches above the
largest size (no graph); the graphs replayed are exactly those the steps call for; graph output
equals V2's eager output to the bit. The
chip-cost ledger of a V2 decode step; what V2 does not run yet refused at start-up, and V1
unchanged as the default; a request needing a kernel the simulator lacks refused while the engine
serves on. TP=2, DP=2 and the sampling parameters against V1's: test_model_runner_v2_parallel.py.
"""

import contextlib
import os

import pytest

from tests.e2e.conftest import (check_close_with_replays, check_plan,
                                chip_cost_per_decode_step, engine, graph_counts, MAX_TOKENS,
                                model_path, num_layers, platform_log, speculative_config,
                                vllm_greedy)
from vllm_ascend.device.sim.ledger import LAUNCHES, PLUGIN_SYNCS, REPLAYS, UPDATES

V2 = "VLLM_USE_V2_MODEL_RUNNER"
CAPTURE_SIZES = [1, 2, 4]
MAX_NUM_SEQS = 8
DTYPES = {"llama": "bfloat16", "qwen3_moe": "float16", "deepseek_v2_moe": "float16"}
PROMPTS = ["The capital of France is", "Write a short poem about the sea:", "1, 2, 3, 4,"]
LONG = [f"Item {i} of the list is" for i in range(6)]  # 6 decodes a step: above every size
QUICK = {("llama", "FULL_AND_PIECEWISE"), ("qwen3_moe", "FULL_DECODE_ONLY")}
CASES = [pytest.param((f, m), marks=() if (f, m) in QUICK else pytest.mark.slow)
         for f in ("llama", "qwen3_moe")
         for m in ("PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")] + [
    pytest.param(("deepseek_v2_moe", "FULL_DECODE_ONLY"), marks=pytest.mark.slow)]  # MLA


@contextlib.contextmanager
def runner_v2(enabled: bool = True):
    """VLLM_USE_V2_MODEL_RUNNER for the engines made inside (the plugin's load names V1)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(V2, "1" if enabled else "0")
        yield


@contextlib.contextmanager
def v2_engine(family: str, mode: str, **kwargs):
    compilation = {"cudagraph_mode": mode, "cudagraph_capture_sizes": CAPTURE_SIZES}
    with runner_v2(), engine(model_path(family), dtype=DTYPES[family], max_num_seqs=MAX_NUM_SEQS,
                             enforce_eager=mode == "NONE", compilation_config=compilation,
                             **kwargs) as llm:
        yield llm


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def v2_llm(request):
    family, mode = request.param
    # The eager reference first: an in-process engine's shutdown takes vLLM's parallel groups
    # with it, which an engine still serving in this process needs.
    eager_output(family)
    with v2_engine(family, mode) as llm:
        yield family, mode, llm


EAGER: dict = {}  # family -> V2's eager output of PROMPTS + LONG (logprobs included)


def eager_output(family: str):
    if family not in EAGER:
        with v2_engine(family, "NONE") as llm:
            EAGER[family] = vllm_greedy(llm, PROMPTS + LONG, MAX_TOKENS)
    return EAGER[family]


def check(llm, family, mode, prompts, label) -> dict:
    """Greedy output close to HF's, and exactly the replays the steps call for."""
    return check_close_with_replays(llm, model_path(family), DTYPES[family], mode, prompts,
                                    f"V2 {label}", max(CAPTURE_SIZES))


def test_the_runner_is_v2_on_the_ascend_backend_with_the_graphs_its_mode_captures(v2_llm):
    family, mode, llm = v2_llm
    assert llm.llm_engine.vllm_config.use_v2_model_runner

    def probe(worker):
        from vllm_ascend import device

        runner = worker.model_runner
        backends = {g.backend.get_name() for groups in runner.attn_groups for g in groups}
        return (device.current.name, type(runner).__name__,
                type(runner.cudagraph_manager).__name__, sorted(backends))

    backend = "ASCEND_MLA" if family.startswith("deepseek") else "ASCEND"
    assert llm.collective_rpc(probe) == [
        ("sim", "NPUModelRunnerV2", "NPUModelGraphManager", [backend])]
    counts = graph_counts(llm)
    pieces = (num_layers(llm) + 1) * len(CAPTURE_SIZES)  # one graph per piece per size
    full = len(CAPTURE_SIZES)  # one FULL graph per size: of uniform decodes, or mixed in FULL
    expected = {"PIECEWISE": {"PIECEWISE": pieces}, "FULL": {"FULL": full},
                "FULL_DECODE_ONLY": {"FULL": full},
                "FULL_AND_PIECEWISE": {"PIECEWISE": pieces, "FULL": full}}[mode]
    assert counts["captured"] == expected  # the memory profile's sample captures dropped
    assert counts["streams_in_use"] == sum(expected.values())
    check_plan(llm.collective_rpc("startup_figures")[0], f"V2 {family} {mode}")


def test_batch_between_capture_sizes_is_padded_and_close_to_hf(v2_llm):
    family, mode, llm = v2_llm
    made = check(llm, family, mode, PROMPTS, f"{family} {mode} 3->4")
    assert (3, 3) in made["steps"] and made["replayed"], made


def test_one_request_replays_a_graph_every_decode_step(v2_llm):
    family, mode, llm = v2_llm
    made = check(llm, family, mode, ["Question 0: what comes after 0?"], f"{family} {mode} 1")
    assert made["steps"][1:] == [(1, 1)] * (MAX_TOKENS - 1)
    per_step = {"FULL": 1} if "FULL" in mode else {"PIECEWISE": num_layers(llm) + 1}
    assert made["replayed"] == {m: k * (MAX_TOKENS - 1) for m, k in per_step.items()}


def test_batch_above_the_largest_size_runs_without_graphs(v2_llm):
    family, mode, llm = v2_llm
    made = check(llm, family, mode, LONG, f"{family} {mode} 6")
    assert (6, 6) in made["steps"], made


def test_graphs_give_v2s_eager_output_to_the_bit(v2_llm):
    family, mode, llm = v2_llm
    assert vllm_greedy(llm, PROMPTS + LONG, MAX_TOKENS) == eager_output(family)


def test_a_request_needing_a_kernel_the_device_lacks_is_refused_and_the_engine_serves_on(v2_llm):
    from vllm import SamplingParams

    family, _, llm = v2_llm
    with pytest.raises(ValueError, match=f"logprob_token_ids is not supported by vllm-ascend's "
                                         f"Model Runner V2 on this device yet.*{V2}=0"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, logprobs=2,
                                                 logprob_token_ids=[5, 6]), use_tqdm=False)
    made = check(llm, family, v2_llm[1], PROMPTS[:1], f"{family} after a refusal")
    assert made["steps"], made


@pytest.mark.slow
def test_full_mode_replays_every_step_and_gives_a_full_batch_its_dummy_request():
    """FULL under V2 with graphs as large as the batch: every step, the prefill included,
    replays a mixed FULL graph, and a batch of max_num_seqs requests gets FIA's dummy request in
    the row the runner keeps beyond vLLM's buffers (RequestRows)."""
    prompts = [" ".join(["amber"] * n) for n in (1, 2, 3, 4)]  # 4 requests: max_num_seqs
    compilation = {"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 2, 4, 8, 16]}
    with runner_v2(), engine(model_path("llama"), dtype=DTYPES["llama"], max_num_seqs=4,
                             compilation_config=compilation) as llm:
        made = check_close_with_replays(llm, model_path("llama"), DTYPES["llama"], "FULL",
                                        prompts, "V2 FULL, a full batch", 16)
    assert (4, 4) in made["steps"], made  # decodes of a full batch
    assert any(tokens > reqs for tokens, reqs in made["steps"]), made  # the prefill
    assert made["replayed"] == {"FULL": len(made["steps"])}, made


# What V2 launches in a decode step of one request outside the model (the simulator's ledger;
# each of V2's Triton kernels counts as one launch, as on a chip): its input preparation, the
# LM head and sampling. V1 launches 37 (test_graph_modes.py).
V2_DECODE_LAUNCHES = 24
# The step's RoPE rows, gathered in the model's pre-hook (worker/model_runner.py): launched before
# the pieces in PIECEWISE, captured into the graph in FULL (the model's pre-hook runs inside it).
STEP_ROPE_LAUNCHES = 4


@pytest.mark.parametrize("mode", ["PIECEWISE", pytest.param("FULL_AND_PIECEWISE",
                                                            marks=pytest.mark.slow)])
def test_a_v2_decode_step_costs_the_chip_what_its_mode_promises(mode):
    with v2_engine("llama", mode) as llm:
        layers = num_layers(llm)
        cost = chip_cost_per_decode_step(llm)
    if mode == "PIECEWISE":
        # The pieces replay; between them each layer's KV-cache write and FIA are launched.
        expected = {LAUNCHES: V2_DECODE_LAUNCHES + STEP_ROPE_LAUNCHES + 2 * layers,
                    REPLAYS: layers + 1, UPDATES: 0, PLUGIN_SYNCS: 0}
    else:
        # One replay and a task update per attention layer, ordered on the device as in V1: the
        # plugin never waits.
        expected = {LAUNCHES: V2_DECODE_LAUNCHES, REPLAYS: 1, UPDATES: layers, PLUGIN_SYNCS: 0}
    assert {row: cost[row] for row in expected} == expected, cost


def create_config(family="llama", **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model_path(family), max_model_len=512, **kwargs
                      ).create_engine_config()


@pytest.mark.parametrize("what,kwargs", [
    ("speculative decoding by ngram (it runs EAGLE and EAGLE-3 heads)",
     dict(speculative_config=speculative_config("llama", "ngram", 2))),
    ("speculative decoding in cudagraph_mode FULL", dict(
        speculative_config=speculative_config("llama", "eagle", 2),
        compilation_config={"cudagraph_mode": "FULL"})),
    ("speculative decoding with block verification", dict(speculative_config={
        **speculative_config("llama", "eagle", 2), "rejection_sample_method": "block"})),
    ("speculative decoding with draft_sample_method 'probabilistic' in a mode with FULL graphs "
     "on this device", dict(speculative_config={**speculative_config("llama", "eagle", 2),
                                                "draft_sample_method": "probabilistic"})),
    ("speculative decoding with data parallelism", dict(
        speculative_config=speculative_config("llama", "eagle", 2), data_parallel_size=2)),
    ("LoRA", dict(enable_lora=True)),
    ("pipeline parallelism", dict(pipeline_parallel_size=2)),
    ("sleep mode", dict(enable_sleep_mode=True)),
    ("prompt embeddings (enable_prompt_embeds)", dict(enable_prompt_embeds=True)),  # (a kernel
    # the simulator does not supply)
])
def test_what_v2_does_not_run_yet_is_refused_at_start_up_naming_the_switch(what, kwargs):
    with runner_v2(), pytest.raises(ValueError) as refused:
        create_config(**kwargs)
    message = str(refused.value)
    assert f"does not support {what}" in message, message
    assert f"Unset {V2} (or set it to 0)" in message, message


def test_v2_runs_with_nothing_else_set_and_v1_stays_the_default(monkeypatch):
    with runner_v2(), platform_log() as lines:
        config = create_config()
        assert config.use_v2_model_runner  # (a property of the environment)
    assert config.compilation_config.cudagraph_mode.name == "FULL_AND_PIECEWISE"
    assert f"vllm-ascend: model runner V2 (NPUModelRunnerV2; {V2}=1)" in lines, lines
    import vllm_ascend

    monkeypatch.delenv(V2, raising=False)  # (this module's engines set it while they live)
    vllm_ascend.register()  # the platform plugin's load, as in every vLLM process
    assert os.environ.get(V2) == "0"  # it names V1 unless the user chose
    assert not create_config().use_v2_model_runner
