"""`vllm serve` with SmolLM2 on 127.0.0.1 (its default bf16): the OpenAI endpoints answer as HF
transformers does, under the logprob-closeness rule, through the plugin."""

import os
import socket
import subprocess
import sys
import time

import pytest
import requests
import transformers

from scripts.models import smollm2_dir
from tests.e2e.conftest import TOPK, check_logprobs_close, hf_greedy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    model = str(smollm2_dir())
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"vllm-serve-{port}.log"), "w+")
    cmd = [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", model,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024",
           "--max-num-seqs", "16",  # fewer capture sizes: start-up in seconds, not minutes
           "--served-model-name", "smollm2", "--seed", "0"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "VLLM_ASCEND_SIM_MEMORY_GB": "2"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read()[-4000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(1)
        else:
            pytest.fail("vllm serve did not become healthy in 300 s")
        log.seek(0)
        yield base, log.read()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_server_runs_on_the_ascend_plugin(server):
    _, startup_log = server
    assert "vllm-ascend: device backend sim" in startup_log


def completion(base, prompt, max_tokens):
    """(tokens, [top-k {token: logprob}]) of a greedy /v1/completions answer."""
    r = requests.post(f"{base}/v1/completions", timeout=120, json={
        "model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": TOPK, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return ([token_id(t) for t in lp["tokens"]],
            [{token_id(t): v for t, v in top.items()} for top in lp["top_logprobs"]])


def token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


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
