"""`vllm serve` with SmolLM2 on 127.0.0.1: the OpenAI endpoints answer, through the plugin."""

import os
import socket
import subprocess
import sys
import time

import pytest
import requests

from scripts.models import smollm2_dir


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


def test_completions_endpoint_answers(server):
    base, _ = server
    r = requests.post(f"{base}/v1/completions", timeout=120, json={
        "model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0})
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["text"]


def test_chat_completions_endpoint_answers(server):
    base, _ = server
    r = requests.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_bad_request_gets_an_error_and_the_server_keeps_serving(server):
    base, _ = server
    r = requests.post(f"{base}/v1/completions", timeout=60, json={
        "model": "smollm2", "prompt": "word " * 2000, "max_tokens": 4})
    assert r.status_code == 400
    assert "maximum" in r.text.lower() or "context length" in r.text.lower()
    r = requests.post(f"{base}/v1/completions", timeout=120, json={
        "model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"]
