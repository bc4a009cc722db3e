"""A user's machine is not warm: an empty model cache, no environment variables of ours, torch
already busy in the process that creates the engine (vLLM forks by default)."""

import os
import subprocess
import sys
import textwrap

from scripts.demo import EXPECTED
from tests.conftest import ROOT
from tests.e2e.conftest import model_path

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
    assert "start with 'spawn'" in proc.stdout + proc.stderr  # the platform's log line


def test_a_script_that_ran_torch_before_creating_the_engine_completes(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(f"""
        import torch
        from vllm import LLM, SamplingParams

        if __name__ == "__main__":
            a = torch.randn(2000, 2000)
            print("warm-up", float((a @ a).sum()) != 0)  # torch's OpenMP pool is now live
            llm = LLM({model_path("llama")!r}, enforce_eager=True, max_model_len=256,
                      max_num_seqs=4)
            out = llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True))
            print("generated", len(out[0].outputs[0].token_ids), "tokens")
            llm.llm_engine.engine_core.shutdown()
    """))
    proc = run([sys.executable, str(script)], newcomer_env(), "a user script")
    assert "generated 4 tokens" in proc.stdout
