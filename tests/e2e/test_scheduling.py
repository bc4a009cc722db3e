"""Batching, chunked prefill, prefix caching and bad input on one tiny-Llama engine."""

import pytest
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from tests.e2e.conftest import check_logprobs_close, engine, hf_greedy, model_path, vllm_greedy

FAMILY = "llama"
MAX_BATCHED = 64  # small, so that long prompts are prefilled in chunks


@pytest.fixture(scope="module")
def llm():
    with engine(model_path(FAMILY), enforce_eager=True, max_num_batched_tokens=MAX_BATCHED,
                max_model_len=512, enable_prefix_caching=True) as llm:
        yield llm


def prompt_of(n_words: int, seed: int) -> str:
    words = ["river", "stone", "light", "seven", "garden", "quiet", "north", "paper", "cloud"]
    return " ".join(words[(i * 7 + seed) % len(words)] for i in range(n_words))


def test_batch_of_mixed_prompt_lengths_equals_hf(llm):
    prompts = [prompt_of(n, s) for s, n in enumerate([1, 3, 9, 17, 30, 5])]
    path = model_path(FAMILY)
    for prompt, out in zip(prompts, vllm_greedy(llm, prompts, 12)):
        check_logprobs_close(hf_greedy(path, prompt, 12), out, f"mixed {prompt!r}")


def test_prompt_longer_than_max_num_batched_tokens_is_chunked_and_equals_hf(llm):
    prompt = prompt_of(150, 3)  # ~150 tokens over 64-token steps: three chunks
    tok = llm.get_tokenizer()
    assert len(tok(prompt).input_ids) > 2 * MAX_BATCHED
    out = vllm_greedy(llm, [prompt, prompt_of(4, 1)], 12)
    check_logprobs_close(hf_greedy(model_path(FAMILY), prompt, 12), out[0], "chunked")
    check_logprobs_close(hf_greedy(model_path(FAMILY), prompt_of(4, 1), 12), out[1], "beside chunked")


def test_repeated_prompt_hits_the_prefix_cache_with_the_same_output(llm):
    prompt = prompt_of(300, 5)  # more than two full 128-token blocks
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    assert second.num_cached_tokens >= 256
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    check_logprobs_close(hf_greedy(model_path(FAMILY), prompt, 10),
                    vllm_greedy(llm, [prompt], 10)[0], "prefix-cached")


def test_too_long_prompt_is_rejected_and_the_engine_keeps_serving(llm):
    too_long = prompt_of(700, 2)
    with pytest.raises(VLLMValidationError, match="maximum context length is 512 tokens"):
        llm.generate([too_long], SamplingParams(max_tokens=4), use_tqdm=False)
    prompt = prompt_of(6, 4)
    check_logprobs_close(hf_greedy(model_path(FAMILY), prompt, 8), vllm_greedy(llm, [prompt], 8)[0],
                    "after rejection")
