"""Classes of requests in graph mode (FULL_AND_PIECEWISE) against the same engine run eagerly:
mixed prompt lengths, chunked prefill, prefix caching, preemption, structured output, a full
batch, a request aborted between steps, seeded sampling, prompt logprobs and bad input. Each
workload runs once on an eager engine and once on a graph engine of the same settings; the
graph engine's output must be close to the eager one (and greedy output close to HF
transformers'), and it must have replayed graphs for the workload's steps. The model is a
bfloat16 checkpoint run with dtype "auto", as most published checkpoints are run."""

import re

import pytest
import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams

from scripts.models import tiny_model_dir
from tests.e2e.conftest import (EXACT, LOGPROB_TOLERANCE, TOPK, check_identical,
                                check_logprobs_close, engine,
                                expected_replays, hf_greedy, hf_prompt_logprobs, replays,
                                vllm_greedy)

MODEL = tiny_model_dir("llama", "bfloat16")
LAYERS = 2  # the tiny models'
SIZES = [1, 2, 4, 8, 16, 32, 64]
MAX_BATCHED = 64  # small, so that long prompts are prefilled in chunks
# 10 KV blocks of 128 tokens (one is vLLM's null block): eight requests of ~100 prompt tokens
# fit, and need a second block each once they decode past 128 tokens, so some are preempted.
SETTINGS = dict(dtype="auto", max_num_seqs=8, max_num_batched_tokens=MAX_BATCHED, max_model_len=512,
                enable_prefix_caching=True, num_gpu_blocks_override=10, disable_log_stats=False)
GRAPHS = {"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE",
                                 "cudagraph_capture_sizes": SIZES}}


def prompt_of(n_words: int, seed: int) -> str:
    words = ["river", "stone", "light", "seven", "garden", "quiet", "north", "paper", "cloud"]
    return " ".join(words[(i * 7 + seed) % len(words)] for i in range(n_words))


def as_close_pair(out):
    """(tokens, [{token: logprob}]) of one completion, for check_logprobs_close."""
    return (list(out.token_ids),
            [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs])


def preemptions(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


# Each workload runs on an engine and returns what is compared across the two engines.

def mixed_lengths(llm):
    prompts = [prompt_of(n, s) for s, n in enumerate([1, 3, 9, 17, 30, 5])]
    return prompts, vllm_greedy(llm, prompts, 12)


def chunked_prefill(llm):
    prompts = [prompt_of(150, 3), prompt_of(4, 1)]  # ~150 tokens over 64-token steps
    assert len(llm.get_tokenizer()(prompts[0]).input_ids) > 2 * MAX_BATCHED
    return prompts, vllm_greedy(llm, prompts, 12)


def prefix_cached(llm):
    prompt = prompt_of(300, 5)  # more than two full 128-token blocks
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=TOPK)
    first, second = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    return [prompt], [as_close_pair(first.outputs[0]), as_close_pair(second.outputs[0])], \
        second.num_cached_tokens


def preempted(llm):
    prompts = [prompt_of(100, s) for s in range(8)]  # ~100 tokens each: one block each
    before = preemptions(llm)
    outs = vllm_greedy(llm, prompts, 40)  # past 128 tokens: a second block each
    return prompts, outs, preemptions(llm) - before


REGEX = r"[a-z]{3,8} [0-9]{2}"


def structured(llm):
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=TOPK,
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    outs = llm.generate([prompt_of(5, s) for s in range(3)], params, use_tqdm=False)
    return [(o.outputs[0].text, as_close_pair(o.outputs[0])) for o in outs]


def full_batch(llm):
    prompts = [prompt_of(n, n) for n in range(1, 9)]  # num_reqs == max_num_seqs
    return prompts, vllm_greedy(llm, prompts, 10)


