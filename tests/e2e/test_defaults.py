"""The first command, as a new user types it: `vllm serve <SmolLM2>` and `LLM(<SmolLM2>)` with
nothing else, in every graph mode, on the simulator's default device (a quarter of the host's
memory) with vLLM's defaults (capture sizes up to 512, max_num_seqs 256, max_model_len 8192,
gpu_memory_utilization 0.92); a MoE model served with DP=2 + EP and nothing else; and
`vllm-ascend plan` for each, against what its engine measured. (Slow: vLLM's defaults capture
up to 1616 graphs, 3-5 min an engine on the simulator.)"""

import json
import subprocess
import sys

import pytest

from tests.e2e.cells import note_engine
from tests.e2e.conftest import (check_logprobs_close, check_plan, check_printed_plan,
                                default_env, hf_greedy, model_path, plan_command,
                                served_completion, served_graph_counts, served_rpc, vllm_server)

# The full tier only: vLLM's defaults capture up to 1616 graphs an engine: 2-5 min each here.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = "The capital of France is"
TOKENS = 16
SMOLLM2 = model_path("smollm2")


def test_vllm_serve_with_defaults_answers_as_hf_with_graphs_replayed_as_planned():
    with vllm_server(SMOLLM2, None, defaults=True, start_s=900) as (base, log):
        assert "graph mode FULL_AND_PIECEWISE (configured FULL_AND_PIECEWISE)" in log
        before = served_graph_counts(base)[0]["replayed"]
        out = served_completion(base, SMOLLM2, PROMPT, TOKENS)
        check_logprobs_close(hf_greedy(SMOLLM2, PROMPT, TOKENS), out)
        after = served_graph_counts(base)[0]["replayed"]
        # the prefill in PIECEWISE graphs (its tokens fit the largest size), decode in FULL ones
        assert after.get("PIECEWISE", 0) - before.get("PIECEWISE", 0) == 31
        assert after.get("FULL", 0) - before.get("FULL", 0) == TOKENS - 1
        (figures,) = served_rpc(base, "startup_figures")
    assert figures["measured"]["graph_counts"] == {"PIECEWISE": 51 * 31, "FULL": 35}
    check_plan(figures, "vllm serve SmolLM2")
    check_printed_plan(plan_command(SMOLLM2, env=default_env()), figures)


LLM_SCRIPT = """
import json, sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    for mode in sys.argv[2].split(","):  # engines one after the other, as a user's script may
        llm = LLM(sys.argv[1], compilation_config={"cudagraph_mode": mode})
        params = SamplingParams(temperature=0, max_tokens=int(sys.argv[4]), logprobs=5,
                                ignore_eos=True)
        out = llm.generate([sys.argv[3]], params, use_tqdm=False)[0].outputs[0]
        print("RESULT", json.dumps({
            "mode": mode, "tokens": list(out.token_ids),
            "logprobs": [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs],
            "figures": llm.collective_rpc("startup_figures")[0],
            "counts": llm.collective_rpc("graph_counts")[0],
            "summary": llm.collective_rpc("summary")[0]}), flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm
"""
MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY"]


@pytest.fixture(scope="module")
def llm_runs() -> dict:
    """``LLM(SmolLM2)`` with defaults in each mode, one engine after the other in one script (a
    process importing vLLM costs about 20 s), each with its engine core in a process of its
    own, as users run it: mode -> its result, or the script's output if it has none."""
    run = subprocess.run([sys.executable, "-c", LLM_SCRIPT, SMOLLM2, ",".join(MODES), PROMPT,
                          str(TOKENS)], env=default_env(), capture_output=True, text=True,
                         timeout=1500)
    results = {r["mode"]: r for r in (json.loads(line.removeprefix("RESULT "))
                                      for line in run.stdout.splitlines()
                                      if line.startswith("RESULT "))}
    failure = f"exit {run.returncode}\n" + run.stdout[-2000:] + run.stderr[-4000:]
    return {mode: results.get(mode, failure) for mode in MODES}


@pytest.mark.timeout(1600)  # the first test waits for the four engines
@pytest.mark.parametrize("mode", MODES)
def test_llm_with_defaults_answers_as_hf_in_every_graph_mode(llm_runs, mode):
    result = llm_runs[mode]
    assert isinstance(result, dict), result
    out = (result["tokens"], [{int(t): lp for t, lp in step.items()}
                              for step in result["logprobs"]])
    check_logprobs_close(hf_greedy(SMOLLM2, PROMPT, TOKENS), out, mode)
    captured = {"NONE": {}, "PIECEWISE": {"PIECEWISE": 51 * 31}, "FULL": {"FULL": 51},
                "FULL_DECODE_ONLY": {"FULL": 35}}[mode]
    assert result["counts"]["captured"] == captured
    replayed = {"NONE": {}, "PIECEWISE": {"PIECEWISE": TOKENS * 31},
                "FULL": {"FULL": TOKENS}, "FULL_DECODE_ONLY": {"FULL": TOKENS - 1}}[mode]
    assert result["counts"]["replayed"] == replayed
    check_plan(result["figures"], mode)
    note_engine(result["summary"])


def test_a_moe_model_served_with_dp2_and_ep_and_nothing_else_answers():
    moe = model_path("qwen3_moe")
    with vllm_server(moe, None, "--data-parallel-size", "2", "--enable-expert-parallel",
                     defaults=True, start_s=600) as (base, log):
        out = served_completion(base, moe, PROMPT, TOKENS)
        check_logprobs_close(hf_greedy(moe, PROMPT, TOKENS), out)
        assert "graph mode FULL_AND_PIECEWISE" in log
        (figures,) = served_rpc(base, "startup_figures")  # DP engine 0's worker
        check_plan(figures, "DP=2 + EP", exact_streams=False)
        check_printed_plan(plan_command(moe, "--data-parallel-size", "2",
                                        "--enable-expert-parallel", env=default_env()), figures)
