"""Every torch_npu call the engine makes, checked against upstream vllm-ascend's call sites.

Two engines of a tiny Qwen3-MoE run with the simulator's call log on: an eager one (every op
called from Python) and one in FULL_AND_PIECEWISE (attention eager between pieces, FIA captured
in FULL graphs and updated every step; its compiled pieces call their ops directly, from the
same call sites, and those lines are left out here); a
third, of a tiny DeepSeek-V2 in FULL_AND_PIECEWISE, makes the MLA calls; a fourth, eager, of a
W8A8 export of the tiny Llama (one dynamic, one static layer), the quantized ones; a fifth, eager,
of a tiny Mistral with n-gram drafts, the sliding window's band and npu_mrope; a sixth, of a tiny
GPT-OSS in FULL_DECODE_ONLY, FIA v2 with attention sinks and biased experts; a seventh, of a
tiny Qwen3-Next in FULL_DECODE_ONLY, the Gated DeltaNet operators; an eighth and a ninth, eager,
DeepSeek-V3's grouped sigmoid router and a Qwen3-MoE export's W8A8_DYNAMIC experts. Each distinct
call shape must match the table below, written from ../shared/TORCH_NPU_CONTRACTS.md and
docs/torch_npu_calls.md (op name, positional count, keyword names, dtypes, ranks, contiguity),
and every API of the table must be used.
"""

import json

import pytest

from tests.e2e.conftest import engine, model_path, speculative_config, vllm_greedy


def tensor(dims, dtypes=("bfloat16",), contiguous=True):
    dims = (dims,) if isinstance(dims, int) else dims

    def check(d):
        return isinstance(d, dict) and d["dim"] in dims and d["dtype"] in dtypes and (
            d["contiguous"] or not contiguous)

    check.__doc__ = f"{dims}-D {dtypes}{' contiguous' if contiguous else ''} tensor"
    return check


def value(*allowed):
    def check(d):
        return d in allowed

    check.__doc__ = f"one of {allowed}"
    return check


HOST_LIST, INT, FLOAT = value("list[int]"), value("int"), value("float")
CAPTURING, IDLE = value("stream(capturing)"), value("stream")
# attention_v1.py:1447-1468 through device_op.py:93-101 (eager), 998-1016 (workspace),
# 1061-1086 (capture) and 885-910 (update): everything by keyword, TND, paged BnBsH caches.
FIA = {"query": tensor(3), "key": tensor(3), "value": tensor(3), "atten_mask": tensor(2, ("int8",)),
       "block_table": tensor(2, ("int32",)), "input_layout": value("TND"), "block_size": INT,
       "actual_seq_lengths": HOST_LIST, "actual_seq_lengths_kv": HOST_LIST,
       "num_key_value_heads": INT, "num_heads": INT, "scale": FLOAT, "sparse_mode": INT}
FIA_GRAPH = {**FIA, "pre_tokens": INT, "next_tokens": INT}
# attention_v1.py:1417-1433: a sliding-window layer's eager call, sparse_mode 4 with its band.
FIA_BAND = FIA_GRAPH
# The MLA prefill's FIA v1 calls (see the MLA rows below): query, key, value positional; the
# new tokens causal, with the LSE when a request has cached context; each context chunk without
# a mask (mla_v1.py _compute_prefill_context, 1160-1192), with the LSE.
MLA_PREFILL = ([tensor(3), tensor(3), tensor(3)], {
    "num_heads": INT, "num_key_value_heads": INT, "input_layout": value("TND"),
    "atten_mask": tensor(2, ("int8",)), "sparse_mode": INT, "scale": FLOAT,
    "actual_seq_lengths": HOST_LIST, "actual_seq_lengths_kv": HOST_LIST})
MLA_PREFILL_LSE = (MLA_PREFILL[0], {**MLA_PREFILL[1], "softmax_lse_flag": value("bool")})
MLA_CONTEXT_CHUNK = (MLA_PREFILL[0], {**MLA_PREFILL_LSE[1], "atten_mask": value("NoneType")})
# mla_v1.py _forward_decode's common_kwargs: BNSD without speculative decoding (no mask, no
# query lengths), the latent cache passed as key and value.
MLA_FIA = {"query_rope": tensor(4), "key_rope": tensor(4), "num_query_heads": INT,
           "num_key_value_heads": INT, "input_layout": value("BNSD_NBSD"),
           "atten_mask": value("NoneType"), "sparse_mode": INT, "softmax_scale": FLOAT,
           "block_table": tensor(2, ("int32",)), "block_size": INT,
           "actual_seq_qlen": value("NoneType"), "actual_seq_kvlen": HOST_LIST}
