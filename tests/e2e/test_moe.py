"""Mixture-of-experts in graph mode: a tiny Qwen3-MoE (top-k renormalised) and a tiny Qwen2-MoE
(a gated shared expert) load through the plugin's family files, run their experts on the
fused-MoE operators, and generate close to HF transformers in every graph mode (DeepSeek-V2's
MoE layers: test_mla.py); every check counts the graphs that replayed, so an eager fallback
fails it. Expert parallelism: over TP=2 in test_parallel.py, over
DP=2 x TP=2 (vLLM's lockstep DP engines) in test_serve.py."""

import pytest

from tests.e2e.conftest import (check_logprobs_close, check_plan, engine, expected_replays,
                                hf_greedy, MAX_TOKENS, loaded_class, model_path, replays,
                                vllm_greedy)

CAPTURE_SIZES = [1, 2, 4, 8, 16]
# Prefilled together (10 tokens: PIECEWISE pieces where the mode has them, a FULL graph of a
# mixed batch in FULL, eagerly in FULL_DECODE_ONLY), then decoded two requests a step.
PROMPTS = ["Hi there", "The capital of France is a city that"]
MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
CLASSES = {"qwen3_moe": "AscendQwen3MoeForCausalLM", "qwen2_moe": "AscendQwen2MoeForCausalLM"}
# Qwen3-MoE (top-k renormalised) in float16 (routing ties, docs/moe.md#tests-and-figures);
# Qwen2-MoE (a gated shared expert, no renormalisation) in bfloat16. Both in every graph mode.
DTYPES = {"qwen3_moe": "float16", "qwen2_moe": "bfloat16"}
# The quick tier keeps Qwen3-MoE in the modes whose graphs hold MoE layers for every batch kind
# (FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE); the rest run in the full tier.
QUICK = {("qwen3_moe", m) for m in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")}
CASES = [pytest.param(family, m, marks=() if (family, m) in QUICK else pytest.mark.slow)
         for family in DTYPES for m in MODES]


@pytest.mark.parametrize("family,mode", CASES)
def test_moe_family_equals_hf_with_graph_replays(family, mode):
    compilation = {"cudagraph_mode": mode, "cudagraph_capture_sizes": CAPTURE_SIZES}
    with engine(model_path(family), max_num_seqs=4, enforce_eager=mode == "NONE",
                dtype=DTYPES[family], compilation_config=compilation) as llm:
        assert loaded_class(llm) == CLASSES[family]
        layers = llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
        with replays(llm) as made:
            outs = vllm_greedy(llm, PROMPTS, MAX_TOKENS)
        check_plan(llm.collective_rpc("startup_figures")[0], f"{family} {mode}")
    for prompt, out in zip(PROMPTS, outs):
        check_logprobs_close(hf_greedy(model_path(family), prompt, MAX_TOKENS), out,
                             f"{family} {mode} {prompt!r}", dtype=DTYPES[family])
    assert len(made["steps"]) >= MAX_TOKENS, made
    assert made["replayed"] == expected_replays(mode, made["steps"], layers,
                                                max(CAPTURE_SIZES)), made
    kinds = {"NONE": set(), "PIECEWISE": {"PIECEWISE"}, "FULL": {"FULL"},
             "FULL_DECODE_ONLY": {"FULL"}, "FULL_AND_PIECEWISE": {"PIECEWISE", "FULL"}}
    assert set(made["replayed"]) == kinds[mode], made  # the prefill's and the decodes' graphs
