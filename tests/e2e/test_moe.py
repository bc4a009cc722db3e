"""Mixture-of-experts in graph mode: a tiny Qwen3-MoE (top-k renormalised) loads through
the plugin's family file, runs its experts on the fused-MoE operators, and generates close to HF
transformers (DeepSeek-V2's MoE layers, a shared expert and no renormalisation: test_mla.py);
every check counts the graphs that replayed, so an eager fallback fails it. In float16 (routing
ties, docs/moe.md#tests-and-figures). Expert parallelism: over TP=2 in test_parallel.py, over
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
CLASSES = {"qwen3_moe": "AscendQwen3MoeForCausalLM"}
DTYPES = {"qwen3_moe": "float16"}
# Qwen3-MoE in the modes whose graphs hold MoE layers for every batch kind: FULL (mixed batches
# in FULL graphs), FULL_DECODE_ONLY and FULL_AND_PIECEWISE (prefill pieces, FULL decode graphs).
# NONE and PIECEWISE run the same layer eagerly or in pieces, as FULL_AND_PIECEWISE's prefill
# does; they and Qwen2-MoE are checked by hand: `python scripts/check_parallel.py --family
# qwen3_moe --modes PIECEWISE` and `--family qwen2_moe` (every mode). A shared expert without
# renormalisation (Qwen2-MoE's and DeepSeek-V2's routing) runs in the suite as DeepSeek-V2
# (test_mla.py, test_serve.py).
CASES = [("qwen3_moe", m) for m in MODES if m not in ("NONE", "PIECEWISE")]


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
