"""The Ascend FX passes (vllm_ascend/compilation/passes.py) give a family with no model file the
fusions its twin's file encodes by hand.

A ModelSlim export of the tiny Llama with a W8A8_DYNAMIC and a W8A8 layer runs through the Llama
file and through vLLM's own LlamaForCausalLM, with the simulator's call log on. Compiled (NONE
with compilation, FULL_DECODE_ONLY, FULL_AND_PIECEWISE), the norm-quant pass fuses each residual
add + RMSNorm with the quantization of the W8A8 layer it feeds, as the file does: the same call
shapes (npu_add_rms_norm_dynamic_quant, npu_add_rms_norm_quant) and the same output to the bit.
With enforce_eager nothing is compiled and no pass runs: vLLM's class quantizes apart, which
shows that the pass, not the CustomOps, makes the difference. (Qwen3 with no file, unquantized,
in every mode: tests/e2e/test_families.py.)
"""

import contextlib
import functools
import json
from pathlib import Path

import pytest

from tests.e2e.conftest import (call_log, check_identical, engine, loaded_class, model_path,
                                replays, vllm_greedy, vllms_own_class)

PROMPTS = ["The capital of France is", "Hello, my name is", "1, 2, 3,"]
FUSED = {"npu_add_rms_norm_dynamic_quant", "npu_add_rms_norm_quant"}
MODES = {"NONE": {"compilation_config": {"cudagraph_mode": "NONE"}},
         "FULL_DECODE_ONLY": {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY",
                                                     "cudagraph_capture_sizes": [1, 2, 4]}},
         "FULL_AND_PIECEWISE": {"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE",
                                                       "cudagraph_capture_sizes": [1, 2, 4]}},
         "eager": {"enforce_eager": True}}


@functools.lru_cache(maxsize=None)
def run(mode: str, own_class: bool, tmp_dir: str) -> dict:
    with contextlib.ExitStack() as stack:
        if own_class:
            stack.enter_context(vllms_own_class("LlamaForCausalLM"))
        calls = stack.enter_context(call_log(Path(tmp_dir) / f"{mode}-{own_class}.jsonl"))
        llm = stack.enter_context(engine(model_path("llama-w8a8-mixed"), max_num_seqs=4,
                                         **MODES[mode]))
        with replays(llm) as made:
            outs = vllm_greedy(llm, PROMPTS, 8)
        model_class = loaded_class(llm)
    apis = {json.loads(c)["api"] for c in calls}
    return dict(calls=calls, apis=apis, outs=outs, made=made, model_class=model_class)


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fusion_calls"))


@pytest.mark.parametrize("mode", ["NONE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_a_compiled_family_with_no_file_gets_its_twins_norm_quant_fusion(mode, tmp_dir):
    twin, own = run(mode, False, tmp_dir), run(mode, True, tmp_dir)
    assert (twin["model_class"], own["model_class"]) == ("AscendLlamaForCausalLM",
                                                         "LlamaForCausalLM")
    assert FUSED <= own["apis"], own["apis"]
    assert own["calls"] == twin["calls"], "\n".join(sorted(own["calls"] ^ twin["calls"]))
    for prompt, a, b in zip(PROMPTS, twin["outs"], own["outs"]):
        check_identical(a, b, f"W8A8 Llama file vs vLLM's class, {mode} {prompt!r}")
    if mode != "NONE":
        assert own["made"]["replayed"].get("FULL", 0) > 0, own["made"]


def test_without_compilation_no_pass_runs(tmp_dir):
    twin, own = run("eager", False, tmp_dir), run("eager", True, tmp_dir)
    assert FUSED <= twin["apis"]  # the file fuses in its own code
    assert not FUSED & own["apis"] and {"npu_add_rms_norm", "npu_dynamic_quant",
                                        "npu_quantize"} <= own["apis"], own["apis"]
