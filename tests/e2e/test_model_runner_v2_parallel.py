"""vLLM's Model Runner V2 on the plugin, with engines a module fixture's would disturb (the
single-device checks: test_model_runner_v2.py): Qwen3-MoE with expert parallelism at TP=2
(vLLM's multiprocessing executor, a worker process a rank: devices 0 and 1, which a fixture's
engine would hold) close to HF transformers with the replays its steps call for on both ranks;
served with DP=2 + EP (`VLLM_USE_V2_MODEL_RUNNER=1 python scripts/check_data_parallel.py --mode
FULL_DECODE_ONLY`): V2's DP padding and dummy steps in lockstep, a request pinned to rank 0
while rank 1 idles; and V2's sampling parameters against V1's sampler, a V1 engine beside a V2
one (a live in-process engine caches vLLM's environment, VLLM_USE_V2_MODEL_RUNNER included, so
a fixture's V2 engine would make the other V2 too)."""

import ast
import os
import re

import pytest

from tests.e2e.cells import note_printed_engines
from tests.e2e.conftest import (check_logprobs_close, engine, expected_replays, hf_greedy,
                                MAX_TOKENS, model_path, num_layers, replays, vllm_greedy)
from tests.e2e.test_data_parallel import check_data_parallel
from tests.e2e.test_model_runner_v2 import CAPTURE_SIZES, PROMPTS, V2, runner_v2, v2_engine

pytestmark = pytest.mark.slow  # (worker processes)


def test_moe_with_ep_at_tp2_is_close_to_hf_with_the_replays_its_steps_call_for():
    mode = "FULL_AND_PIECEWISE"
    with v2_engine("qwen3_moe", mode, tensor_parallel_size=2, enable_expert_parallel=True) as llm:
        with replays(llm) as made:
            outs = vllm_greedy(llm, PROMPTS, MAX_TOKENS)
        layers = num_layers(llm)
        runners = llm.collective_rpc(lambda worker: type(worker.model_runner).__name__)
    assert runners == ["NPUModelRunnerV2"] * 2
    for prompt, out in zip(PROMPTS, outs):
        check_logprobs_close(hf_greedy(model_path("qwen3_moe"), prompt, MAX_TOKENS), out,
                             f"V2 TP=2 EP {prompt!r}", dtype="float16")
    assert len(made["ranks"]) == 2
    for rank, here in enumerate(made["ranks"]):
        assert here["replayed"] == expected_replays(mode, here["steps"], layers,
                                                    max(CAPTURE_SIZES)), (rank, here)
        assert here["replayed"].get("FULL", 0) >= MAX_TOKENS - 1, (rank, here)