def aborted_between_steps(llm):
    """Three requests; the second is aborted after a few decode steps; the others finish."""
    engine_ = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=TOPK)
    prompts = {f"r{i}": prompt_of(4 + i, i) for i in range(3)}
    for rid, prompt in prompts.items():
        engine_.add_request(rid, prompt, params)
    finished, steps = {}, 0
    while engine_.has_unfinished_requests():
        for out in engine_.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == 4:
            engine_.abort_request(["r1"])
    assert "r1" not in finished or finished["r1"].outputs[0].finish_reason == "abort"
    return {rid: as_close_pair(finished[rid].outputs[0]) for rid in ("r0", "r2")}, prompts


SEEDS = [(0, 100), (0, 101), (1, 100)]  # (prompt, seed)


def seeded_sampling(llm):
    prompts = [prompt_of(6, p) for p, _ in SEEDS]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True,
                             logprobs=TOPK) for _, seed in SEEDS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [as_close_pair(o.outputs[0]) for o in outs]


def prompt_logprobs(llm):
    prompt = prompt_of(20, 2)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=TOPK)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    ids = list(out.prompt_token_ids)
    return ids, [step[t].logprob for t, step in zip(ids[1:], out.prompt_logprobs[1:])]


WORKLOADS = [mixed_lengths, chunked_prefill, prefix_cached, preempted, structured, full_batch,
             aborted_between_steps, seeded_sampling, prompt_logprobs]


@pytest.fixture(scope="module")
def eager_results():
    """Every workload's result on the eager engine (run first, then shut down)."""
    with engine(MODEL, enforce_eager=True, **SETTINGS) as llm:
        return {w.__name__: w(llm) for w in WORKLOADS}


@pytest.fixture(scope="module")
def graph_llm(eager_results):
    with engine(MODEL, **SETTINGS, **GRAPHS) as llm:
        yield llm


def run(llm, workload, decodes=True):
    """The workload on the graph engine, and the replays its steps made, which must be exactly
    what vLLM's dispatch calls for, and not none."""
    with replays(llm) as made:
        result = workload(llm)
    assert made["replayed"] == expected_replays("FULL_AND_PIECEWISE", made["steps"], LAYERS,
                                                max(SIZES)), made
    assert made["replayed"], made
    if decodes:
        assert made["replayed"].get("FULL"), made  # decode steps replay FULL graphs
    return result, made


def close_to_eager_and_hf(got, eager, label, max_tokens):
    prompts, outs = got[:2]
    for prompt, out, ref in zip(prompts, outs, eager[1]):
        check_identical(ref, out, f"{label} vs eager {prompt[:24]!r}")
        check_logprobs_close(hf_greedy(MODEL, prompt, max_tokens), out,
                             f"{label} vs HF {prompt[:24]!r}")


def test_dtype_auto_runs_a_bfloat16_checkpoint_in_bfloat16(graph_llm):
    config = graph_llm.llm_engine.vllm_config.model_config
    assert config.hf_config.dtype == torch.bfloat16 and config.dtype == torch.bfloat16


def test_mixed_prompt_lengths(graph_llm, eager_results):
    got, _ = run(graph_llm, mixed_lengths)
    close_to_eager_and_hf(got, eager_results["mixed_lengths"], "mixed", 12)


def test_chunked_prefill_replays_piecewise_chunks(graph_llm, eager_results):
    got, made = run(graph_llm, chunked_prefill)
    close_to_eager_and_hf(got, eager_results["chunked_prefill"], "chunked", 12)
    # 64-token steps of the long prompt's chunks (with the short one) replay the size-64 pieces
    assert (MAX_BATCHED, 2) in made["steps"] or (MAX_BATCHED, 1) in made["steps"], made
    assert made["replayed"].get("PIECEWISE"), made


def test_prefix_cache_hit_gives_the_same_output(graph_llm, eager_results):
    (prompts, (first, second), cached), _ = run(graph_llm, prefix_cached)
    assert cached >= 256
    assert second[0] == first[0]
    check_identical(eager_results["prefix_cached"][1][1], second, "prefix-cached vs eager")
    check_logprobs_close(hf_greedy(MODEL, prompts[0], 10), second,
                         "prefix-cached vs HF")


