"""Served throughput, checked as ratios measured in one run (issue 72): `vllm serve` in the
default graph mode and with --enforce-eager, one server at a time, under vLLM's own client
(`vllm bench serve`'s function), and the offline decode step at the batch the server ran, in
engines made after the servers stopped (benchmarks/serve_throughput.py's measure, on a smaller
load). Absolute times differ between machines; the ratios of one run do not, or much less.

- Serving adds at most a measured multiple to a decode step: the served mean TPOT over the
  offline step of the same mode at the same batch. What serving adds beyond the step (the
  prefills of arriving requests, the API server's work on the same two cores) is bounded; a
  cost that only a served step pays (a per-step host sync, a log, a copy of the whole batch's
  state) raises the ratio.
- The default graph mode serves no slower than eager, within the measured noise.

A slow-down that served and offline steps share (09e93d8's conversion of every weight at every
product of 9 rows or more) moves neither ratio: tests/ut/test_sim_matmul.py counts the
conversions, and benchmarks/serve_throughput.py measures the figures (docs/performance.md)."""

import pytest

from benchmarks.serve_throughput import measure
from tests.e2e.conftest import model_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FAMILY = "llama"  # the tiny Llama: its steps are the engine's overhead, which serving adds to
LOAD = dict(prompts=16, concurrency=8, input_len=64, output_len=32)
# Measured on a 2-core AVX2 EPYC, 7 December, two runs of this load: served TPOT over the
# offline step 1.88-2.04 in graph mode, 1.80-1.96 eager; graph over eager 0.92-1.08x (a tiny
# model's steps are a few ms of overhead, which the API server's and the client's work on the
# same cores blurs). The bounds leave half the worst again, and 0.07 under the worst ratio.
MAX_TPOT_OVER_STEP = 3.0
MIN_GRAPH_OVER_EAGER = 0.85


@pytest.fixture(scope="module")
def figures() -> dict:
    return measure(model_path(FAMILY), **LOAD)


def test_every_request_is_served_and_decode_steps_replay_full_graphs(figures):
    for mode in ("graph", "eager"):
        (served,) = figures[mode]["served"]
        assert (served["completed"], served["failed"]) == (LOAD["prompts"], 0)
        assert served["total_output_tokens"] == LOAD["prompts"] * LOAD["output_len"]
    # Each wave of requests decodes output_len - 1 steps without a prefill beside it (62 of a
    # run's steps measured): each a FULL graph replayed.
    assert figures["graph"]["replayed"][0] >= LOAD["output_len"] - 1
    assert figures["eager"]["replayed"][0] == 0


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_serving_adds_at_most_a_measured_multiple_to_the_offline_step(figures, mode):
    (served,) = figures[mode]["served"]
    ratio = served["mean_tpot_ms"] / figures[mode]["step_ms"]
    assert ratio <= MAX_TPOT_OVER_STEP, (
        f"{mode}: served TPOT {served['mean_tpot_ms']:.1f} ms is {ratio:.2f}x the offline step "
        f"({figures[mode]['step_ms']:.1f} ms at batch {LOAD['concurrency']})")


def test_the_default_graph_mode_serves_no_slower_than_eager(figures):
    graph, eager = (figures[m]["served"][0]["output_throughput"] for m in ("graph", "eager"))
    assert graph >= MIN_GRAPH_OVER_EAGER * eager, (
        f"graph mode {graph:.1f} tok/s, eager {eager:.1f}: {graph / eager:.2f}x")