# attention_v1.py 1375-1400 (eager), 1089-1213 (workspace, capture), 609-710 (update): a layer
# with sinks calls FIA v2 with learnable_sink, v1's keywords in v2's names. (Upstream passes
# pre_tokens/next_tokens in every call, which the chip ignores outside sparse_mode 4; here they
# go where v1's do: with the band, and in a capture.)
SINK_FIA = {"query": tensor(3), "key": tensor(3), "value": tensor(3),
            "atten_mask": tensor(2, ("int8",)), "block_table": tensor(2, ("int32",)),
            "input_layout": value("TND"), "block_size": INT, "actual_seq_qlen": HOST_LIST,
            "actual_seq_kvlen": HOST_LIST, "num_key_value_heads": INT, "num_query_heads": INT,
            "softmax_scale": FLOAT, "sparse_mode": INT, "learnable_sink": tensor(1)}
SINK_FIA_GRAPH = {**SINK_FIA, "pre_tokens": INT, "next_tokens": INT}
# moe_mlp.py unquant_apply_mlp (595-603 and the down projection): bias None, or GPT-OSS's
# experts' biases, float32 with bfloat16 x.
GMM = {"x": lambda d: isinstance(d, list) and len(d) == 1 and tensor(2)(d[0]),
       "weight": lambda d: isinstance(d, list) and len(d) == 1 and tensor(3)(d[0]),
       "bias": value("NoneType"), "split_item": INT, "group_list_type": INT, "group_type": INT,
       "group_list": tensor(1, ("int64",))}
BIAS = lambda d: isinstance(d, list) and len(d) == 1 and tensor(2, ("float32",))(d[0])  # noqa
BIAS.__doc__ = "[2-D float32 tensor]"


def one(check):
    def one_tensor(d):
        return isinstance(d, list) and len(d) == 1 and check(d[0])

    one_tensor.__doc__ = f"[{check.__doc__}]"
    return one_tensor


# moe_mlp.py quant_apply_mlp (its all-gather branch, the W8A8_DYNAMIC experts): int8 x and
# weights, the weight's scale per expert and channel (bfloat16 for bfloat16 output), each
# token's float32 scale.
QUANT_GMM = {**GMM, "x": one(tensor(2, ("int8",))), "weight": one(tensor(3, ("int8",))),
             "scale": one(tensor(2)), "per_token_scale": one(tensor(1, ("float32",))),
             "output_dtype": value("dtype")}
del QUANT_GMM["bias"]
# router/fused_topk_router.py _compute_routing through device_op.py:1079-1103 (renorm 0, the
# correction bias in the logits' dtype).
GATING = ([tensor(2, ("bfloat16", "float32"))], {
    "k": INT, "bias": tensor(1, ("bfloat16", "float32")), "k_group": INT, "group_count": INT,
    "group_select_mode": INT, "renorm": INT, "norm_type": INT, "out_flag": value("bool"),
    "routed_scaling_factor": FLOAT, "eps": FLOAT})
