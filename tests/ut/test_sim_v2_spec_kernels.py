"""The simulator's torch versions of Model Runner V2's speculative-decoding kernels
(device/sim/v2_spec_kernels.py) and its Gumbel-max sampling against vLLM's own Triton kernels,
run by Triton's CPU interpreter on the same inputs (v2_spec_kernels_against_triton.py, in a
process of its own: the interpreter must be on before Triton is imported): the rejection
sampler (greedy and sampled requests at once, one-hot drafts and the drafter's logits, synthetic
acceptance rates, fp32 and fp64 noise, placeholder drafts, two vocabulary blocks), the draft rows
it gathers, the sampled tokens it flattens, and the EAGLE/MTP drafter's prefill, decode and
per-step inputs. Every output must equal the kernels' bit for bit."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)
CASES = ["Gumbel-max draws, fp32", "Gumbel-max draws, fp64", "the drafter's draws",
         "greedy and sampled, one-hot drafts", "sampled with the drafter's logits",
         "synthetic acceptance rates", "fp64 Gumbel noise",
         "draft rows gathered, placeholders -1", "sampled tokens flattened",
         "draft prefill and decode inputs"]


@pytest.fixture(scope="module")
def compared() -> dict:
    root = os.path.dirname(os.path.dirname(HERE))
    run = subprocess.run([sys.executable, os.path.join(HERE, "v2_spec_kernels_against_triton.py")],
                         capture_output=True, text=True, timeout=240, cwd=root,
                         env={**os.environ, "PYTHONPATH": root})
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    return {line["case"]: line for line in lines}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_the_simulators_kernel_equals_vllms_triton_kernel(compared, case):
    assert case in compared, sorted(compared)
    assert compared[case]["same"], compared[case]["diff"]


def test_every_case_is_checked(compared):
    assert sorted(compared) == sorted(CASES)
