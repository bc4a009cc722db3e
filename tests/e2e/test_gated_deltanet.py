"""Gated DeltaNet layers beyond the family matrix (test_families.py runs the tiny Qwen3-Next,
Qwen3.5 and Qwen3.5-MoE against HF in NONE, FULL_DECODE_ONLY and FULL_AND_PIECEWISE, graph
modes equal to eager, and at TP=2): PIECEWISE, where the GDN core runs between the pieces, for
the three; a prompt longer than the step's token budget, whose conv and recurrent states are
carried from chunk to chunk; preempted requests recomputed from zero states; the settings not
served yet (prefix caching of the states, turned off with a warning; speculative decoding,
refused at start-up; a vision-language class's images, refused in the front end)."""

import os

import pytest

from scripts.models import config_only_dir, saved_config_dir
from tests.e2e import test_families
from tests.e2e.conftest import (check_identical, check_logprobs_close, engine, hf_greedy,
                                model_path, plan_command, platform_log, PROMPTS, replays,
                                vllm_greedy)
from tests.e2e.test_request_classes import preemptions, prompt_of

FAMILY = "qwen3_next"
# 108 tokens with SmolLM2's tokenizer: three chunks in a step budget of 48 tokens.
LONG_PROMPT = " ".join([test_families.LONG] * 4)
CHUNK = 48
CHUNKED_DRIFT = 0.26  # twice the measured 0.130 (the bfloat16 states at two chunk edges)


@pytest.mark.slow
@pytest.mark.parametrize("family", [FAMILY, "qwen3_5", "qwen3_5_moe"])
def test_piecewise_is_close_to_hf_and_gives_the_eager_result_exactly(family):
    result = test_families.engine_run(family, "PIECEWISE")
    spec = test_families.FAMILIES[family]
    for prompt, out, eager in zip(spec["prompts"], result["outs"],
                                  test_families.run(family, "NONE")["outs"]):
        check_logprobs_close(hf_greedy(model_path(family), prompt, 16), out,
                             f"{family} PIECEWISE {prompt[:24]!r}", dtype="bfloat16")
        check_identical(eager, out, f"{family} PIECEWISE {prompt[:24]!r}")
    # a graph per piece (2 layers + 1) in each decode step
    assert result["made"]["replayed"] == result["expected"]
    assert result["made"]["replayed"].get("PIECEWISE", 0) >= 3 * 15


@pytest.mark.slow
def test_a_prompt_longer_than_the_step_budget_carries_its_states_across_chunks():
    with platform_log() as log:
        with engine(model_path(FAMILY), max_num_batched_tokens=CHUNK, max_num_seqs=4) as llm:
            tokens = llm.get_tokenizer()(LONG_PROMPT).input_ids
            assert len(tokens) > 2 * CHUNK  # three chunks
            (chunked,) = vllm_greedy(llm, [LONG_PROMPT], 16)
            cache = llm.llm_engine.vllm_config.cache_config
            assert not cache.enable_prefix_caching and cache.mamba_cache_mode == "none"
    assert any("prefix caching is off for Qwen3NextForCausalLM" in line for line in log), log
    check_logprobs_close(hf_greedy(model_path(FAMILY), LONG_PROMPT, 16), chunked,
                         f"{FAMILY} chunked", dtype="bfloat16")
    with engine(model_path(FAMILY), max_num_seqs=4) as llm:  # the whole prompt in one step
        (whole,) = vllm_greedy(llm, [LONG_PROMPT], 16)
    # Chunked, the states cross a chunk in bfloat16 (the cache's dtype); whole, the prompt's
    # recurrence stays in float32: the same tokens, logprobs within CHUNKED_DRIFT.
    assert chunked[0] == whole[0]
    drift = max(abs(a[t] - b[t]) for a, b, t in zip(chunked[1], whole[1], whole[0]))
    print("chunked vs whole, worst logprob drift", drift)
    assert drift <= CHUNKED_DRIFT


@pytest.mark.slow
def test_preempted_requests_resume_from_recomputed_states_close_to_hf():
    """Six prompts of 230 tokens that decode past a 256-token block, in 8 blocks: vLLM
    preempts some (with prefix caching off, a preempted request recomputes its prompt and its
    tokens from zero states, as a new one), in the default graph mode. Every request's 40
    tokens are close to HF; partings from the same engine run unpreempted were at near ties
    (measured: top-two gaps of 0.125 and 0.05 in bfloat16)."""
    prompts = [prompt_of(230, seed) for seed in range(6)]
    with engine(model_path("qwen3_5"), max_num_seqs=6, num_gpu_blocks_override=8,
                disable_log_stats=False,
                compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]}) as llm:
        before = preemptions(llm)
        with replays(llm) as made:
            outs = vllm_greedy(llm, prompts, 40)
        assert preemptions(llm) - before > 0, "8 blocks were meant to be too few for this batch"
    assert made["replayed"].get("FULL", 0) > 0, made
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        check_logprobs_close(hf_greedy(model_path("qwen3_5"), prompt, 40), out,
                             f"qwen3_5 preempted batch, request {i}", dtype="bfloat16")


