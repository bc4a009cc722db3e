"""What each test's engines ran, for docs/supported_models.md.

Every engine the e2e helpers start (conftest's engine() and vllm_server(), and the scripts and
processes the tests run) is counted with its NPUWorker.summary: architecture, quantization,
layout, speculative method, graph mode in effect. For a test that passes, the conftest writes
them as JSON lines to $VLLM_ASCEND_TEST_CELLS (the full tier: results/cells.jsonl), from which
scripts/coverage_table.py makes the coverage table. One module, imported under one name, so
that pytest's conftest and the tests' imports of it share the record."""

import json
import os

CELLS_ENV = "VLLM_ASCEND_TEST_CELLS"
_ran: list[dict] = []


def new_test() -> None:
    _ran.clear()


def note_engine(summary: dict) -> dict:
    """Count an engine's ``summary`` among what the running test proves; returns it."""
    if summary not in _ran:
        _ran.append(summary)
    return summary


def note_printed_engines(text: str) -> None:
    """note_engine for each ``engine: {summary}`` line a script printed (scripts/check_*.py)."""
    for line in text.splitlines():
        if line.startswith("engine: {"):
            note_engine(json.loads(line.removeprefix("engine: ")))


def write_passed(item) -> None:
    """Append what the passed test ``item`` ran: the engines it started, and those of the
    module's fixtures it uses (an LLM with ``ascend_summary``)."""
    path = os.environ.get(CELLS_ENV)
    if not path:
        return
    for value in getattr(item, "funcargs", {}).values():
        if hasattr(value, "ascend_summary"):
            note_engine(value.ascend_summary)
    lines = "".join(json.dumps({"test": item.nodeid, **summary}) + "\n" for summary in _ran)
    if lines:
        with open(path, "a") as f:
            f.write(lines)
