"""docs/supported_models.md's table (scripts/coverage_table.py) and what each engine reports of
itself for it (vllm_ascend/worker/summary.py)."""

import json
import subprocess
import sys
from types import SimpleNamespace

from scripts import coverage_table
from tests.conftest import ROOT
from vllm_ascend.worker import summary


def run(test: str, mode: str, arch="LlamaForCausalLM", quant="none", layout="TP=1", spec=None,
        runner=None):
    cell = {"test": test, "architecture": arch, "quantization": quant, "layout": layout,
            "speculative": spec, "graph_mode": mode}
    return json.dumps(cell if runner is None else {**cell, "model_runner": runner})


def test_a_cell_names_the_modules_whose_passing_tests_ran_it():
    made = coverage_table.table([
        run("tests/e2e/test_graph_modes.py::test_a[x]", "FULL"),
        run("tests/e2e/test_families.py::test_b", "FULL"),
        run("tests/e2e/test_families.py::test_c", "FULL"),
        run("tests/e2e/test_parallel.py::test_d", "NONE", layout="TP=2", spec="eagle"),
        run("tests/e2e/test_model_runner_v2.py::test_e", "FULL", runner="V2"),
        run("tests/e2e/test_families.py::test_f", "FULL", runner="V1")])
    rows = made.splitlines()[2:]
    assert rows == [  # (results without a runner are V1's)
        "| LlamaForCausalLM | none | TP=1 | — | V1 | — | — | families, graph_modes | — | — |",
        "| LlamaForCausalLM | none | TP=1 | — | V2 | — | — | model_runner_v2 | — | — |",
        "| LlamaForCausalLM | none | TP=2 | eagle | V1 | parallel | — | — | — | — |"]


def test_the_check_fails_unless_the_docs_show_exactly_what_the_run_proved(tmp_path):
    first = run("tests/e2e/test_graph_modes.py::test_a", "FULL")
    second = run("tests/e2e/test_moe.py::test_b", "NONE", arch="Qwen3MoeForCausalLM")
    doc = tmp_path / "supported_models.md"
    doc.write_text(f"# Title\n\n{coverage_table.BEGIN}\n{coverage_table.END}\n")
    results = tmp_path / "cells.jsonl"

    def script(*args):
        return subprocess.run([sys.executable, "scripts/coverage_table.py", "--doc", str(doc),
                               *args, str(results)], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)

    results.write_text(first + "\n" + second + "\n")
    assert script().returncode == 0  # rewrites the table
    assert script("--check").returncode == 0
    assert doc.read_text().startswith("# Title\n\n")
    results.write_text(first + "\n")
    check = script("--check")
    assert check.returncode == 1
    assert "in the docs, not proved: | Qwen3MoeForCausalLM | none | TP=1 | — | V1 | moe |" in \
        check.stderr
    results.write_text(first + "\n" + second + "\n" + run("tests/e2e/test_moe.py::c", "FULL"))
    check = script("--check")
    assert check.returncode == 1 and "proved, not in the docs: | LlamaForCausalLM" in check.stderr


def test_an_engine_reports_its_quantization_and_layout():
    parallel = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1,
                               data_parallel_size=2, enable_expert_parallel=True)
    assert summary.layout(parallel) == "TP=2 DP=2 EP"
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=2,
                               data_parallel_size=1, enable_expert_parallel=False)
    assert summary.layout(parallel) == "PP=2"
    description = {"model.layers.0.mlp.down_proj.weight": "W8A8",
                   "model.layers.1.mlp.down_proj.weight": "W8A8_DYNAMIC",
                   "model.layers.1.mlp.experts.0.down_proj.weight": "FLOAT",
                   "model.layers.0.mlp.down_proj.input_scale": "W8A8"}
    config = SimpleNamespace(model_config=SimpleNamespace(quantization="ascend"),
                             quant_config=SimpleNamespace(description=description))
    assert summary.quantization(config) == "ModelSlim W8A8+W8A8_DYNAMIC"
    config = SimpleNamespace(model_config=SimpleNamespace(quantization=None), quant_config=None)
    assert summary.quantization(config) == "none"
