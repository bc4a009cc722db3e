"""Speculative decoding in graph mode: n-gram, a draft model, EAGLE and EAGLE-3 heads and
DeepSeek's MTP layers, with greedy output equal to HF transformers' (non-speculative) greedy
output under the logprob-closeness rule, graph replays asserted for the verify step and the
drafter, and vLLM's acceptance metrics read back."""

import re

import pytest

from tests.e2e.conftest import (AGREEING, PROMPTS, QUANTIZED, broken_export,
                                chip_cost_per_decode_step, check_logprobs_close, engine,
                                expected_replays, graph_counts, hf_greedy, MAX_TOKENS, model_path,
                                platform_log, replays, spec_target, speculative_config,
                                vllm_greedy)
from scripts.models import fit_prompts
from vllm_ascend.device.sim.ledger import PLUGIN_SYNCS, REPLAYS, UPDATES

MAX_NUM_SEQS = 4
# (family, method, num_speculative_tokens, graph mode). Every method runs in FULL_AND_PIECEWISE
# (the drafter's PIECEWISE graphs, FULL verify graphs, and for n-gram PIECEWISE verify steps
# where some request found no draft), and every mode runs with at least one method: n-gram in
# FULL (non-uniform verify batches in FULL graphs), a draft model eagerly (NONE), EAGLE in
# PIECEWISE (verify steps in pieces), Qwen3's draft model and DeepSeek-V3's MTP layer in
# FULL_DECODE_ONLY (both with a verify batch padded by whole fake requests). Qwen2 and Qwen3 run
# one method each. MTP (MLA, verify steps on FIA's TND layout in FULL graphs) drafts 2 tokens a
# step in FULL_DECODE_ONLY and 1 in FULL_AND_PIECEWISE; EAGLE runs in FULL_DECODE_ONLY too. In
# FULL_DECODE_ONLY both have heads fitted to agree with the target ("-agreeing"): most drafts
# are accepted, so the accepted-token path runs (the KV of accepted tokens, the positions after
# them), for MTP on MLA's latent cache; elsewhere their random weights draft tokens the target
# rejects, so the output must not change. DeepSeek-V2 drafts for itself in FULL_DECODE_ONLY.
# MTP also drafts for a W8A8 export of DeepSeek-V3 with MoE layers, its MTP layer (an MoE layer)
# FLOAT, as Ascend deploys it (served at DP=2 x TP=2: test_serve_mtp.py). EAGLE-3 heads (fed
# three of the target's residual streams) draft for Llama and Qwen3: agreeing ones 1 token a
# step (a second would read the head's own output, which a fitted head cannot follow) in
# FULL_DECODE_ONLY and FULL_AND_PIECEWISE, a random one 3 tokens a step (its own output chained).
# (SmolLM2's n-gram acceptance on a repetitive prompt is measured by benchmarks/spec_decode.py.)
CASES = ([("llama", "ngram", 3, "FULL"),
          ("llama", "draft_model", 2, "NONE"), ("llama", "draft_model", 2, "FULL_AND_PIECEWISE")]
         + [("llama", "eagle", 4, m) for m in ("PIECEWISE", "FULL_AND_PIECEWISE")]
         + [("qwen2", "ngram", 1, "FULL_AND_PIECEWISE"),
            ("qwen3", "draft_model", 1, "FULL_DECODE_ONLY"),
            ("deepseek_v3_mtp", "mtp-agreeing", 2, "FULL_DECODE_ONLY"),
            ("deepseek_v3_moe_mtp-w8a8-dynamic", "mtp-agreeing", 2, "FULL_DECODE_ONLY"),
            ("llama", "eagle3-agreeing", 1, "FULL_DECODE_ONLY")]
         + [pytest.param(c, marks=pytest.mark.slow) for c in (  # the full tier only
             ("llama", "eagle-agreeing", 4, "FULL_DECODE_ONLY"),
             ("qwen3", "eagle3-agreeing", 1, "FULL_AND_PIECEWISE"),
             ("llama", "eagle3", 3, "FULL_AND_PIECEWISE"),
             ("deepseek_v3_mtp", "mtp", 1, "FULL_AND_PIECEWISE"),
             ("deepseek_v2", "draft_model", 2, "FULL_DECODE_ONLY"))])
REPETITIVE = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,"