@pytest.mark.timeout(600)
def test_moe_served_with_dp2_and_ep_answers_as_hf_with_an_idle_rank_in_lockstep():
    run = check_data_parallel(env={**os.environ, V2: "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
    note_printed_engines(run.stdout)
    assert '"model_runner": "V2"' in run.stdout, run.stdout
    assert "FULL_DECODE_ONLY: 4 of 4 answers close to HF transformers'" in run.stdout, run.stdout
    assert "a request pinned to DP rank 0, rank 1 idle: close to HF" in run.stdout, run.stdout
    ranks = re.findall(r"DP engine 0, TP rank (\d): captured (\{.*?\}), replayed (\{.*?\})",
                       run.stdout)
    captured, replayed = ast.literal_eval(ranks[0][1]), ast.literal_eval(ranks[0][2])
    assert set(captured) == {"FULL"} and captured["FULL"] > 0, run.stdout
    # the pinned request alone decodes MAX_TOKENS - 1 steps in FULL graphs on engine 0
    assert replayed.get("FULL", 0) >= 2 * (MAX_TOKENS - 1), run.stdout


# Sampling parameters, each run by V2's own kernels (penalties, min_p, logit bias and allowed
# tokens, min_tokens, bad words) on greedy requests, against V1's sampler on the same requests.
# min_tokens: token 100, biased to be chosen at every step, is also a stop token: the request
# stops at its first token without min_tokens, after six others with it. Bad words: two tokens
# the first prompt's plain greedy output writes (the test reads them from V1's run).
SAMPLING = {"repetition": dict(repetition_penalty=1.8),
            "frequency and presence": dict(frequency_penalty=1.5, presence_penalty=1.0),
            "min_p": dict(min_p=0.5),
            "logit bias": dict(logit_bias={200: 100.0}),
            "allowed tokens": dict(allowed_token_ids=list(range(50, 90))),
            "min_tokens": dict(min_tokens=6, stop_token_ids=[100], logit_bias={100: 50.0})}


def greedy_with(llm, kinds: list[dict]) -> list[list[list[int]]]:
    """Per kind of parameters, the tokens of each of PROMPTS, all in one batch."""
    from vllm import SamplingParams

    batch = [(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                     **kind)) for kind in kinds for prompt in PROMPTS]
    outs = llm.generate([p for p, _ in batch], [s for _, s in batch], use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n = len(PROMPTS)
    return [tokens[i * n:(i + 1) * n] for i in range(len(kinds))]


REGEX = "[a-c]{4}"
# V2 computes prompt logprobs from float32 logits, V1 (its log_softmax) likewise: measured worst
# difference 2.5e-6 on the tiny Llama (bf16), float32 summation order; the bound is 400 times it.
PROMPT_LOGPROB_TOLERANCE = 1e-3


def structured_and_prompt_logprobs(llm):
    """A greedy structured output (a regex) and the prompt logprobs of another request."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    outs = llm.generate(PROMPTS[:2], [
        SamplingParams(temperature=0, max_tokens=8,
                       structured_outputs=StructuredOutputsParams(regex=REGEX)),
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)], use_tqdm=False)
    return outs[0].outputs[0].text, [{t: lp.logprob for t, lp in step.items()} if step else None
                                     for step in outs[1].prompt_logprobs]


def sampled(llm, seed: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids)
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_sampling_parameters_give_v1s_tokens():
    """A batch mixing every kind of parameters, run by V1's sampler and by V2's kernels: the
    same tokens, each kind but min_p (greedy keeps the top token) changing them; a structured
    output and prompt logprobs as V1's; and V2's seeded sampling repeatable, another seed other
    tokens."""
    runs, kinds, others = {}, None, {}
    for name, enabled in (("V1", False), ("V2", True)):
        with runner_v2(enabled), engine(model_path("llama"), enforce_eager=True) as llm:
            runner = llm.collective_rpc(lambda worker: type(worker.model_runner).__name__)
            assert runner == ["NPUModelRunnerV2" if enabled else "NPUModelRunner"]
            if kinds is None:
                plain = greedy_with(llm, [{}])[0][0]
                bad = llm.get_tokenizer().decode(plain[2:4])
                kinds = [{}] + list(SAMPLING.values()) + [dict(bad_words=[bad])]
            runs[name] = greedy_with(llm, kinds)
            if enabled:  # V2's Gumbel-max sampling: a function of the seed
                seeded = [sampled(llm, seed) for seed in (7, 7, 8)]
            others[name] = structured_and_prompt_logprobs(llm)
    assert runs["V2"] == runs["V1"]
    (text, prompt), (v1_text, v1_prompt) = others["V2"], others["V1"]
    assert re.fullmatch(REGEX, text) and text == v1_text, (text, v1_text)
    assert [set(p or ()) for p in prompt] == [set(p or ()) for p in v1_prompt]
    worst = max(abs(lp - v1[t]) for p, v1 in zip(prompt, v1_prompt) if p for t, lp in p.items())
    assert worst < PROMPT_LOGPROB_TOLERANCE, worst
    assert seeded[0] == seeded[1] != seeded[2], seeded
    plain, *others = runs["V1"]
    changed = {name for name, out in zip([*SAMPLING, "bad words"], others) if out != plain}
    assert changed == {*SAMPLING, "bad words"} - {"min_p"}, changed  # (greedy keeps the top)
    stopped = others[list(SAMPLING).index("min_tokens")]
    assert [t[-1] for t in stopped] == [100] * len(PROMPTS), stopped
    assert [len(t) for t in stopped] == [7] * len(PROMPTS), stopped
