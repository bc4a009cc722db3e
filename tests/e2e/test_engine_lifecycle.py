"""Two engines one after the other in one process: the first one's shutdown releases its graphs
and their streams, so the second, in another graph mode, captures with the device's whole
stream budget, and both answer like HF transformers. In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
where the graphs live in this process) and multiprocess."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.e2e.conftest import check_logprobs_close, hf_greedy, model_path

STREAMS = 12  # exactly what the second engine needs: 2 layers -> 3 pieces x 3 sizes + 3 FULL
PROMPT = "The capital of France is"
TOKENS = 8

SCRIPT = """
import gc, json, sys
from vllm import LLM, SamplingParams
from vllm_ascend import device


def run(mode):
    llm = LLM({model!r}, dtype="bfloat16", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=256, additional_config={{"graph_stream_reserve": 0}},
              compilation_config={{"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4]}})
    out = llm.generate([{prompt!r}], SamplingParams(temperature=0, max_tokens={tokens},
                                                    logprobs=5, ignore_eos=True), use_tqdm=False)
    out = out[0].outputs[0]
    counts = llm.collective_rpc(lambda worker: worker.model_runner.graph_state.counts())[0]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    print("RESULT", json.dumps({{
        "mode": mode, "tokens": list(out.token_ids),
        "logprobs": [{{str(t): lp.logprob for t, lp in step.items()}} for step in out.logprobs],
        "counts": counts, "streams_after_shutdown": device.current.streams_in_use()}}),
        flush=True)


if __name__ == "__main__":
    run("PIECEWISE")
    run("FULL_AND_PIECEWISE")
"""


@pytest.mark.parametrize("multiprocessing", ["0", "1"], ids=["in-process", "multiprocess"])
def test_two_engines_one_after_the_other_in_one_process(tmp_path, multiprocessing):
    script = tmp_path / "two_engines.py"
    script.write_text(SCRIPT.format(model=model_path("llama"), prompt=PROMPT, tokens=TOKENS))
    env = {**os.environ, "PYTHONPATH": ROOT, "VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing,
           "VLLM_ASCEND_SIM_STREAMS": str(STREAMS), "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)
    results = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == 2, proc.stderr[-3000:]
    first, second = results
    reference = hf_greedy(model_path("llama"), PROMPT, TOKENS)
    for r in results:
        got = (r["tokens"], [{int(t): lp for t, lp in step.items()} for step in r["logprobs"]])
        check_logprobs_close(reference, got, r["mode"])
        assert r["streams_after_shutdown"] == 0  # nothing of the engine's graphs is left
    assert first["counts"] == {"captured": {"PIECEWISE": 9}, "replayed": {"PIECEWISE": 21}}
    # The second engine had the whole budget: every one of its graphs was captured.
    assert second["counts"] == {"captured": {"PIECEWISE": 9, "FULL": 3}, "replayed": {"FULL": 7}}
    assert sum(second["counts"]["captured"].values()) == STREAMS
