"""Sleep mode as RL loops use it, on the tiny Llama in graph modes: generate, sleep(1), wake up
and generate the same; sleep(2), wake the weights, load another model's weights in place, wake
the KV cache and generate as that model does. The graphs captured at start-up replay after each
wake-up and none is captured again (the memory comes back at the same addresses); the simulated
device's memory shows the weights and KV cache gone while asleep. (The server endpoints:
test_serve.py; a replay of sleeping memory: tests/ut/test_sim_vmm.py.)"""

import pytest

from tests.e2e.conftest import (PROMPTS, QUANTIZED, check_logprobs_close, engine,
                                expected_replays, graph_counts, hf_greedy, model_path, replays,
                                vllm_greedy)
from scripts.models import quantized_model_dir, tiny_model_dir

TOKENS = 8
CAPTURE_SIZES = [1, 2, 4]
LAYERS = 2
# Every mode: each captures other graphs (pieces, FULL graphs of mixed or decode batches, or
# none) that must read the memory sleep gave back at the same addresses.
# The quick tier keeps FULL_AND_PIECEWISE (vLLM's default); the others run in the full tier.
MODES = [pytest.param(m, marks=pytest.mark.slow)
         for m in ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY")] + ["FULL_AND_PIECEWISE"]


def generate(llm, mode: str) -> list:
    with replays(llm) as made:
        outs = vllm_greedy(llm, PROMPTS, TOKENS)
    assert made["replayed"] == expected_replays(mode, made["steps"], LAYERS,
                                                max(CAPTURE_SIZES)), made
    assert mode == "NONE" or made["replayed"], made
    return outs


def check_asleep(asleep: dict, awake: dict, level: int) -> None:
    """Weights and KV cache hold no device memory: what is in use fell by at least both (the
    workers' device_memory). Level 1 keeps the weights in host memory, level 2 nothing of them
    (and neither level the KV cache)."""
    pools, was = asleep["sleep_mode"], awake["sleep_mode"]
    copies = asleep["host_copies"]
    assert "kv_cache" not in copies and copies.get("weights", 0) == \
        (was["weights"]["mapped"] if level == 1 else 0), (level, copies)
    for tag in ("weights", "kv_cache"):
        assert pools[tag] == {"mapped": 0, "asleep": was[tag]["mapped"]} and \
            was[tag]["mapped"] > 0, (tag, asleep)
    assert asleep["in_use"] <= \
        awake["in_use"] - was["weights"]["mapped"] - was["kv_cache"]["mapped"], (awake, asleep)


@pytest.mark.parametrize("mode", MODES)
def test_sleep_wake_and_new_weights_replay_the_same_graphs(mode):
    other = tiny_model_dir("llama", seed=4321)  # the same shapes, other weights
    with engine(model_path("llama"), enable_sleep_mode=True, max_num_seqs=8,
                compilation_config={"cudagraph_mode": mode,
                                    "cudagraph_capture_sizes": CAPTURE_SIZES}) as llm:
        first = generate(llm, mode)
        captured = graph_counts(llm)["captured"]
        awake = llm.collective_rpc("device_memory")[0]

        llm.sleep(level=1)  # weights to host memory, KV cache discarded
        check_asleep(llm.collective_rpc("device_memory")[0], awake, level=1)
        llm.wake_up()
        assert generate(llm, mode) == first  # the same weights, byte for byte

        llm.sleep(level=2)  # both discarded
        check_asleep(llm.collective_rpc("device_memory")[0], awake, level=2)
        llm.wake_up(tags=["weights"])
        llm.collective_rpc("reload_weights", kwargs={"weights_path": other})
        llm.wake_up(tags=["kv_cache"])
        for prompt, out in zip(PROMPTS, generate(llm, mode)):
            check_logprobs_close(hf_greedy(other, prompt, TOKENS), out, f"reloaded {prompt!r}")
        assert graph_counts(llm)["captured"] == captured  # nothing captured again
        # All mapped again, as much as before (the process's heap holds the HF reference now).
        assert llm.collective_rpc("device_memory")[0]["sleep_mode"] == awake["sleep_mode"]


# Weights the plugin changes after loading, which a reload must refill where they are (the
# captured graphs read those addresses): a static W8A8 export's per-channel activation scale and
# offset, a dynamic export's transposed weights, MLA's contiguous W_UK_T and W_UV.
RELOADED = {
    "llama-w8a8": lambda: quantized_model_dir(*QUANTIZED["llama-w8a8"], seed=4321),
    "llama-w8a8-dynamic": lambda: quantized_model_dir(*QUANTIZED["llama-w8a8-dynamic"],
                                                      seed=4321),
    "deepseek_v2": lambda: tiny_model_dir("deepseek_v2", seed=4321),
}


@pytest.mark.parametrize("family", list(RELOADED))
def test_weights_derived_at_load_are_refilled_in_place_by_a_reload(family):
    other = RELOADED[family]()
    with engine(model_path(family), enable_sleep_mode=True, max_num_seqs=8,
                compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE",
                                    "cudagraph_capture_sizes": CAPTURE_SIZES}) as llm:
        generate(llm, "FULL_AND_PIECEWISE")
        captured = graph_counts(llm)["captured"]
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        llm.collective_rpc("reload_weights", kwargs={"weights_path": other})
        llm.wake_up(tags=["kv_cache"])
        for prompt, out in zip(PROMPTS, generate(llm, "FULL_AND_PIECEWISE")):
            check_logprobs_close(hf_greedy(other, prompt, TOKENS), out, f"reloaded {prompt!r}")
        assert graph_counts(llm)["captured"] == captured


def test_reloading_moe_experts_in_place_is_refused_not_wrong():
    """MoE experts are stored transposed in new memory after loading (the graphs read that
    copy): a reload would leave the graphs on the old experts, so it is refused, naming why."""
    with engine(model_path("qwen3_moe"), enable_sleep_mode=True, max_num_seqs=8,
                compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE",
                                    "cudagraph_capture_sizes": CAPTURE_SIZES}) as llm:
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        with pytest.raises(Exception, match="cannot reload MoE expert weights in place yet"):
            llm.collective_rpc("reload_weights",
                               kwargs={"weights_path": tiny_model_dir("qwen3_moe", seed=4321)})
