"""Model families against HF transformers' fp32 by value in NONE, FULL_DECODE_ONLY and
FULL_AND_PIECEWISE, with the graphs replayed that the steps call for; a graph mode gives the
eager result exactly (the same kernels).

Mistral has a sliding window of 6 keys (FIA's band, sparse_mode 4: attention/backend.py
fia_mask_args), which every prompt reaches past in its prefill or its decode; the long prompt
with 16-token blocks makes vLLM give back the blocks that fall out of the window, so the later
steps read a block table with the null block in it. Gemma-3's text model and EXAONE-4
alternate a sliding layer with a full one (per-layer windows, two KV cache groups); Gemma-3 adds
q/k norms, a query pre-attention scalar, (1 + w) RMSNorms and GELU-tanh. Phi-3 (fused qkv and
gate/up), Granite (multipliers), ERNIE-4.5 and GLM-4 (a partial rotary dim of 16) run on the
causal path, and OLMo-2 and Seed-OSS through vLLM's Transformers backend (in a process of their
own: see FAMILIES). Most run through vLLM's own model classes, with no model file of ours;
Qwen2 and Qwen3 through their files (vllm_ascend/models/), the same matrix.

GPT-OSS's attention sinks run on FIA v2 (learnable_sink), on a sliding layer and a full one,
with YaRN RoPE and biased experts behind the clamped SwiGLU. DeepSeek-V3 (MLA) and GLM-4.5's MoE
(GQA) route by sigmoid scores with a correction bias, DeepSeek-V3 over expert groups.

Families whose attention has no Ascend kernel here are refused while the engine starts (the
model's layers are built before any weight loads), naming what is missing: Gemma-2's logit
soft-capping, and GPT-OSS in float16 (the sinks' kernel takes bfloat16)."""

import contextlib
import functools
import json
import pathlib
import subprocess
import sys
import tempfile

import pytest

from scripts.models import config_only_dir
from tests.e2e.cells import note_engine
from tests.e2e.conftest import (PROMPTS, call_log, check_identical, check_logprobs_close,
                                check_replays, engine, expected_replays, hf_greedy, loaded_class,
                                MAX_TOKENS, model_path, replays, vllm_greedy, vllms_own_class)

ROOT = pathlib.Path(__file__).resolve().parents[2]
LONG = ("Once upon a time, in a land far away, there lived a king who had three daughters and "
        "a very large castle by the sea")
