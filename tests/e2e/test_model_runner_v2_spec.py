"""EAGLE and EAGLE-3 heads drafting under vLLM's Model Runner V2 on the plugin
(``VLLM_USE_V2_MODEL_RUNNER=1``): vLLM's V2 speculator as the NPU drafter (worker/v2/drafter.py),
its FULL graphs (the draft prefill, and each draft decode step) owned by the ACL draft graph
manager (worker/v2/graphs.py), the rejection sampler's and drafter's kernels as the simulator's
(equal to vLLM's Triton kernels: tests/ut/test_sim_v2_spec_kernels.py).

For the tiny Llama in FULL_DECODE_ONLY, FULL_AND_PIECEWISE and PIECEWISE: greedy output close to
HF transformers' (non-speculative), the target's and the drafter's replays exactly those the
steps call for, graph output equal to V2's eager output to the bit; a head fitted to agree with
the target has its drafts accepted as under V1 (the same counts per draft position), and a
random head's drafts are all rejected while FIA's host KV lengths in each draft step are the
exact ones (vLLM's host copy is an upper bound that counts the rejected drafts)."""

import collections
import contextlib

import pytest

from tests.e2e.conftest import (AGREEING, PROMPTS, check_logprobs_close, engine, expected_replays,
                                graph_counts, hf_greedy, MAX_TOKENS, model_path, num_layers,
                                replays, speculative_config, vllm_greedy)
from tests.e2e.test_model_runner_v2 import runner_v2
from tests.e2e.test_spec_decode import since, spec_metrics
from scripts.models import fit_prompts

MAX_NUM_SEQS = 8
# (method, k, mode): the fitted EAGLE head in FULL_DECODE_ONLY and a random one in
# FULL_AND_PIECEWISE in the quick tier; EAGLE-3 heads (fed three of the target's residual
# streams) and PIECEWISE (draft decode steps eager, as vLLM runs them) in the full tier.
CASES = [("eagle-agreeing", 4, "FULL_DECODE_ONLY"), ("eagle", 4, "FULL_AND_PIECEWISE")] + [
    pytest.param(c, marks=pytest.mark.slow) for c in (
        ("eagle3", 3, "FULL_DECODE_ONLY"), ("eagle3-agreeing", 1, "FULL_AND_PIECEWISE"),
        ("eagle", 2, "PIECEWISE"))]


def capture_sizes(k: int) -> list[int]:
    """Multiples of k + 1 (a verify step's tokens a request)."""
    return [k + 1, 2 * (k + 1), 4 * (k + 1)]


def decode_sizes(k: int) -> list[int]:
    """The draft decode graphs' sizes: one token a request, at most MAX_NUM_SEQS requests."""
    return [size for size in capture_sizes(k) if size <= MAX_NUM_SEQS]


@contextlib.contextmanager
def v2_spec_engine(method: str, k: int, mode: str, v2: bool = True):
    compilation = ({"cudagraph_mode": mode, "cudagraph_capture_sizes": capture_sizes(k)}
                   if mode != "NONE" else None)
    graphs = dict(compilation_config=compilation) if compilation else dict(enforce_eager=True)
    with runner_v2(v2), engine(model_path("llama"), max_num_seqs=MAX_NUM_SEQS,
                               disable_log_stats=False,
                               speculative_config=speculative_config("llama", method, k),
                               **graphs) as llm:
        yield llm


def prompts_of(method: str) -> list[str]:
    return fit_prompts("llama")[:3] if method.endswith(AGREEING) else PROMPTS[:3]


REFERENCE: dict = {}  # (method, k, "eager" | "v1") -> (greedy output, spec metrics)


def reference(method: str, k: int, which: str):
    """V2's eager output (which="eager"), or V1's in FULL_DECODE_ONLY (which="v1"), of the
    method's prompts, with the acceptance counts it made."""
    key = (method, k, which)
    if key not in REFERENCE:
        with v2_spec_engine(method, k, "NONE" if which == "eager" else "FULL_DECODE_ONLY",
                            v2=which == "eager") as llm:
            before = spec_metrics(llm)
            out = vllm_greedy(llm, prompts_of(method), MAX_TOKENS)
            REFERENCE[key] = out, since(spec_metrics(llm), before)
    return REFERENCE[key]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(map(str, c)))
