"""A mixture-of-experts model served with data parallelism in FULL_DECODE_ONLY, as a user checks
it: `python scripts/check_data_parallel.py --mode FULL_DECODE_ONLY` in a process of its own
(`vllm serve --data-parallel-size 2 --enable-expert-parallel`: an API server, two engine cores,
a worker each). Four concurrent answers and one pinned to rank 0 (rank 1 idle) close to HF
transformers, and DP engine 0's worker replays a FULL graph per decode step. FULL_AND_PIECEWISE
with DP: test_serve.py (DP=2 x TP=2) and test_defaults.py (DP=2 + EP with nothing else)."""

import ast
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.e2e.cells import note_printed_engines

# The full tier only: a served DP=2 engine (three processes importing vLLM).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKENS = 16  # the script's


def test_moe_served_with_dp2_and_ep_in_full_decode_only_answers_as_hf_with_full_replays():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "check_data_parallel.py"),
                          "--mode", "FULL_DECODE_ONLY"], capture_output=True, text=True,
                         timeout=560)
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
