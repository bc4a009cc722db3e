"""FULL graphs where they are hardest: mixed prefill/decode steps, a full batch (in FULL and in
FULL_DECODE_ONLY), and the stale-length bug the FIA update prevents. (Chunked prefill and prefix
caching in graph mode: test_request_classes.py.)"""

import pytest

from tests.e2e.conftest import (check_logprobs_close, engine, expected_replays, hf_greedy,
                                model_path, replays, vllm_greedy)

FAMILY = "llama"
LAYERS = 2  # the tiny models'


def words(n, seed):
    pool = ["amber", "brook", "cedar", "delta", "ember", "fjord", "grove", "haven", "isle"]
    return " ".join(pool[(i * 5 + seed) % len(pool)] for i in range(n))


def equal_hf(llm, prompts, n, label, mode, max_size) -> dict:
    """Greedy output close to HF's, and exactly the replays the steps call for."""
    with replays(llm) as made:
        outs = vllm_greedy(llm, prompts, n)
    for prompt, out in zip(prompts, outs):
        check_logprobs_close(hf_greedy(model_path(FAMILY), prompt, n), out,
                             f"{label} {prompt[:30]!r}")
    assert made["replayed"] == expected_replays(mode, made["steps"], LAYERS, max_size), made
    return made


@pytest.fixture(scope="module")
def full_llm():
    # max_num_batched_tokens 32: a long prompt is prefilled in chunks while the short ones
    # decode, so steps mix prefill and decode, and every step fits the 32-token FULL graph.
    with engine(model_path(FAMILY), max_num_seqs=8, max_num_batched_tokens=32,
                enable_prefix_caching=True, compilation_config={
                    "cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}
                ) as llm:
        yield llm


def test_mixed_prefill_and_decode_steps_replay_full_graphs(full_llm):
    prompts = [words(3, 1), words(90, 2), words(5, 3)]
    made = equal_hf(full_llm, prompts, 12, "FULL mixed", "FULL", 32)
    # Every step fits the largest graph, so every step, mixed ones included, replays one.
    assert made["replayed"] == {"FULL": len(made["steps"])}
    assert any(tokens > reqs for tokens, reqs in made["steps"][1:]), "no mixed step"


def test_full_batch_of_different_lengths(full_llm):
    prompts = [words(n, n) for n in (1, 2, 3, 4, 5, 6, 7, 8)]  # num_reqs == max_num_seqs
    made = equal_hf(full_llm, prompts, 10, "FULL full batch", "FULL", 32)
    assert (8, 8) in made["steps"]  # a full batch of decodes: the dummy request has no row


def skip_fia_update(record_events: bool):
    """A worker-side change for the negative tests: FULL replays without the per-step task
    updates of their attention lengths (recording each layer's event, or not even that)."""

    def install(worker):
        fia = worker.model_runner.graph_state.fia

        def no_update(key, metadata):
            if record_events:
                for call in fia.calls[key]:
                    call.event.record()

        fia.update = no_update

    return install


def restore_fia_update(worker):
    del worker.model_runner.graph_state.fia.update  # the class's method again


def decode_only_engine():
    return engine(model_path(FAMILY), max_num_seqs=4, compilation_config={
        "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]})


@pytest.fixture(scope="module")
def decode_only_llm():
    with decode_only_engine() as llm:
        yield llm


def test_full_batch_in_full_decode_only(decode_only_llm):
    prompts = [words(n, n) for n in (2, 4, 6, 8)]  # num_reqs == max_num_seqs == largest size
    made = equal_hf(decode_only_llm, prompts, 10, "FULL_DECODE_ONLY full batch",
                    "FULL_DECODE_ONLY", 4)
    assert made["replayed"] == {"FULL": 9} and (4, 4) in made["steps"], made


def test_without_the_fia_update_full_graphs_replay_stale_lengths(decode_only_llm):
    """The chip's stale-parameter bug, reproduced: the same FULL graphs, with each layer's event
    recorded but no task update, attend over the capture's lengths and the tokens go wrong;
    with the update (the tests above) they are close to HF."""
    prompt = words(6, 7)
    decode_only_llm.collective_rpc(skip_fia_update(record_events=True))
    try:
        with replays(decode_only_llm) as made:
            got = vllm_greedy(decode_only_llm, [prompt], 12)[0]
    finally:
        decode_only_llm.collective_rpc(restore_fia_update)
    assert made["replayed"] == {"FULL": 11}  # one prefill, then 11 decodes in FULL graphs
    with pytest.raises(AssertionError, match="not a near tie|apart, more than the"):
        check_logprobs_close(hf_greedy(model_path(FAMILY), prompt, 12), got, "stale lengths")
    check_logprobs_close(hf_greedy(model_path(FAMILY), prompt, 12),
                         vllm_greedy(decode_only_llm, [prompt], 12)[0], "updated again")


def test_without_any_update_a_full_replay_fails_loudly():
    """With no update at all, the replay's attention waits on an event nobody records: on the
    chip the stream hangs; the simulator fails the step with that diagnosis."""
    with decode_only_engine() as llm:
        llm.collective_rpc(skip_fia_update(record_events=False))
        with pytest.raises(Exception, match="a replayed ACL graph waits on an ExternalEvent "
                                            "that no task update recorded"):
            vllm_greedy(llm, ["hello there"], 4)
