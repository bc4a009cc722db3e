"""vLLM's multiprocessing executor (its default on one node) with pipeline parallelism, as a user
checks a layout: `python scripts/check_parallel.py --pipeline-parallel-size 2 --modes
FULL_DECODE_ONLY` in a process of its own, whose engine core starts a worker process per stage.
Greedy output close to HF transformers, and both stages replay the same FULL graphs (they run
every step together). Tensor parallelism on this executor: test_serve.py (DP=2 x TP=2); PP on
Ray: test_parallel.py."""

import ast
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.e2e.cells import note_printed_engines
from tests.e2e.conftest import MAX_TOKENS, PROMPTS

# The full tier only: a process that imports vLLM, and two worker processes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_pipeline_parallel_on_the_multiprocessing_executor_replays_on_both_stages():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "check_parallel.py"),
                          "--pipeline-parallel-size", "2", "--modes", "FULL_DECODE_ONLY"],
                         capture_output=True, text=True, timeout=560)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
    note_printed_engines(run.stdout)
    n = len(PROMPTS)
    assert f"FULL_DECODE_ONLY: {n} of {n} answers close to HF transformers'" in run.stdout, \
        run.stdout
    ranks = re.findall(r"rank (\d): captured (\{.*?\}), replayed (\{.*?\})", run.stdout)
    assert [r[0] for r in ranks] == ["0", "1"], run.stdout
    captured = [ast.literal_eval(r[1]) for r in ranks]
    replayed = [ast.literal_eval(r[2]) for r in ranks]
    assert captured[0] == captured[1] == {"FULL": 3}, run.stdout  # sizes 1, 2 and 4
    # A decode step per token after the prefill, for the batch of prompts, on both stages.
    assert replayed[0] == replayed[1] and replayed[0]["FULL"] >= MAX_TOKENS - 1, run.stdout