TABLE = {
    "npu_fused_infer_attention_score": [([], FIA), ([], FIA_BAND), MLA_PREFILL, MLA_PREFILL_LSE,
                                        MLA_CONTEXT_CHUNK],
    "_npu_fused_infer_attention_score_get_max_workspace": ([], FIA_GRAPH),
    "npu_fused_infer_attention_score.out": ([], {
        **FIA_GRAPH, "workspace": tensor(1),
        "out": lambda d: isinstance(d, list) and tensor(3)(d[0]) and tensor(1)(d[1])}),
    # device_op.py:44-53
    "npu_scatter_pa_kv_cache": ([], {
        "key": tensor(3), "value": tensor(3), "key_cache": tensor(4), "value_cache": tensor(4),
        "slot_mapping": tensor(1, ("int32",)), "cache_mode": value("Norm")}),
    # layernorm.py:76-81, activation.py:37 (positional); rotary_mul on [1, T, N, D]
    "npu_rms_norm": ([tensor((2, 3), contiguous=False), tensor(1), FLOAT], {}),
    "npu_add_rms_norm": ([tensor(2), tensor(2), tensor(1), FLOAT], {}),
    "npu_swiglu": ([tensor(2)], {}),
    "npu_rotary_mul": ([tensor(4), tensor(4), tensor(4)], {"rotary_mode": value("half")}),
    # MoE, upstream's all-gather path: gating as _310p/fused_moe/grouped_topk_router.py:60;
    # routing as token_dispatcher.py (TokenDispatcherWithAllGather) through device_op.py;
    # grouped matmuls as moe_mlp.py (unquant_apply_mlp); unpermute as device_op.py:951-954.
    "npu_moe_gating_top_k_softmax": ([tensor(2)], {"k": INT}),
    "npu_moe_gating_top_k": GATING,
    "npu_moe_init_routing_v2": ([tensor(2), tensor(2, ("int32",))], {
        "scale": value("NoneType"), "active_num": INT, "expert_num": INT,
        "expert_tokens_num_type": value("int"), "expert_tokens_num_flag": value("bool"),
        "active_expert_range": HOST_LIST, "quant_mode": INT}),
    "npu_grouped_matmul": [([], GMM), ([], {**GMM, "bias": BIAS}), ([], QUANT_GMM)],
    "npu_moe_token_unpermute": ([], {"permuted_tokens": tensor(2),
                                     "sorted_indices": tensor(1, ("int32",)),
                                     "probs": tensor(2)}),
    # MLA (mla_v1.py): the KV write as exec_kv_decode (1296-1326), the query's RoPE as
    # rope_single (1361-1371), the decode FIA as _forward_decode (1373-1577: eager, workspace,
    # capture) and its update (update_graph_params, 845-864), the value up-projection as
    # _v_up_proj (869-876). Upstream's prefill calls FIA v1 with the rope parts apart and
    # softmax_lse_flag=True, to merge context chunks by their LSE (npu_attention_update, 1197,
    # all chunks at once with update_type 0); the Ascend MLA prefill merges each chunk into a
    # running result (update_type 1), with query/key heads of 192 (upstream's head-padding
    # variant, 1271-1273).
    "npu_attention_update": ([lambda d: isinstance(d, list) and all(
        tensor(1, ("float32",))(x) for x in d), lambda d: isinstance(d, list) and all(
        tensor(2, ("float32",))(x) for x in d), INT], {}),
    "npu_kv_rmsnorm_rope_cache": ([tensor(4), tensor(1), tensor(4), tensor(4),
                                   tensor(1, ("int64",)), tensor(4), tensor(4)],
                                  {"c_kv_scale": value("NoneType"), "epsilon": FLOAT,
                                   "cache_mode": value("PA")}),
    "npu_interleave_rope": ([tensor(4), tensor(4), tensor(4)], {}),
    "npu_fused_infer_attention_score_v2": [([tensor(4), tensor(4), tensor(4)], MLA_FIA),
                                           ([], SINK_FIA), ([], SINK_FIA_GRAPH)],
    "_npu_fused_infer_attention_score_v2_get_max_workspace": [
        ([tensor(4), tensor(4), tensor(4)], MLA_FIA), ([], SINK_FIA_GRAPH)],
    "npu_fused_infer_attention_score_v2.out": [([tensor(4), tensor(4), tensor(4)], {
        **MLA_FIA, "workspace": tensor(1),
        "out": lambda d: isinstance(d, list) and tensor(4)(d[0]) and tensor(1)(d[1])}),
        ([], {**SINK_FIA_GRAPH, "workspace": tensor(1),
              "out": lambda d: isinstance(d, list) and tensor(3)(d[0]) and tensor(1)(d[1])})],
    # rotary_embedding.py:183-192: RoPE of vLLM's own model classes (Mistral's here).
    "npu_mrope": ([tensor(1, ("int64",)), tensor(2), tensor(2), tensor(2), INT],
                  {"mrope_section": HOST_LIST, "rotary_mode": value("half", "interleaved")}),
    "npu_transpose_batchmatmul": ([tensor(3), tensor(3)], {"perm_y": HOST_LIST}),
    # W8A8 (quantization/methods/w8a8_dynamic.py apply, w8a8_static.py apply through
    # ops/register_custom_ops.py _quantize_impl), and the norm-quant fusion pass's replacements
    # (compilation/passes/norm_quant_fusion_pass.py AddRMSNormQuantPattern,
    # AddRMSNormDynamicQuantPattern).
    "npu_dynamic_quant": [([tensor(2)], {"dst_type": value("dtype")}),
                          ([tensor(2)], {})],  # moe_mlp.py: the experts' activations
    "npu_quantize": ([tensor(2), tensor(1), tensor(1), value("dtype"), INT, value("bool")], {}),
    "npu_quant_matmul": [
        ([tensor(2, ("int8",)), tensor(2, ("int8",)), tensor(1, ("float32",))],
         {"pertoken_scale": tensor(1, ("float32",)), "bias": value("NoneType"),
          "output_dtype": value("dtype")}),
        ([tensor(2, ("int8",)), tensor(2, ("int8",)), tensor(1, ("float32", "int64"))],
         {"bias": tensor(1, ("int32",)), "output_dtype": value("dtype")})],
    "npu_add_rms_norm_quant": ([tensor(2), tensor(2), tensor(1), tensor(1), tensor(1)],
                               {"epsilon": FLOAT}),
    "npu_add_rms_norm_dynamic_quant": ([tensor(2), tensor(2), tensor(1)], {
        "epsilon": FLOAT, "output_mask": value(["bool", "bool"])}),
    # model_runner_v1.py / acl_graph.py / attention_v1.py: graphs, task groups, events
    "npu.graph": ([value("NPUGraph")], {"pool": value("_PoolHandle")}),
    "npu.graph_pool_handle": ([], {}),
    "npu.NPUGraph.capture_begin": ([value("_PoolHandle")], {}),
    "npu.NPUGraph.capture_end": ([], {}),
    "npu.NPUGraph.replay": ([], {}),
    "npu.current_stream": ([], {}),
    "npu.is_current_stream_capturing": ([], {}),
    "npu.stream": ([value("stream", "stream(capturing)")], {}),
    "npu.synchronize": ([], {}),
    # v2/aclgraph_utils.py run_fullgraph: the update stream waits for the current one before
    # a FULL replay (and the capture stream before a capture, model_runner_v1.py graph_capture).
    "npu.Stream.wait_stream": ([value("stream")], {}),
    "npu.ExternalEvent.wait": ([CAPTURING], {}),
    "npu.ExternalEvent.reset": ([CAPTURING], {}),
    "npu.ExternalEvent.record": ([IDLE], {}),
    "npu.graph_task_group_begin": ([CAPTURING], {}),
    "npu.graph_task_group_end": ([CAPTURING], {}),
    "npu.graph_task_update_begin": ([IDLE, value("_NPUTaskGroupHandle")], {}),
    "npu.graph_task_update_end": ([IDLE], {}),
    # Gated DeltaNet (ops/gdn.py; upstream ops/gdn.py): the prefill's chunked rule, and the
    # decode's recurrent step on the state pool by slot.
    "npu_chunk_gated_delta_rule": ([tensor(3), tensor(3), tensor(3)], {
        "beta": tensor(2), "initial_state": tensor(4),
        "actual_seq_lengths": tensor(1, ("int32",)), "scale": FLOAT,
        "g": tensor(2, ("float32",))}),
    "npu_recurrent_gated_delta_rule": ([tensor(3), tensor(3), tensor(3), tensor(4)], {
        "beta": tensor(2), "scale": FLOAT, "actual_seq_lengths": tensor(1, ("int32",)),
        "ssm_state_indices": tensor(1, ("int32",)), "g": tensor(2, ("float32",))}),
}

