"""DeepSeek's multi-head latent attention in graph mode: a tiny dense-MLA DeepSeek-V2 loads
through the plugin's family file, runs on the ASCEND_MLA backend and generates close to HF
transformers in NONE, PIECEWISE, FULL_DECODE_ONLY and FULL (which MLA runs as
FULL_AND_PIECEWISE, saying so), with its graph replays counted; so does one with MoE layers, in
every mode. Prefill with context (a chunked prompt's later chunks, a prefix-cache
hit) reads earlier tokens from the latent cache. DeepSeek-V2 with MoE layers over DP=2 x TP=2
with EP=4: test_serve.py. MTP: test_spec_decode.py."""

import pytest
from vllm import SamplingParams

from tests.e2e.conftest import (check_logprobs_close, check_plan, engine, expected_replays,
                                hf_greedy, MAX_TOKENS, loaded_class, model_path, platform_log,
                                replays, TOPK, vllm_greedy, word_prompt)

CAPTURE_SIZES = [1, 2, 4, 8, 16]
PROMPTS = ["Hi there", "The capital of France is a city that"]
# (family, requested, runs as, dtype): dense MLA and MLA with MoE layers (a routed_scaling_factor
# of 2.5) in every mode, in both of FIA's dtypes (float16: vLLM divides the hidden states by the
# scaling factor instead of scaling the routed output in its MoE runner). The MoE model at TP=2
# with expert parallelism: test_layouts.py; over DP=2 x TP=2: test_serve.py.
CASES = [("deepseek_v2", "NONE", "NONE", "bfloat16"),
         ("deepseek_v2", "PIECEWISE", "PIECEWISE", "bfloat16"),
         ("deepseek_v2", "FULL_DECODE_ONLY", "FULL_DECODE_ONLY", "float16"),
         ("deepseek_v2", "FULL", "FULL_AND_PIECEWISE", "bfloat16"),
         ("deepseek_v2_moe", "FULL_DECODE_ONLY", "FULL_DECODE_ONLY", "float16"),
         ("deepseek_v2_moe", "PIECEWISE", "PIECEWISE", "bfloat16")] + [
    pytest.param(c, marks=pytest.mark.slow) for c in (  # the full tier only
        ("deepseek_v2_moe", "NONE", "NONE", "float16"),
        ("deepseek_v2_moe", "FULL", "FULL_AND_PIECEWISE", "bfloat16"),
        ("deepseek_v2_moe", "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE", "float16"))]
MAX_BATCHED = 128  # a prompt of ~300 tokens is prefilled in three chunks
FALLBACK = ("graph mode FULL_AND_PIECEWISE (configured FULL): as configured (vLLM's default unless "
            "set); the MLA attention backend runs only uniform decode batches inside FULL graphs, "
            "so mixed batches run PIECEWISE")


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def mla_llm(request):
    family, requested, mode, dtype = request.param
    compilation = {"cudagraph_mode": requested, "cudagraph_capture_sizes": CAPTURE_SIZES}
    with platform_log() as log, engine(
            model_path(family), max_num_seqs=4, enforce_eager=requested == "NONE", dtype=dtype,
            max_num_batched_tokens=MAX_BATCHED, enable_prefix_caching=True,
            compilation_config=compilation) as llm:
        yield family, requested, mode, dtype, llm, list(log)


def test_mla_generates_close_to_hf_with_graph_replays(mla_llm):
    family, requested, mode, dtype, llm, log = mla_llm
    assert loaded_class(llm) == "AscendDeepseekV2ForCausalLM"
    assert llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name == mode
    with replays(llm) as made:
        outs = vllm_greedy(llm, PROMPTS, MAX_TOKENS)
    check_plan(llm.collective_rpc("startup_figures")[0], f"{family} {requested}")
    for prompt, out in zip(PROMPTS, outs):
        check_logprobs_close(hf_greedy(model_path(family), prompt, MAX_TOKENS), out,
                             f"{family} {requested} {prompt!r}", dtype=dtype)
    assert len(made["steps"]) >= MAX_TOKENS, made
    assert made["replayed"] == expected_replays(mode, made["steps"], 2, max(CAPTURE_SIZES)), made
    kinds = {"NONE": set(), "PIECEWISE": {"PIECEWISE"}, "FULL_DECODE_ONLY": {"FULL"},
             "FULL_AND_PIECEWISE": {"PIECEWISE", "FULL"}}
    assert set(made["replayed"]) == kinds[mode], made  # the prefill's and the decodes' graphs
    if requested == "FULL":  # one line says FULL fell back, and why
        assert any(FALLBACK in line for line in log), log


def test_prefill_with_context_reads_the_latent_cache(mla_llm):
    """A ~300-token prompt is prefilled in 128-token chunks (the later ones attend to the
    earlier ones' latents in the cache), then asked again: vLLM finds its first two blocks in
    the prefix cache and prefills only the rest. Both close to HF."""
    family, requested, mode, dtype, llm, _ = mla_llm
    if family != "deepseek_v2" or requested != "PIECEWISE":
        pytest.skip("the prefill path is the same in every mode (eager, or between pieces); "
                    "checked in PIECEWISE")
    prompt = word_prompt(300)
    assert len(llm.get_tokenizer()(prompt).input_ids) > 2 * MAX_BATCHED
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=TOPK)
    with replays(llm) as made:
        first, second = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert (MAX_BATCHED, 1) in made["steps"], made  # chunks of 128 tokens
    assert second.num_cached_tokens >= 256
    reference = hf_greedy(model_path(family), prompt, 8)
    for label, out in (("chunked", first), ("prefix-cached", second)):
        pair = (list(out.outputs[0].token_ids),
                [{t: lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs])
        check_logprobs_close(reference, pair, f"MLA {requested} {label}", dtype=dtype)
