"""A user's machine is not warm: an empty model cache, no environment variables of ours, torch
already busy in the process that creates the engine (vLLM forks by default). (A script fed on
standard input that leaves its LLM to the interpreter's exit: test_engine_lifecycle.py.)"""

import os
import subprocess
import sys

from scripts import demo
from scripts.demo import EXPECTED
from tests.conftest import ROOT
from tests.e2e.conftest import in_process

BOUND_S = 600  # the demo takes about 2 minutes on a 2-core machine, conversion included


def newcomer_env(**extra) -> dict:
    """This process's environment without any VLLM_* setting (the tests' own included)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(extra, PYTHONPATH=ROOT)
    return env


def run(cmd, env, label):
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=BOUND_S)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-3000:]
        raise AssertionError(f"{label} did not finish in {BOUND_S} s (a hang?):\n{tail}") from e
    assert proc.returncode == 0, f"{label} exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc


def test_demo_on_an_empty_model_cache_prints_the_expected_answers(tmp_path):
    # The demo's own entry point: the GGUF conversion (torch work) and the engine in one process.
    proc = run([sys.executable, "scripts/demo.py"], newcomer_env(VLLM_ASCEND_CACHE=str(tmp_path)),
               "the demo")
    for question, answer in EXPECTED.items():
        assert f"Q: {question}\nA: {answer}\n" in proc.stdout, proc.stdout
    assert f"{len(EXPECTED)} of {len(EXPECTED)} answers as expected" in proc.stdout
    assert (tmp_path / "models" / "SmolLM2-135M-Instruct" / "config.json").exists()
    log = proc.stdout + proc.stderr
    assert "start with 'spawn'" in log  # the platform's log line
    assert "exited unexpectedly" not in log and "Traceback" not in log, log[-3000:]


def test_demo_with_enforce_eager_answers_without_graphs(capsys):
    with in_process():  # the demo's own main(), its engine core in this process
        assert demo.main(["--enforce-eager"]) == 0
    out = capsys.readouterr().out
    assert "graph mode: NONE" in out and f"{len(EXPECTED)} of {len(EXPECTED)} answers" in out