# token_dispatcher.py TokenDispatcherWithMC2 (get_dispatch_mc2_kwargs, get_combine_mc_kwargs):
# every argument by keyword, A3's extra TP arguments, global_bs 0 with the active mask, no
# quantization (expand_scales: None on the chip, an empty tensor on the simulator). A DP engine
# makes these calls, so test_data_parallel.py checks them, on a served engine.
NAME = lambda d: isinstance(d, str) and d not in ("int", "float", "bool", "NoneType")  # noqa
NAME.__doc__ = "a communicator's name"
MC2_COMMON = {"expert_ids": tensor(2, ("int32",)), "expert_shard_type": INT,
              "shared_expert_rank_num": INT, "moe_expert_num": INT, "global_bs": INT,
              "x_active_mask": tensor(1, ("bool",)), "group_ep": NAME, "ep_world_size": INT,
              "ep_rank_id": INT, "group_tp": NAME, "tp_world_size": INT, "tp_rank_id": INT}
HALF = ("bfloat16", "float16")
MC2_TABLE = {
    "npu_moe_distribute_dispatch_v2": ([], {
        **MC2_COMMON, "x": tensor(2, HALF), "expert_token_nums_type": INT,
        "scales": value("NoneType"), "quant_mode": INT}),
    "npu_moe_distribute_combine_v2": ([], {
        **MC2_COMMON, "expand_x": tensor(2, HALF), "expert_scales": tensor(2, ("float32",)),
        "ep_send_counts": tensor(1, ("int32",)), "assist_info_for_combine": tensor(1, ("int32",)),
        "tp_send_counts": tensor(1, ("int32",)), "comm_quant_mode": INT,
        "expand_scales": lambda d: d == "NoneType" or tensor(1, ("float32",))(d)}),
}