def test_preempted_requests_are_recomputed_to_the_same_output(graph_llm, eager_results):
    (prompts, outs, preempted_now), _ = run(graph_llm, preempted)
    assert preempted_now > 0, "the KV cache was meant to be too small for this batch"
    close_to_eager_and_hf((prompts, outs), eager_results["preempted"], "preempted", 40)


def test_structured_output_follows_the_regex(graph_llm, eager_results):
    got, _ = run(graph_llm, structured)
    for (text, out), (eager_text, eager_out) in zip(got, eager_results["structured"]):
        assert re.fullmatch(REGEX, text) and re.fullmatch(REGEX, eager_text), (text, eager_text)
        check_identical(eager_out, out, f"structured {text!r}")


def test_full_batch_replays_the_largest_decode_graph(graph_llm, eager_results):
    got, made = run(graph_llm, full_batch)
    close_to_eager_and_hf(got, eager_results["full_batch"], "full batch", 10)
    assert (8, 8) in made["steps"], made  # 8 decodes: the size-8 FULL graph


def test_request_aborted_between_steps_leaves_the_others_as_they_were(graph_llm, eager_results):
    (outs, prompts), made = run(graph_llm, aborted_between_steps)
    eager_outs, _ = eager_results["aborted_between_steps"]
    for rid, out in outs.items():
        check_identical(eager_outs[rid], out, f"beside an abort {rid} vs eager")
        check_logprobs_close(hf_greedy(MODEL, prompts[rid], 12), out,
                             f"beside an abort {rid} vs HF")
    assert (2, 2) in made["steps"], made  # after the abort: two decodes a step
    check_logprobs_close(hf_greedy(MODEL, prompts["r1"], 12),
                         vllm_greedy(graph_llm, [prompts["r1"]], 12)[0], "after the abort")


def test_seeded_sampling_is_close_to_eager_and_repeatable(graph_llm, eager_results):
    got, _ = run(graph_llm, seeded_sampling)
    for (prompt, seed), out, ref in zip(SEEDS, got, eager_results["seeded_sampling"]):
        check_identical(ref, out, f"prompt {prompt} seed {seed} vs eager")
    again, _ = run(graph_llm, seeded_sampling)
    assert [tokens for tokens, _ in again] == [tokens for tokens, _ in got]
    assert got[0][0] != got[1][0]  # one prompt, two seeds: two samples


def test_prompt_logprobs_are_close_to_eager_and_hf(graph_llm, eager_results):
    (ids, got), made = run(graph_llm, prompt_logprobs, decodes=False)
    eager_ids, eager = eager_results["prompt_logprobs"]
    assert ids == eager_ids and len(got) == len(ids) - 1
    hf = hf_prompt_logprobs(MODEL, tuple(ids))
    worst_eager = max(abs(a - b) for a, b in zip(got, eager))
    worst_hf = max(abs(a - b) for a, b in zip(got, hf))
    assert worst_eager <= EXACT and worst_hf <= LOGPROB_TOLERANCE["tiny", "bfloat16"], \
        (worst_eager, worst_hf)
    assert made["replayed"].get("PIECEWISE"), made  # the prefill fits the size-32 pieces


def test_too_long_prompt_is_rejected_and_the_engine_keeps_serving(graph_llm):
    with pytest.raises(VLLMValidationError, match="maximum context length is 512 tokens"):
        graph_llm.generate([prompt_of(700, 2)], SamplingParams(max_tokens=4), use_tqdm=False)
    prompt = prompt_of(6, 4)
    check_logprobs_close(hf_greedy(MODEL, prompt, 8),
                         vllm_greedy(graph_llm, [prompt], 8)[0], "after rejection")
