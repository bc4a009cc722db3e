"""vLLM's Model Runner V2 on the plugin with parallelism (the single-device checks:
test_model_runner_v2.py): Qwen3-MoE with expert parallelism at TP=2 (vLLM's multiprocessing
executor, a worker process a rank) close to HF transformers with the replays its steps call for
on both ranks, and served with DP=2 + EP (`VLLM_USE_V2_MODEL_RUNNER=1 python
scripts/check_data_parallel.py --mode FULL_DECODE_ONLY`): V2's DP padding and dummy steps in
lockstep, a request pinned to rank 0 while rank 1 idles. Their own module: the TP ranks open
devices 0 and 1, which an engine of another module's fixtures would hold."""

import ast
import os
import re

import pytest

from tests.e2e.cells import note_printed_engines
from tests.e2e.conftest import (check_logprobs_close, expected_replays, hf_greedy, MAX_TOKENS,
                                model_path, replays, vllm_greedy)
from tests.e2e.test_data_parallel import check_data_parallel
from tests.e2e.test_model_runner_v2 import (CAPTURE_SIZES, PROMPTS, V2, num_layers,
                                            v2_engine)

pytestmark = pytest.mark.slow  # (worker processes)


def test_moe_with_ep_at_tp2_is_close_to_hf_with_the_replays_its_steps_call_for():
    mode = "FULL_AND_PIECEWISE"
    with v2_engine("qwen3_moe", mode, tensor_parallel_size=2, enable_expert_parallel=True) as llm:
        with replays(llm) as made:
            outs = vllm_greedy(llm, PROMPTS, MAX_TOKENS)
        layers = num_layers(llm)
        runners = llm.collective_rpc(lambda worker: type(worker.model_runner).__name__)
    assert runners == ["NPUModelRunnerV2"] * 2
    for prompt, out in zip(PROMPTS, outs):
        check_logprobs_close(hf_greedy(model_path("qwen3_moe"), prompt, MAX_TOKENS), out,
                             f"V2 TP=2 EP {prompt!r}", dtype="float16")
    assert len(made["ranks"]) == 2
    for rank, here in enumerate(made["ranks"]):
        assert here["replayed"] == expected_replays(mode, here["steps"], layers,
                                                    max(CAPTURE_SIZES)), (rank, here)
        assert here["replayed"].get("FULL", 0) >= MAX_TOKENS - 1, (rank, here)



@pytest.mark.timeout(600)
def test_moe_served_with_dp2_and_ep_answers_as_hf_with_an_idle_rank_in_lockstep():
    run = check_data_parallel(env={**os.environ, V2: "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
    note_printed_engines(run.stdout)
    assert '"model_runner": "V2"' in run.stdout, run.stdout
    assert "FULL_DECODE_ONLY: 4 of 4 answers close to HF transformers'" in run.stdout, run.stdout
    assert "a request pinned to DP rank 0, rank 1 idle: close to HF" in run.stdout, run.stdout
    ranks = re.findall(r"DP engine 0, TP rank (\d): captured (\{.*?\}), replayed (\{.*?\})",
                       run.stdout)
    captured, replayed = ast.literal_eval(ranks[0][1]), ast.literal_eval(ranks[0][2])
    assert set(captured) == {"FULL"} and captured["FULL"] > 0, run.stdout
    # the pinned request alone decodes MAX_TOKENS - 1 steps in FULL graphs on engine 0
    assert replayed.get("FULL", 0) >= 2 * (MAX_TOKENS - 1), run.stdout
