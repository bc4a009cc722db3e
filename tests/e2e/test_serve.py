"""`vllm serve` with SmolLM2 on 127.0.0.1 (its default bf16): the OpenAI endpoints answer as HF
transformers does, under the logprob-closeness rule, through the plugin."""

import pytest
import requests
import transformers

from scripts.models import smollm2_dir
from tests.e2e.conftest import (TOPK, check_logprobs_close, hf_greedy, served_completion,
                                token_id, vllm_server)


@pytest.fixture(scope="module")
def server():
    with vllm_server(str(smollm2_dir()), "smollm2", "--max-model-len", "1024",
                     "--max-num-seqs", "16") as served:  # fewer capture sizes: a faster start
        yield served


def test_server_runs_on_the_ascend_plugin(server):
    _, startup_log = server
    assert "vllm-ascend: device backend sim" in startup_log


def completion(base, prompt, max_tokens):
    return served_completion(base, "smollm2", prompt, max_tokens)


def test_completions_endpoint_answers_as_hf_transformers(server):
    base, _ = server
    prompt = "The capital of France is"
    check_logprobs_close(hf_greedy(str(smollm2_dir()), prompt, 16), completion(base, prompt, 16),
                         "completions")


def test_chat_completions_endpoint_answers_as_hf_transformers(server):
    base, _ = server
    messages = [{"role": "user", "content": "What is the capital of Japan?"}]
    r = requests.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "max_tokens": 16, "temperature": 0, "ignore_eos": True,
        "messages": messages, "logprobs": True, "top_logprobs": TOPK,
        "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    answer = ([token_id(c["token"]) for c in content],
              [{token_id(t["token"]): t["logprob"] for t in c["top_logprobs"]} for c in content])
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir())
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = getattr(prompt_ids, "input_ids", prompt_ids)
    check_logprobs_close(hf_greedy(str(smollm2_dir()), tuple(prompt_ids), 16), answer, "chat")


def test_bad_request_gets_an_error_and_the_server_keeps_serving(server):
    base, _ = server
    r = requests.post(f"{base}/v1/completions", timeout=60, json={
        "model": "smollm2", "prompt": "word " * 2000, "max_tokens": 4})
    assert r.status_code == 400
    assert "maximum" in r.text.lower() or "context length" in r.text.lower()
    prompt = "The capital of France is"
    check_logprobs_close(hf_greedy(str(smollm2_dir()), prompt, 8), completion(base, prompt, 8),
                         "after a bad request")
