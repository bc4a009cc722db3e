"""Every test has a time limit (pyproject.toml): a hanging test fails with its name and the run
goes on to the next test."""

import os
import pathlib
import subprocess
import sys
import time
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]

HANGS = '''
import threading

def test_that_hangs():
    threading.Event().wait()  # never set: a collective whose peer never comes

def test_after_it():
    pass
'''


def test_the_project_sets_a_time_limit_for_every_test():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["timeout"] > 0 and options["timeout_method"] == "signal"


def test_a_hanging_test_fails_with_its_name_within_its_limit_and_the_run_goes_on(tmp_path):
    (tmp_path / "test_hang.py").write_text(HANGS)
    start = time.monotonic()
    # The project's settings, with the limit lowered from its default to 3 s.
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "-o", "timeout=3",
         str(tmp_path / "test_hang.py")],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": ""})
    took = time.monotonic() - start
    assert "FAILED" in run.stdout and "test_hang.py::test_that_hangs" in run.stdout, run.stdout
    assert "Timeout (>3.0s)" in run.stdout, run.stdout
    assert "1 failed, 1 passed" in run.stdout, run.stdout
    assert took < 30, took
