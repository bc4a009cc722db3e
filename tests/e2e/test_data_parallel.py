"""A mixture-of-experts model served with data parallelism in FULL_DECODE_ONLY, as a user checks
it: `python scripts/check_data_parallel.py --mode FULL_DECODE_ONLY` in a process of its own
(`vllm serve --data-parallel-size 2 --enable-expert-parallel`: an API server, two engine cores,
a worker each). Four concurrent answers and one pinned to rank 0 (rank 1 idle) close to HF
transformers, and DP engine 0's worker replays a FULL graph per decode step. FULL_AND_PIECEWISE
with DP: test_serve.py (DP=2 x TP=2) and test_defaults.py (DP=2 + EP with nothing else).

The same on a simulated A3 with a model of hidden size 1024, and with DP=2 x TP=2 in
FULL_AND_PIECEWISE: the MoE layers communicate by MC2 (npu_moe_distribute_dispatch_v2/
combine_v2) in the decode graphs, the piecewise graphs and small eager steps, the calls as
upstream's TokenDispatcherWithMC2 makes them."""

import ast
import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.e2e.cells import note_printed_engines
from tests.e2e.test_torch_npu_calls import MC2_TABLE, mismatches

# The full tier only: a served DP=2 engine (three processes importing vLLM).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKENS = 16  # the script's


def check_data_parallel(*args, mode="FULL_DECODE_ONLY", env=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "check_data_parallel.py"),
                           "--mode", mode, *args], capture_output=True, text=True, timeout=560,
                          env=env)


def test_moe_served_with_dp2_and_ep_in_full_decode_only_answers_as_hf_with_full_replays():
    run = check_data_parallel()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
    note_printed_engines(run.stdout)
    assert "FULL_DECODE_ONLY: 4 of 4 answers close to HF transformers'" in run.stdout, run.stdout
    assert "a request pinned to DP rank 0, rank 1 idle: close to HF" in run.stdout, run.stdout
    ranks = re.findall(r"DP engine 0, TP rank (\d): captured (\{.*?\}), replayed (\{.*?\})",
                       run.stdout)
    assert [r[0] for r in ranks] == ["0"], run.stdout
    captured, replayed = ast.literal_eval(ranks[0][1]), ast.literal_eval(ranks[0][2])
    assert set(captured) == {"FULL"} and captured["FULL"] > 0, run.stdout
    # the pinned request alone decodes TOKENS - 1 steps in FULL graphs on engine 0
    assert replayed.get("FULL", 0) >= 2 * (TOKENS - 1), run.stdout


# DP=2 in FULL_DECODE_ONLY; DP=2 x TP=2 (vLLM's sequence-parallel MoE: EP over DP x TP) in
# FULL_AND_PIECEWISE, whose piecewise graphs capture MC2 as well
@pytest.mark.parametrize("tp,mode", [("1", "FULL_DECODE_ONLY"), ("2", "FULL_AND_PIECEWISE")])
def test_mc2_on_a_simulated_a3_served_with_dp2_and_ep(tmp_path, tp, mode):
    log = tmp_path / "calls.jsonl"
    run = check_data_parallel("--family", "qwen3_moe_h1024", "--tensor-parallel-size", tp,
                              mode=mode, env={
        **os.environ, "VLLM_ASCEND_SIM_SOC": "Ascend910_9382",
        "VLLM_ASCEND_SIM_CALL_LOG": str(log)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
    note_printed_engines(run.stdout)
    assert f"{mode}: 4 of 4 answers close to HF transformers'" in run.stdout, run.stdout
    assert "a request pinned to DP rank 0, rank 1 idle: close to HF" in run.stdout, run.stdout
    steps = ast.literal_eval(re.search(r"steps by \(runtime mode, MoE communication\): (\{.*\})",
                                       run.stdout)[1])
    # every step is small (the largest capture size, 32, bounds MC2): decode graphs, piecewise
    # graphs and eager prefills alike run MC2
    assert {comm for _, comm in steps} == {"MC2"} and ("NONE", "MC2") in steps, steps
    assert steps[("FULL", "MC2")] >= 2 * (TOKENS - 1), steps
    replayed = ast.literal_eval(re.search(r"replayed (\{.*?\})", run.stdout)[1])
    assert replayed.get("FULL", 0) >= 2 * (TOKENS - 1), run.stdout
    # the calls made from Python (a replay's, logged "in": "graph", are the operator's own)
    calls = [c for c in map(json.loads, log.read_text().splitlines()) if c.get("in") != "graph"]
    made = {c["api"] for c in calls}
    assert set(MC2_TABLE) <= made, made
    problems = [p for c in calls if c["api"] in MC2_TABLE
                for p in mismatches(c["api"], c, *MC2_TABLE[c["api"]])]
    assert not problems, problems