def spec_metrics(llm) -> dict:
    """vLLM's speculative-decoding counters: name -> value, or per draft position a list."""
    return {m.name.removeprefix("vllm:spec_decode_"): m.values if hasattr(m, "values")
            else m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num")}


def since(now, before) -> dict:
    """The metrics' change from ``before`` to ``now``: lists element by element, a metric that
    was not there before whole."""
    return {name: value if name not in before
            else [v - w for v, w in zip(value, before[name])] if isinstance(value, list)
            else value - before[name] for name, value in now.items()}


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(map(str, c)))
def spec_llm(request):
    family, method, k, mode = request.param
    graphs = ({"enforce_eager": True} if mode == "NONE"
              else {"compilation_config": {"cudagraph_mode": mode}})
    with platform_log() as log, engine(
            spec_target(family, method), max_num_seqs=MAX_NUM_SEQS, disable_log_stats=False,
            speculative_config=speculative_config(family, method, k), **graphs) as llm:
        # Async scheduling off: by vLLM's own rule for n-gram, by the platform for the others,
        # saying why (FIA needs exact host KV lengths).
        assert not llm.llm_engine.vllm_config.scheduler_config.async_scheduling
        assert llm.llm_engine.engine_core.engine_core.batch_queue is None
        assert any("async scheduling turned off: speculative decoding needs exact host KV "
                   "lengths" in line for line in log) == (method != "ngram"), log
        yield family, method, k, mode, llm


def draft_layers(llm) -> int:
    """The drafter's decoder layers: an MTP drafter's config is the target's, whose
    num_nextn_predict_layers it runs."""
    draft = llm.llm_engine.vllm_config.speculative_config.draft_model_config
    if draft is None:
        return 0
    return getattr(draft.hf_config, "num_nextn_predict_layers", None) or \
        draft.hf_config.num_hidden_layers


def test_capture_sizes_are_multiples_of_k_plus_1_and_the_drafter_captures(spec_llm):
    family, method, k, mode, llm = spec_llm
    cc = llm.llm_engine.vllm_config.compilation_config
    assert cc.cudagraph_mode.name == mode
    assert all(size % (k + 1) == 0 for size in cc.cudagraph_capture_sizes)
    counts = graph_counts(llm)
    drafter = counts.get("drafter", {}).get("captured", {})
    if method != "ngram" and "PIECEWISE" in mode:
        # vLLM captures drafters in PIECEWISE: one graph per piece of its model per size.
        assert drafter == {"PIECEWISE": (draft_layers(llm) + 1) * len(cc.cudagraph_capture_sizes)}
    else:
        assert drafter == {}
    assert counts["streams_in_use"] == sum(counts["captured"].values())


def test_greedy_output_equals_non_speculative_with_graph_replays(spec_llm):
    family, method, k, mode, llm = spec_llm
    if method == "ngram":  # n-gram drafts only where the text repeats itself
        prompts = [REPETITIVE, *PROMPTS[:2]]
    elif method.endswith(AGREEING):  # the prompts its head was fitted on
        prompts = fit_prompts(QUANTIZED.get(family, (family,))[0])
    else:
        prompts = PROMPTS
    n = MAX_TOKENS
    before = spec_metrics(llm)
    with replays(llm) as made:
        outs = vllm_greedy(llm, prompts, n)
    for prompt, out in zip(prompts, outs):
        check_logprobs_close(hf_greedy(spec_target(family, method), prompt, n), out,
                             f"{family} {method} k={k} {mode} {prompt!r}")
    metrics = since(spec_metrics(llm), before)
    assert metrics["num_drafts"] > 0 and metrics["num_draft_tokens"] > 0, metrics
    if method == "draft_model" or method.endswith(AGREEING):
        # Drafts the target agrees with: almost all are accepted (a broken verify step or
        # drafter would reject them; measured: the fitted MTP layer 30 of 30, the fitted EAGLE
        # head 39 of 40), and some steps accept every draft.
        assert metrics["num_accepted_tokens"] >= 0.8 * metrics["num_draft_tokens"], metrics
        assert metrics["num_accepted_tokens_per_pos"][-1] > 0, metrics

    if mode == "NONE":
        assert made["replayed"] == {} and made["drafter_replayed"] == {}
        return
    max_size = llm.llm_engine.vllm_config.compilation_config.max_cudagraph_capture_size
    layers = llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
    assert made["replayed"] == expected_replays(mode, made["steps"], layers, max_size,
                                                decode_query_len=k + 1), made
    verify_steps = [s for s in made["steps"] if s[0] == s[1] * (k + 1)]
    if "FULL" in mode and method != "ngram":
        # The drafter drafts K tokens for every request: each verify step is a uniform batch
        # of K + 1 tokens per request, and replays a FULL graph (PIECEWISE pieces otherwise).
        assert verify_steps and made["replayed"], made
    if method != "ngram" and "PIECEWISE" in mode:
        assert made["drafter_replayed"].get("PIECEWISE", 0) > 0, made
        assert made["drafter_replayed"]["PIECEWISE"] % (draft_layers(llm) + 1) == 0, made
    if len(prompts) == 3 and method != "ngram" and mode == "FULL_DECODE_ONLY":
        # Three requests of K + 1 tokens fall between capture sizes: the runner pads the batch
        # with whole fake requests of K + 1 tokens and replays the next larger FULL graph.
        sizes = llm.llm_engine.vllm_config.compilation_config.cudagraph_capture_sizes
        assert 3 * (k + 1) not in sizes and (3 * (k + 1), 3) in verify_steps, (sizes, made)


