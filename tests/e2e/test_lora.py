"""LoRA adapters in graph mode: one batch mixing two adapters and the base model, each request
close by value to HF transformers with its adapter merged into the weights (fp32), in NONE,
FULL_DECODE_ONLY and FULL_AND_PIECEWISE, with the replays the steps call for and the graph
modes equal to eager exactly; an adapter loaded into a slot after the capture (evicting another)
is seen by the next replay, with no graph captured again; the start-up plan counts the graphs
vLLM captures once without and once with adapters; `vllm serve --lora-modules` answers with the
adapter through the OpenAI API. Adapters: rank 8 on every projection of the tiny Llama
(scripts/models.py: lora_adapter_dir), which change its greedy tokens at 96-100 % of the
positions of the suite's prompts (lora_effect), so an adapter applied to the wrong request, or
not at all, fails the comparison."""

import functools

import pytest

from scripts.models import LORA_RANK, lora_adapter_dir, lora_merged_dir
from tests.e2e.conftest import (MAX_TOKENS, PROMPTS, check_identical, check_logprobs_close,
                                check_plan, engine, expected_replays, graph_counts, hf_greedy,
                                model_path, replays, served_completion, vllm_greedy,
                                vllm_server)

FAMILY = "llama"
MODES = ["NONE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "PIECEWISE", "FULL"]
SLOW = {"PIECEWISE", "FULL"}  # the full tier only (the quick tier's three cover both graph kinds)


def modes(names):
    return [pytest.param(m, marks=pytest.mark.slow) if m in SLOW else m for m in names]
CAPTURE_SIZES = [1, 2, 4]
# Request i of a batch runs ADAPTERS[i % 3]: seeds of lora_adapter_dir, None for the base model.
ADAPTERS = (1, 2, None)


def lora_request(seed):
    from vllm.lora.request import LoRARequest

    return None if seed is None else LoRARequest(f"adapter{seed}", seed,
                                                 lora_adapter_dir(FAMILY, seed))


def reference_path(seed) -> str:
    return model_path(FAMILY) if seed is None else lora_merged_dir(FAMILY, seed)


def greedy(llm, prompts, seeds):
    return vllm_greedy(llm, prompts, MAX_TOKENS, lora_request=[lora_request(s) for s in seeds])


@functools.lru_cache(maxsize=None)
def run(mode: str) -> dict:
    """The mixed batch in ``mode``, then a third adapter (evicting one of the two slots) with
    the first: outputs, replays and graph counts; one engine per mode, made once."""
    with engine(model_path(FAMILY), enable_lora=True, max_lora_rank=LORA_RANK, max_loras=2,
                max_cpu_loras=2, compilation_config={
                    "cudagraph_mode": mode, "cudagraph_capture_sizes": CAPTURE_SIZES}) as llm:
        prompts = PROMPTS + PROMPTS[:1]
        seeds = [ADAPTERS[i % 3] for i in range(len(prompts))]
        with replays(llm) as mixed:
            mixed_outs = greedy(llm, prompts, seeds)
        captured = graph_counts(llm)["captured"]
        later = [3, 1]
        with replays(llm) as swapped:
            swapped_outs = greedy(llm, PROMPTS[:2], later)
        layers = llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
        return dict(prompts=prompts, seeds=seeds, outs=mixed_outs, made=mixed,
                    later=later, later_outs=swapped_outs, later_made=swapped,
                    captured=captured, captured_after=graph_counts(llm)["captured"],
                    figures=llm.collective_rpc("startup_figures")[0], layers=layers)


@pytest.mark.parametrize("mode", modes(MODES))
def test_a_batch_mixing_two_adapters_and_the_base_model_is_close_to_the_merged_weights(mode):
    result = run(mode)
    for prompt, seed, out in zip(result["prompts"], result["seeds"], result["outs"]):
        check_logprobs_close(hf_greedy(reference_path(seed), prompt, MAX_TOKENS), out,
                             f"{mode} adapter {seed} {prompt!r}")
    made = result["made"]
    assert made["replayed"] == expected_replays(mode, made["steps"], result["layers"],
                                                max(CAPTURE_SIZES)), made
    if "FULL" in mode:
        assert made["replayed"].get("FULL", 0) >= MAX_TOKENS - 1, made  # every decode step
    elif mode == "PIECEWISE":
        assert made["replayed"].get("PIECEWISE", 0) > 0, made


@pytest.mark.parametrize("mode", modes(MODES[1:]))
def test_graph_modes_give_the_eager_result_exactly(mode):
    eager, graphs = run("NONE"), run(mode)
    for seed, expected, actual in zip(eager["seeds"], eager["outs"], graphs["outs"]):
        check_identical(expected, actual, f"{mode} adapter {seed}")


@pytest.mark.parametrize("mode", modes(MODES))
def test_an_adapter_loaded_after_capture_is_seen_by_the_next_replay(mode):
    """Adapter 3 takes the slot of adapter 2 (two slots): the captured graphs read the slots'
    weights where they are, so they replay it with no capture."""
    result = run(mode)
    for prompt, seed, out in zip(PROMPTS, result["later"], result["later_outs"]):
        check_logprobs_close(hf_greedy(reference_path(seed), prompt, MAX_TOKENS), out,
                             f"{mode} later adapter {seed} {prompt!r}")
    assert result["captured_after"] == result["captured"]
    replayed = result["later_made"]["replayed"]
    assert sum(replayed.values()) >= (MAX_TOKENS - 1 if mode != "NONE" else 0), result
    assert mode != "NONE" or not replayed


@pytest.mark.parametrize("mode", modes(MODES[1:]))
def test_the_plan_counts_the_graphs_with_and_without_adapters(mode):
    """vLLM captures each size twice with LoRA on (no adapter; any adapter): the plan, the
    streams and the capture sizes kept under the stream budget count both."""
    result = run(mode)
    figures = result["figures"]
    check_plan(figures, f"lora {mode}")
    counts, pieces = figures["measured"]["graph_counts"], {"FULL": 1,
                                                             "PIECEWISE": result["layers"] + 1}
    assert counts and counts == {m: 2 * len(CAPTURE_SIZES) * pieces[m] for m in counts}, counts


@pytest.mark.slow
def test_served_adapter_answers_through_the_openai_api():
    adapter = lora_adapter_dir(FAMILY, 1)
    with vllm_server(model_path(FAMILY), "tiny", "--dtype", "bfloat16", "--max-model-len", "512",
                     "--max-num-batched-tokens", "512", "--gpu-memory-utilization", "0.3",
                     "--enable-lora", "--max-lora-rank", str(LORA_RANK),
                     "--lora-modules", f"mine={adapter}") as (base, _):
        prompt = PROMPTS[0]
        check_logprobs_close(hf_greedy(reference_path(1), prompt, MAX_TOKENS),
                             served_completion(base, "mine", prompt, MAX_TOKENS), "served mine")
        check_logprobs_close(hf_greedy(reference_path(None), prompt, MAX_TOKENS),
                             served_completion(base, "tiny", prompt, MAX_TOKENS), "served base")


REFUSED = {
    "moe": ("qwen3_moe", {}, "LoRA on a mixture-of-experts model"),
    "mla": ("deepseek_v2", {}, "LoRA on an MLA model"),
    "speculative": ("llama", {"speculative_config": {"method": "ngram",
                                                     "num_speculative_tokens": 2,
                                                     "prompt_lookup_max": 3}},
                    "LoRA with speculative decoding"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_lora_where_it_has_no_path_is_refused_at_start_with_the_reason(case):
    family, extra, reason = REFUSED[case]
    with pytest.raises(Exception, match=reason):
        with engine(model_path(family), enable_lora=True, max_lora_rank=LORA_RANK, **extra):
            pass