@pytest.fixture(scope="module")
def call_log(tmp_path_factory):
    path = tmp_path_factory.mktemp("calls") / "torch_npu_calls.jsonl"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ASCEND_SIM_CALL_LOG", str(path))  # read when an engine is prepared
        # Qwen3-MoE: q/k RMSNorm on head views as well as the residual norms, and the
        # fused-MoE operators.
        for mode in ({"enforce_eager": True}, {"compilation_config": {
                "cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4]}}):
            with engine(model_path("qwen3_moe"), max_num_seqs=4, **mode) as llm:
                vllm_greedy(llm, ["The capital of France is", "1, 2, 3,", "Hello"], 6)
        # A W8A8 export with a dynamic and a static layer: every quantized call, eagerly.
        with engine(model_path("llama-w8a8-mixed"), max_num_seqs=4, enforce_eager=True) as llm:
            vllm_greedy(llm, ["The capital of France is", "Hello"], 4)
        # DeepSeek-V2's MLA: its prefill between pieces, its decode captured and updated (and
        # eager in the warm-up before capture).
        with engine(model_path("deepseek_v2"), max_num_seqs=4, compilation_config={
                "cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4]}) \
                as llm:
            vllm_greedy(llm, ["The capital of France is", "Hello"], 4)
        # Mistral's sliding window: FIA's band, eagerly (captured: the FIA_GRAPH rows). With
        # n-gram drafts: a family with no file of ours and a drafter rotates with npu_mrope
        # (ops/rotary_embedding.py: no step rows, which a draft could share).
        with engine(model_path("mistral"), max_num_seqs=4, enforce_eager=True,
                    speculative_config=speculative_config("mistral", "ngram", 2)) as llm:
            vllm_greedy(llm, ["The capital of France is", "Hello"], 4)
        # GPT-OSS: FIA v2 with sinks, eager (prefill; the sliding layer's band), captured in
        # FULL decode graphs and updated; biased experts.
        with engine(model_path("gpt_oss"), max_num_seqs=4, block_size=16, compilation_config={
                "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]}) \
                as llm:
            vllm_greedy(llm, ["The capital of France is", "Hello"], 4)
        # Qwen3-Next's Gated DeltaNet: the chunked rule in the prefill (eager), the recurrent
        # step in the decode (eager in the warm-up, captured in FULL decode graphs).
        with engine(model_path("qwen3_next"), max_num_seqs=4, compilation_config={
                "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]}) \
                as llm:
            vllm_greedy(llm, ["The capital of France is", "Hello"], 4)
        # DeepSeek-V3's router (sigmoid, groups, the correction bias), and a Qwen3-MoE export
        # with W8A8_DYNAMIC experts, eagerly.
        for name in ("deepseek_v3", "qwen3_moe-w8a8-dynamic"):
            with engine(model_path(name), max_num_seqs=4, enforce_eager=True) as llm:
                vllm_greedy(llm, ["The capital of France is", "Hello"], 4)
    # The calls made from Python, as their call sites made them; a compiled piece's calls (the
    # log's "in": "graph" lines, in the dispatcher's form) come from those same call sites.
    return [call for call in map(json.loads, path.read_text().splitlines())
            if call.get("in") != "graph"]


def test_every_call_matches_upstreams_call_site(call_log):
    problems = []
    for call in call_log:
        api = call["api"]
        if api not in TABLE:
            problems.append(f"{api}: not an API upstream vllm-ascend calls on this path")
            continue
        shapes = TABLE[api] if isinstance(TABLE[api], list) else [TABLE[api]]
        found = [mismatches(api, call, *shape) for shape in shapes]
        if all(found):  # no call site of this API takes this call's shape
            problems.extend(min(found, key=len))
    assert not problems, "\n".join(problems)


def mismatches(api, call, positional, keywords) -> list[str]:
    problems = []
    if len(call["args"]) != len(positional):
        problems.append(f"{api}: {len(call['args'])} positional arguments, upstream passes "
                        f"{len(positional)}")
    for i, (check, got) in enumerate(zip(positional, call["args"])):
        if not check(got):
            problems.append(f"{api}: argument {i} is {got}, upstream passes {check.__doc__}")
    if set(call["kwargs"]) != set(keywords):
        problems.append(f"{api}: keywords {sorted(call['kwargs'])}, upstream passes "
                        f"{sorted(keywords)}")
    for name, got in call["kwargs"].items():
        if name in keywords and not keywords[name](got):
            problems.append(f"{api}: {name}={got}, upstream passes "
                            f"{keywords[name].__doc__ or 'another kind'}")
    return problems


def test_every_upstream_call_site_is_exercised(call_log):
    assert set(TABLE) - {c["api"] for c in call_log} == set()