def _drafter_rope_rows(worker) -> list[bool]:
    """Whether each step RoPE buffer of the worker's draft model holds gathered rows (row 0:
    cos of a position, never all zero once filled; the buffers start as zeros)."""
    from vllm_ascend.worker.model_runner import step_ropes_of

    model = getattr(getattr(worker.model_runner, "drafter", None), "model", None)
    return [bool(rope.cos[0, 0].abs().sum() > 0) for rope in step_ropes_of(model)]


def test_the_drafter_rotates_with_the_rows_of_its_positions(spec_llm):
    # DeepSeek's MTP class is compiled at its top level by vLLM, so it runs no forward hooks:
    # its own call fills its rows (models/deepseek_mtp.py), where a hook would never have.
    family, method, k, mode, llm = spec_llm
    vllm_greedy(llm, PROMPTS[:1], 4)
    filled = llm.collective_rpc(_drafter_rope_rows)[0]
    if not filled:
        pytest.skip("its drafter reads no step RoPE rows (vLLM's own rotary per layer)")
    assert all(filled), filled


def test_capture_sizes_breaking_the_k_plus_1_rule_fail_at_start_with_the_fix():
    with pytest.raises(Exception) as failure:
        with engine(model_path("llama"), speculative_config=speculative_config("llama", "ngram", 3),
                    compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY",
                                        "cudagraph_capture_sizes": [1, 2, 3]}):
            pass
    message = str(failure.value)
    assert "multiple of 1 + num_speculative_tokens = 4" in message
    assert "[4, 8, 16, 32]" in message  # the fix: sizes that are multiples


def test_more_than_16_query_tokens_per_request_fail_at_start():
    with pytest.raises(Exception) as failure:
        with engine(model_path("llama"), enforce_eager=True,
                    speculative_config=speculative_config("llama", "ngram", 16)):
            pass
    assert "at most 16 per request" in str(failure.value)
    assert "num_speculative_tokens <= 15" in str(failure.value)


def test_an_export_whose_description_omits_the_mtp_layer_runs_without_mtp_and_refuses_it(
        tmp_path):
    """ModelSlim's description leaves DeepSeek's MTP layer out (its weights stay float): without
    MTP the export serves as before; with MTP the drafter's load names the layer and the fix."""
    name = "deepseek_v3_moe_mtp-w8a8-dynamic"

    def unlisted(tensors, description):
        for key in [k for k in description if k.startswith("model.layers.2.")]:
            del description[key]

    export = broken_export(tmp_path, name, unlisted)
    with engine(export, enforce_eager=True) as llm:
        out = vllm_greedy(llm, PROMPTS[:1], 4)[0]
    check_logprobs_close(hf_greedy(model_path(name), PROMPTS[0], 4), out, name, dtype="bfloat16")
    with pytest.raises(Exception) as failure:
        with engine(export, enforce_eager=True,
                    speculative_config=speculative_config(name, "mtp", 1)):
            pass
    assert re.search(r"quant_model_description\.json lists nothing of model\.layers\.2, a layer "
                     r"after the ones it lists: DeepSeek's MTP layer.*Add an entry "
                     r"\"<tensor name>\": \"FLOAT\" for each of its tensors", str(failure.value))


def test_draft_steps_add_no_blocking_sync_and_no_task_update(spec_llm):
    """Per engine step (one verify, k draft steps): the ledger's waits and updates are those of
    the verify step; each draft step replays its drafter's pieces and nothing more."""
    family, method, k, mode, llm = spec_llm
    if method == "ngram":
        pytest.skip("n-gram drafts on the host: it has no draft steps on the device, and its "
                    "verify step's graph depends on whether the text repeats")
    if family == "deepseek_v2" or method.endswith(AGREEING):
        pytest.skip("its drafts are accepted, and how many a step takes moves this per-step "
                    "ledger (the steps an engine step covers vary); the cases whose drafts are "
                    "rejected ledger the same drafters (EAGLE in PIECEWISE and "
                    "FULL_AND_PIECEWISE, MTP in FULL_AND_PIECEWISE)")
    layers = llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
    full_verify = mode in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
    verify_replays = 1 if full_verify else (layers + 1 if mode == "PIECEWISE" else 0)
    drafter_pieces = draft_layers(llm) + 1 if "PIECEWISE" in mode else 0
    cost = chip_cost_per_decode_step(llm)
    assert {row: cost[row] for row in (PLUGIN_SYNCS, UPDATES, REPLAYS)} == {
        PLUGIN_SYNCS: 0,  # a FULL verify's updates are ordered on the device
        UPDATES: layers if full_verify else 0,
        REPLAYS: verify_replays + k * drafter_pieces}, cost