@pytest.mark.slow
def test_blocks_of_512_tokens_are_read_as_kernel_blocks_close_to_hf():
    """Qwen3-Next with attention heads of 64: a recurrent state is 512 tokens' K, so its blocks
    hold 512 tokens, more than FIA's paged block (below 512, F6): the attention layers read
    them as kernel blocks of 256 (vLLM's split, by the backend's kernel block sizes), in NONE
    and the default mode, close to HF and the graphs' result the eager one exactly."""
    family, prompts, outs = "qwen3_next_h64", PROMPTS + [test_families.LONG], {}
    for mode in ("NONE", "FULL_AND_PIECEWISE"):
        with engine(model_path(family), compilation_config={
                "cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4]}) as llm:
            assert llm.llm_engine.vllm_config.cache_config.block_size == 512
            runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
            assert runner._kernel_block_sizes == [512, 256]  # the states' group, attention's
            with replays(llm) as made:
                outs[mode] = vllm_greedy(llm, prompts, 16)
    assert made["replayed"].get("FULL", 0) >= 15, made
    for prompt, eager, graph in zip(prompts, outs["NONE"], outs["FULL_AND_PIECEWISE"]):
        check_logprobs_close(hf_greedy(model_path(family), prompt, 16), eager,
                             f"{family} {prompt[:24]!r}", dtype="bfloat16")
        check_identical(eager, graph, f"{family} FULL_AND_PIECEWISE {prompt[:24]!r}")


def qwen3_5_3_to_1_config_dir() -> str:
    """The tiny Qwen3.5's config with three GDN layers to one attention layer, as published
    (without weights: vLLM's dummy load)."""
    from scripts.models import _tiny_config

    def make():
        config, tok = _tiny_config("qwen3_5", num_hidden_layers=4, layer_types=[
            "linear_attention", "linear_attention", "linear_attention", "full_attention"])
        config.architectures = ["Qwen3_5ForCausalLM"]
        return config, tok
    return saved_config_dir("config-qwen3_5-3to1", make)


@pytest.mark.slow
def test_the_plan_counts_the_states_blocks_as_the_engine_lays_them_out():
    """The start-up plan of a hybrid model with GDN and attention layers 3:1: vLLM groups them
    into four KV cache groups of one layer (one tensor), each block a page of the GDN layout
    (attention/hybrid.py); a request of max_model_len holds one more block per state group;
    `vllm-ascend plan` prints the states."""
    path = qwen3_5_3_to_1_config_dir()
    with engine(path, load_format="dummy") as llm:
        (figures,) = llm.collective_rpc("startup_figures")
        blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    # (the plan's weights, and so its KV cache, are unknown without a checkpoint)
    assert figures["measured"]["kv_cache"] == blocks * figures["planned"]["kv_block_bytes"]
    output = plan_command(path, "--max-model-len", "512", env=dict(os.environ))
    assert ("states: Gated DeltaNet in 3 layer(s), per request and layer a recurrent state of "
            "128.0 KiB and a conv state of 6.0 KiB, held in the KV cache's blocks (3 block(s) a "
            "request; blocks of 256 tokens: one block's K is one recurrent state)") in output


def test_speculative_decoding_on_gated_deltanet_is_refused_before_weights_load():
    with pytest.raises(ValueError, match="speculative decoding on Qwen3NextForCausalLM's "
                                         "Gated DeltaNet layers"):
        with engine(config_only_dir(FAMILY), speculative_config={
                "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}):
            pass


def qwen3_5_vl_config_dir() -> str:
    """Qwen3.5's vision-language class (``Qwen3_5ForConditionalGeneration``) on the tiny text
    model's config and a one-block vision tower: a config without weights."""
    import transformers

    from scripts.models import _tiny_config

    def make():
        text, tok = _tiny_config("qwen3_5")
        config = transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config={
            "depth": 1, "hidden_size": 64, "num_heads": 2, "intermediate_size": 128,
            "out_hidden_size": 128})
        config.architectures = ["Qwen3_5ForConditionalGeneration"]
        return config, tok
    return saved_config_dir("config-qwen3_5-vl", make)


def test_qwen3_5s_images_are_refused_in_the_front_end_and_its_text_model_is_not():
    from vllm.engine.arg_utils import EngineArgs
    path = qwen3_5_vl_config_dir()
    with pytest.raises(ValueError, match="Qwen3_5ForConditionalGeneration's image and video "
                                         "inputs.*--language-model-only"):
        EngineArgs(model=path, max_model_len=512).create_engine_config()
    config = EngineArgs(model=path, max_model_len=512,
                        language_model_only=True).create_engine_config()
    assert config.model_config.architecture == "Qwen3_5ForConditionalGeneration"