def spec_llm(request):
    method, k, mode = request.param
    reference(method, k, "eager")  # (before: an in-process engine's shutdown ends vLLM's groups)
    if method.endswith(AGREEING):
        reference(method, k, "v1")
    with v2_spec_engine(method, k, mode) as llm:
        yield method, k, mode, llm


def drafter(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.speculator


def expected_drafter_replays(mode: str, steps, k: int, draft_pieces: int, max_size: int) -> dict:
    """What the drafter replays over ``steps`` by vLLM's dispatch: its prefill runs the verify
    step's batch (a FULL graph where the target's step ran one, PIECEWISE pieces where the
    target's did); its k - 1 decode steps, one token a request, a FULL graph each in a mode with
    FULL decode graphs while the requests fit the largest decode size, eagerly otherwise."""
    counts: collections.Counter = collections.Counter()
    for tokens, reqs in steps:
        target = expected_replays(mode, [(tokens, reqs)], 0, max_size, decode_query_len=k + 1)
        counts["FULL"] += target.get("FULL", 0)
        if "PIECEWISE" in target:
            counts["PIECEWISE"] += draft_pieces
        if k > 1 and "FULL" in mode and reqs <= max(decode_sizes(k)):
            counts["FULL"] += k - 1
    return {mode: n for mode, n in counts.items() if n}


def test_the_drafter_is_the_npu_one_and_captures_its_graphs(spec_llm):
    method, k, mode, llm = spec_llm
    from vllm_ascend.worker.v2.drafter import NPUDrafting
    from vllm_ascend.worker.v2.graphs import NPUDraftGraphManager

    speculator = drafter(llm)
    assert isinstance(speculator, NPUDrafting), type(speculator)
    managers = [speculator.prefill_cudagraph_manager, speculator.decode_cudagraph_manager]
    assert all(isinstance(m, NPUDraftGraphManager) for m in managers), managers
    sizes = capture_sizes(k)
    pieces = 2 * len(sizes)  # the head's one layer: two pieces per size
    full = (len(sizes) + (len(decode_sizes(k)) if k > 1 else 0)  # prefill graphs, decode's
            if mode != "PIECEWISE" else 0)
    expected = {m: n for m, n in (("PIECEWISE", pieces if "PIECEWISE" in mode else 0),
                                  ("FULL", full)) if n}
    counts = graph_counts(llm)
    assert counts["drafter"]["captured"] == expected, counts
    assert counts["streams_in_use"] == sum(counts["captured"].values())  # (the drafter's in)
    # The start-up plan counted them (the stream budget is checked against the plan).
    figures = llm.collective_rpc("startup_figures")[0]
    assert figures["planned"]["streams"] == figures["measured"]["streams"], figures


def test_greedy_output_is_hfs_with_exactly_the_replays_the_steps_call_for(spec_llm):
    method, k, mode, llm = spec_llm
    prompts = prompts_of(method)
    before = spec_metrics(llm)
    with replays(llm) as made:
        outs = vllm_greedy(llm, prompts, MAX_TOKENS)
    for prompt, out in zip(prompts, outs):
        check_logprobs_close(hf_greedy(model_path("llama"), prompt, MAX_TOKENS), out,
                             f"V2 {method} k={k} {mode} {prompt!r}")
    metrics = since(spec_metrics(llm), before)
    max_size = max(capture_sizes(k))
    assert made["replayed"] == expected_replays(mode, made["steps"], num_layers(llm), max_size,
                                                decode_query_len=k + 1), made
    assert made["drafter_replayed"] == expected_drafter_replays(
        mode, made["steps"], k, 2, max_size), made
    assert made["drafter_replayed"], made
    if method.endswith(AGREEING):  # measured: 39 of 40 drafts accepted (k = 4)
        assert metrics["num_accepted_tokens"] >= 0.8 * metrics["num_draft_tokens"], metrics
        # Three requests of k + 1 tokens between capture sizes: padded with fake requests.
        assert (3 * (k + 1), 3) in made["steps"], made
    else:  # a random head: every draft rejected, the output the target's own
        assert metrics["num_draft_tokens"] > 0 and metrics["num_accepted_tokens"] == 0, metrics


def test_graphs_give_v2s_eager_output_and_acceptance_to_the_bit(spec_llm):
    method, k, mode, llm = spec_llm
    before = spec_metrics(llm)
    out = vllm_greedy(llm, prompts_of(method), MAX_TOKENS)
    eager, eager_metrics = reference(method, k, "eager")
    assert out == eager
    assert since(spec_metrics(llm), before) == eager_metrics


def sampled(llm, prompts) -> list:
    """Sampled requests (temperature 0.8, a seed each): their tokens."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=MAX_TOKENS,
                             ignore_eos=True) for i in range(len(prompts))]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_sampled_requests_are_verified_by_the_ratio_test_and_repeat_with_their_seed(spec_llm):
    """Sampled requests take the rejection sampler's ratio test and resampling (its kernels:
    tests/ut/test_sim_v2_spec_kernels.py): a fitted head's drafts are still accepted (the target
    puts most of its mass on them), and a seed gives the same tokens again."""
    method, k, mode, llm = spec_llm
    prompts = prompts_of(method)
    before = spec_metrics(llm)
    first = sampled(llm, prompts)
    metrics = since(spec_metrics(llm), before)
    assert sampled(llm, prompts) == first
    assert metrics["num_draft_tokens"] > 0, metrics
    if method.endswith(AGREEING):
        assert metrics["num_accepted_tokens"] > 0, metrics


@pytest.mark.slow
def test_the_drafters_own_distribution_drafts_and_verifies_in_piecewise():
    """draft_sample_method "probabilistic": the drafter samples its drafts (caching its logits)
    and the ratio test weighs them by the drafter's probabilities; seeded requests repeat. In
    PIECEWISE (the drafter's FULL graphs refuse it on the simulator, test_model_runner_v2.py)."""
    config = {**speculative_config("llama", "eagle-agreeing", 2),
              "draft_sample_method": "probabilistic"}
    with runner_v2(), engine(model_path("llama"), max_num_seqs=MAX_NUM_SEQS,
                             disable_log_stats=False, speculative_config=config,
                             compilation_config={"cudagraph_mode": "PIECEWISE",
                                                 "cudagraph_capture_sizes": capture_sizes(2)}
                             ) as llm:
        prompts = prompts_of("eagle-agreeing")
        before = spec_metrics(llm)
        first = sampled(llm, prompts)
        metrics = since(spec_metrics(llm), before)
        assert sampled(llm, prompts) == first
        assert metrics["num_accepted_tokens"] > 0, metrics


def test_fitted_heads_drafts_are_accepted_as_under_v1(spec_llm):
    method, k, mode, llm = spec_llm
    if not method.endswith(AGREEING):
        pytest.skip("a random head's drafts are all rejected, under V1 as under V2")
    before = spec_metrics(llm)
    out = vllm_greedy(llm, prompts_of(method), MAX_TOKENS)
    v1, v1_metrics = reference(method, k, "v1")
    assert [tokens for tokens, _ in out] == [tokens for tokens, _ in v1]
    assert since(spec_metrics(llm), before) == v1_metrics


def test_a_draft_steps_fia_kv_lengths_are_exact_where_drafts_were_rejected(spec_llm):
    """vLLM hands a draft decode step's attention the verify step's KV lengths plus the step, an
    upper bound: the drafts the verify step rejected are taken off on the device only. FIA reads
    the host lists, so each real request's must equal the device's."""
    method, k, mode, llm = spec_llm
    if k == 1 or method.endswith(AGREEING):
        pytest.skip("draft decode steps after rejected drafts: a random head drafting k > 1")
    speculator = drafter(llm)
    own = speculator.attn_groups[0][0].get_metadata_builder()
    target = speculator.target_attn_groups[0][0].get_metadata_builder()
    seen = []
    build = own.build

    def recording(common_prefix_len, cam, fast_build=False):
        metadata = build(common_prefix_len, cam, fast_build)
        device = cam.seq_lens.tolist()
        real = int((speculator.idx_mapping >= 0).sum())  # (FULL graph padding rows are -1)
        seen.append((metadata.seq_lens_list[:real], device[:real],
                     target.latest.seq_lens_list[:real]))
        return metadata

    own.build = recording
    try:
        vllm_greedy(llm, PROMPTS[:3], MAX_TOKENS)
    finally:
        del own.build
    assert seen
    assert all(host == device for host, device, _ in seen), seen
    # (The test bites: in some draft step a request's length is below its verify step's.)
    assert any(d < v for _, device, verify in seen for d, v in zip(device, verify)), seen