FAMILIES = {
    # float16: the tighter of FIA's two dtypes in the comparison (conftest.LOGPROB_TOLERANCE);
    # a window one key wider moves a logprob by 0.59 (measured), four times it.
    "mistral": dict(dtype="float16", block_size=16, prompts=PROMPTS + [LONG],
                    model_class="MistralForCausalLM"),
    # A sliding layer and a full one (two KV cache groups); vLLM refuses Gemma-3 in float16.
    "gemma3": dict(dtype="bfloat16", block_size=16, prompts=PROMPTS + [LONG],
                   model_class="Gemma3ForCausalLM"),
    "exaone4": dict(dtype="float16", block_size=16, prompts=PROMPTS + [LONG],
                    model_class="Exaone4ForCausalLM"),
    # Attention sinks (FIA v2's learnable_sink, bfloat16 only) on a sliding layer and a full one,
    # YaRN RoPE, experts with biases and the clamped SwiGLU.
    "gpt_oss": dict(dtype="bfloat16", block_size=16, prompts=PROMPTS + [LONG],
                    model_class="GptOssForCausalLM"),
    # DeepSeek-V3's noaux_tc router (npu_moe_gating_top_k: sigmoid scores, a correction bias,
    # the best 2 of 4 expert groups) behind MLA; GLM-4.5's (one group) behind GQA attention with
    # a partial rotary and q/k norms. Both with a shared expert and a dense first layer.
    "deepseek_v3": dict(dtype="bfloat16", block_size=128, prompts=PROMPTS,
                        model_class="AscendDeepseekV3ForCausalLM"),
    "glm4_moe": dict(dtype="bfloat16", block_size=128, prompts=PROMPTS,
                     model_class="Glm4MoeForCausalLM"),
    # Qwen3-Next: a Gated DeltaNet layer (ops/gdn.py; its states in the KV cache's lanes,
    # attention/hybrid.py, whose attention blocks hold 256 tokens), then a gated full-attention
    # layer; MoE with a shared expert. bfloat16: torch_npu's delta-rule operators take no other.
    "qwen3_next": dict(dtype="bfloat16", block_size=128, prompts=PROMPTS + [LONG],
                       model_class="Qwen3NextForCausalLM"),
    "phi3": dict(dtype="float16", block_size=128, prompts=PROMPTS, model_class="Phi3ForCausalLM"),
    "granite": dict(dtype="float16", block_size=128, prompts=PROMPTS,
                    model_class="GraniteForCausalLM"),
    "ernie4_5": dict(dtype="float16", block_size=128, prompts=PROMPTS,
                     model_class="Ernie4_5ForCausalLM"),
    # A rotary dim of 16 (partial 0.5 of 32), which npu_mrope does not take: the unfused RoPE
    # (ops/rotary_embedding.py). vLLM refuses GLM-4 in float16.
    "glm4": dict(dtype="bfloat16", block_size=128, prompts=PROMPTS, model_class="Glm4ForCausalLM"),
    # Families with a file of ours (hand-encoded fusions; Llama's modes: test_graph_modes.py).
    "qwen2": dict(dtype="float16", block_size=128, prompts=PROMPTS,
                  model_class="AscendQwen2ForCausalLM"),
    "qwen3": dict(dtype="float16", block_size=128, prompts=PROMPTS,
                  model_class="AscendQwen3ForCausalLM", call_log=True),
    # Qwen3 through vLLM's own class, as a family with no file: the Ascend FX passes and CustomOps
    # must make its twin's fused calls (test_a_family_with_no_file_makes_its_twins_calls).
    "qwen3_no_file": dict(dtype="float16", block_size=128, prompts=PROMPTS, checkpoint="qwen3",
                          model_class="Qwen3ForCausalLM", call_log=True,
                          own_class="Qwen3ForCausalLM"),
    # vLLM 0.32 has no class of its own for OLMo-2 (full-width q/k norms) and Seed-OSS: it serves
    # them through its Transformers backend, HF's modelling code on vLLM's attention. Building
    # such a model changes HF's classes of its family in that process, and HF's reference must
    # run without those changes: their engines run in a process of their own (own_process).
    "olmo2": dict(dtype="float16", block_size=128, prompts=PROMPTS,
                  model_class="TransformersForCausalLM", own_process=True),
    "seed_oss": dict(dtype="float16", block_size=128, prompts=PROMPTS,
                     model_class="TransformersForCausalLM", own_process=True),
    # Qwen3.5 (text only), dense and MoE: Qwen3-Next's layers on its own checkpoints' split
    # projections, with M-RoPE (a text request's three position streams equal). It starts
    # without torchvision (vllm_ascend/patch/qwen2_vl_image_processor.py).
    "qwen3_5": dict(dtype="bfloat16", block_size=128, prompts=PROMPTS + [LONG],
                    model_class="Qwen3_5ForCausalLM"),
    "qwen3_5_moe": dict(dtype="bfloat16", block_size=128, prompts=PROMPTS + [LONG],
                        model_class="Qwen3_5MoeForCausalLM"),
}
MODES = ["NONE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
CAPTURE_SIZES = [1, 2, 4]  # the prompts' decode batch (4) is a captured size


@functools.lru_cache(maxsize=None)
def run(family: str, mode: str) -> dict:
    """The family's greedy outputs in ``mode``, its model class and the replays they made:
    one engine per family and mode, made once for this module's tests."""
    result = (_runs_in_own_process()[family][mode] if FAMILIES[family].get("own_process")
              else engine_run(family, mode))
    note_engine(result["summary"])  # for the test that made it (in a process of its own)
    return result


def engine_run(family: str, mode: str) -> dict:
    spec = FAMILIES[family]
    with contextlib.ExitStack() as stack:
        if spec.get("own_class"):
            stack.enter_context(vllms_own_class(spec["own_class"]))
        calls = stack.enter_context(call_log(pathlib.Path(tempfile.mkdtemp()) / "calls.jsonl")) \
            if spec.get("call_log") else set()
        llm = stack.enter_context(engine(
            model_path(spec.get("checkpoint", family)), dtype=spec["dtype"],
            block_size=spec["block_size"], compilation_config={
                "cudagraph_mode": mode, "cudagraph_capture_sizes": CAPTURE_SIZES}))
        with replays(llm) as made:
            outs = vllm_greedy(llm, spec["prompts"], MAX_TOKENS)
        layers = llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
        result = dict(outs=outs, made=made, model_class=loaded_class(llm),
                      summary=llm.ascend_summary,
                      expected=expected_replays(mode, made["steps"], layers, max(CAPTURE_SIZES)))
    return {**result, "calls": sorted(calls)}


OWN_PROCESS_SCRIPT = """
import json, sys
from tests.e2e.test_families import MODES, engine_run
print("RESULT", json.dumps({f: {m: engine_run(f, m) for m in MODES} for f in sys.argv[1:]}))
"""


@functools.lru_cache(maxsize=None)
def _runs_in_own_process() -> dict:
    """run() of the own_process families, every mode, in one process (one import of vLLM):
    family -> mode -> result, the logprobs' token ids made ints again."""
    families = [f for f, spec in FAMILIES.items() if spec.get("own_process")]
    proc = subprocess.run([sys.executable, "-c", OWN_PROCESS_SCRIPT, *families],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    results = json.loads(lines[0].removeprefix("RESULT "))
    for per_mode in results.values():
        for result in per_mode.values():
            result["outs"] = [(tokens, [{int(t): lp for t, lp in step.items()} for step in steps])
                              for tokens, steps in result["outs"]]
    return results


# The developer's loop: the sliding windows in the default mode; the rest in the full tier.
QUICK = {("mistral", "FULL_AND_PIECEWISE"), ("gemma3", "FULL_AND_PIECEWISE")}


@pytest.mark.parametrize("family,mode", [
    pytest.param(f, m, marks=() if (f, m) in QUICK else (pytest.mark.slow,))
    for f in FAMILIES for m in MODES])
def test_family_is_close_to_hf_with_the_replays_its_steps_call_for(family, mode):
    spec, result = FAMILIES[family], run(family, mode)
    assert result["model_class"] == spec["model_class"]  # vLLM's own class, or our file
    for prompt, out in zip(spec["prompts"], result["outs"]):
        assert check_logprobs_close(hf_greedy(model_path(spec.get("checkpoint", family)), prompt,
                                              MAX_TOKENS), out,
                                    f"{family} {mode} {prompt[:24]!r}",
                                    dtype=spec["dtype"]) == MAX_TOKENS
    check_replays(result, mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_graph_mode_gives_the_eager_result_exactly(family, mode):
    for prompt, eager, graph in zip(FAMILIES[family]["prompts"], run(family, "NONE")["outs"],
                                    run(family, mode)["outs"]):
        check_identical(eager, graph, f"{family} {mode} {prompt[:24]!r}")


# TP=2 for every family whose heads divide (all of them: 4 query and 2 KV heads), one graph mode
# each, in turn, on vLLM's multiprocessing executor (a worker process a rank, which also keeps
# the Transformers backend's changes to HF's classes out of this process). Gemma-3 and GPT-OSS
# run at TP=2 on the Ray cluster (test_parallel.py); Qwen3 with no file is Qwen3's checkpoint.
TP2 = [f for f in FAMILIES if f not in ("gemma3", "gpt_oss", "qwen3_no_file")]


@pytest.mark.slow
@pytest.mark.parametrize("family,mode", [(f, MODES[i % len(MODES)]) for i, f in enumerate(TP2)])
def test_family_at_tp2_is_close_to_hf_with_the_replays_its_steps_call_for(family, mode):
    spec = FAMILIES[family]
    path = model_path(spec.get("checkpoint", family))
    with engine(path, dtype=spec["dtype"], block_size=spec["block_size"],
                tensor_parallel_size=2, compilation_config={
                    "cudagraph_mode": mode, "cudagraph_capture_sizes": CAPTURE_SIZES}) as llm:
        with replays(llm) as made:
            outs = vllm_greedy(llm, spec["prompts"], MAX_TOKENS)
        layers = llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
        assert loaded_class(llm) == spec["model_class"]
    for prompt, out in zip(spec["prompts"], outs):
        check_logprobs_close(hf_greedy(path, prompt, MAX_TOKENS), out,
                             f"{family} TP=2 {mode} {prompt[:24]!r}", dtype=spec["dtype"])
    assert len(made["ranks"]) == 2
    for rank, here in enumerate(made["ranks"]):
        expected = expected_replays(mode, here["steps"], layers, max(CAPTURE_SIZES))
        assert here["replayed"] == expected, (rank, here)
        if mode != "NONE":
            assert here["replayed"].get("FULL", 0) >= MAX_TOKENS - 1, (rank, here)


@pytest.mark.parametrize("mode", MODES)
def test_a_family_with_no_file_makes_its_twins_calls(mode):
    """vLLM's own Qwen3 class, through the Ascend CustomOps and FX passes, makes the same
    torch_npu calls as the Qwen3 file (every call shape, compiled pieces' included: the step's
    cos/sin rows read by npu_rotary_mul, never npu_mrope's per-layer gather), and so the same
    output to the bit."""
    twin, own = run("qwen3", mode), run("qwen3_no_file", mode)
    assert own["model_class"] == "Qwen3ForCausalLM" and twin["model_class"] != "Qwen3ForCausalLM"
    assert own["calls"] == twin["calls"], "\n".join(
        [f"file only: {c}" for c in set(twin["calls"]) - set(own["calls"])]
        + [f"no file only: {c}" for c in set(own["calls"]) - set(twin["calls"])])
    in_graph = {json.loads(c)["api"] for c in own["calls"] if '"in": "graph"' in c}
    assert {"npu_rms_norm", "npu_add_rms_norm", "npu_rotary_mul", "npu_swiglu"} <= in_graph
    assert not any('"npu_mrope"' in c for c in own["calls"])
    for prompt, a, b in zip(PROMPTS, twin["outs"], own["outs"]):
        check_identical(a, b, f"Qwen3 file vs vLLM's class, {mode} {prompt[:24]!r}")


@pytest.mark.parametrize("family,dtype,error,match", [
    ("gemma2", "bfloat16", NotImplementedError, "does not support logits soft-capping"),
    # FIA v2's learnable_sink takes bfloat16 only: GPT-OSS in float16 is refused with the fix.
    ("gpt_oss", "float16", ValueError, "takes bfloat16.*serve it with --dtype bfloat16")])
def test_a_family_without_a_kernel_for_its_attention_is_refused_at_start_up(family, dtype,
                                                                             error, match):
    with pytest.raises(error, match=match):
        # its config alone: refused before any weight loads
        with engine(config_only_dir(family), dtype=dtype):
            pass
