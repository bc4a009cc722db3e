"""A user's script, fed on standard input (``python - <<EOF``): engines one after the other in one
process. The first one's shutdown releases its graphs and their streams, so the second, in
another graph mode, captures with the device's whole stream budget (both in-process,
VLLM_ENABLE_V1_MULTIPROCESSING=0, where the graphs live in the script's process); a third, with
its engine core in a process of its own as users run it, starts after torch has run in the
script, although a spawned process cannot re-run a script read from standard input, and is left
to the interpreter's exit, which must not be reported as an engine failure. All three answer like
HF transformers."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.e2e.conftest import check_logprobs_close, hf_greedy, model_path

# The full tier only: a user's script in its own process, three engines.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(700)]

STREAMS = 12  # exactly what the second engine needs: 2 layers -> 3 pieces x 3 sizes + 3 FULL
PROMPT = "The capital of France is"
TOKENS = 8

SCRIPT = """
import gc, json, os
from vllm import LLM, SamplingParams, envs
from vllm_ascend import device



def run(mode, multiprocess):
    envs.disable_envs_cache()  # an in-process engine core caches vLLM's environment
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    llm = LLM({model!r}, dtype="bfloat16", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=256, additional_config={{"graph_stream_reserve": 0}},
              compilation_config={{"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4]}})
    out = llm.generate([{prompt!r}], SamplingParams(temperature=0, max_tokens={tokens},
                                                    logprobs=5, ignore_eos=True), use_tqdm=False)
    out = out[0].outputs[0]
    result = {{"mode": mode, "tokens": list(out.token_ids),
               "logprobs": [{{str(t): lp.logprob for t, lp in step.items()}}
                            for step in out.logprobs],
               "counts": llm.collective_rpc("graph_counts")[0]}}
    if not multiprocess:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        result["streams_after_shutdown"] = device.current.streams_in_use()
    print("RESULT", json.dumps(result), flush=True)
    return llm if multiprocess else None


if __name__ == "__main__":
    run("PIECEWISE", multiprocess=False)
    run("FULL_AND_PIECEWISE", multiprocess=False)
    llm = run("FULL_AND_PIECEWISE", multiprocess=True)  # left to the interpreter's exit
"""


def test_engines_one_after_the_other_in_a_script_on_standard_input():
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}  # a user's
    env.update(PYTHONPATH=ROOT, VLLM_ASCEND_SIM_STREAMS=str(STREAMS))
    script = SCRIPT.format(model=model_path("llama"), prompt=PROMPT, tokens=TOKENS)
    proc = subprocess.run([sys.executable, "-"], cwd=ROOT, input=script, capture_output=True,
                          text=True, timeout=600, env=env)
    results = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and len(results) == 3, log[-4000:]
    reference = hf_greedy(model_path("llama"), PROMPT, TOKENS)
    for r in results:
        got = (r["tokens"], [{int(t): lp for t, lp in step.items()} for step in r["logprobs"]])
        check_logprobs_close(reference, got, r["mode"])
    first, second, third = (r["counts"] for r in results)
    assert first["captured"] == {"PIECEWISE": 9} and first["replayed"] == {"PIECEWISE": 21}
    assert results[0]["streams_after_shutdown"] == 0  # nothing of its graphs is left
    # The second engine had the whole budget: every one of its graphs was captured.
    assert second["captured"] == {"PIECEWISE": 9, "FULL": 3}
    assert second["replayed"] == {"FULL": 7} and second["streams_in_use"] == STREAMS
    assert results[1]["streams_after_shutdown"] == 0
    assert third["captured"] == second["captured"] and third["replayed"] == {"FULL": 7}
    assert "the main script is <stdin>" in log  # the platform's log line
    assert "exited unexpectedly" not in log and "Traceback" not in log, log[-4000:]
