"""The simulator's MoE operators, chained as upstream vllm-ascend's all-gather MoE path chains
them (gating top-k, routing, grouped matmul with SwiGLU between, unpermute), against a
reference mixture of experts in plain torch; expert parallelism's expert range; the chip's
checks; and the chain captured in a graph, replayed with new routing."""

import pytest
import torch

import vllm_ascend.device.sim as torch_npu
from vllm_ascend.device.sim import npu
from vllm_ascend.device.sim.errors import AscendOpError

TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 6, 16, 8, 4, 2


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(EXPERTS, HIDDEN, 2 * INTER, generator=g).to(torch.bfloat16) / 4
    w2 = torch.randn(EXPERTS, INTER, HIDDEN, generator=g).to(torch.bfloat16) / 4
    return w13, w2


def reference(x, logits, w13, w2, renormalize, experts=range(EXPERTS)):
    """HF's MoE block: softmax, top-k, optional renormalisation, each chosen expert's SwiGLU
    MLP weighted by its probability; experts outside ``experts`` (another EP rank's) add 0."""
    probs = torch.softmax(logits.float(), -1)
    top, ids = probs.topk(TOP_K, -1)
    if renormalize:
        top = top / top.sum(-1, keepdim=True)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for p, e in zip(top[t], ids[t].tolist()):
            if e in experts:
                gate, up = (x[t].float() @ w13[e].float()).chunk(2)
                out[t] += p * ((torch.nn.functional.silu(gate) * up) @ w2[e].float())
    return out


def moe(x, logits, w13, w2, renormalize, expert_range=None):
    """The chain as token_dispatcher.TokenDispatcherWithAllGather and moe_mlp.unquant_apply_mlp
    call it; ``expert_range``: this EP rank's experts (upstream masks the others' weights)."""
    topk_weights, topk_ids, _ = torch_npu.npu_moe_gating_top_k_softmax(logits, k=TOP_K)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    first, last = expert_range or (0, EXPERTS)
    if expert_range:
        topk_weights = topk_weights * ((topk_ids >= first) & (topk_ids < last))
    sorted_x, expanded_row_idx, expert_tokens, _ = torch_npu.npu_moe_init_routing_v2(
        x, topk_ids, scale=None, active_num=x.shape[0] * TOP_K, expert_num=EXPERTS,
        expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=[first, last], quant_mode=-1)
    gate_up = torch_npu.npu_grouped_matmul(
        x=[sorted_x], weight=[w13[first:last]], split_item=2, group_list_type=1, group_type=0,
        group_list=expert_tokens)[0]
    hidden = torch_npu.npu_swiglu(gate_up)
    down = torch_npu.npu_grouped_matmul(
        x=[hidden], weight=[w2[first:last]], split_item=2, group_list_type=1, group_type=0,
        group_list=expert_tokens)[0]
    return torch_npu.npu_moe_token_unpermute(
        permuted_tokens=down, sorted_indices=torch.abs(expanded_row_idx),
        probs=topk_weights.to(down.dtype))


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    logits = torch.randn(TOKENS, EXPERTS, generator=g).to(torch.bfloat16)
    return x, logits


@pytest.mark.parametrize("renormalize", [False, True], ids=["qwen2-moe", "qwen3-moe"])
def test_the_chain_is_a_mixture_of_experts(renormalize):
    x, logits = inputs()
    w13, w2 = weights()
    got = moe(x, logits, w13, w2, renormalize).float()
    torch.testing.assert_close(got, reference(x, logits, w13, w2, renormalize),
                               atol=3e-2, rtol=3e-2)


def test_two_expert_parallel_ranks_add_up_to_the_whole():
    # Each rank computes its experts' share; the all-gather path then sums the ranks' outputs.
    x, logits = inputs()
    w13, w2 = weights()
    halves = [moe(x, logits, w13, w2, True, (0, 2)), moe(x, logits, w13, w2, True, (2, 4))]
    torch.testing.assert_close(halves[0].float(), reference(x, logits, w13, w2, True, range(2)),
                               atol=3e-2, rtol=3e-2)
    torch.testing.assert_close((halves[0].float() + halves[1].float()),
                               reference(x, logits, w13, w2, True), atol=5e-2, rtol=5e-2)


def test_routing_counts_and_maps_each_token_expert_pair():
    x, _ = inputs()
    ids = torch.tensor([[1, 0], [1, 2], [0, 1], [3, 1], [2, 0], [1, 3]], dtype=torch.int32)
    sorted_x, row_idx, counts, _ = torch_npu.npu_moe_init_routing_v2(
        x, ids, active_num=12, expert_num=4, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, active_expert_range=[0, 4], quant_mode=-1)
    assert counts.tolist() == [3, 5, 2, 2] and counts.dtype == torch.int64
    # Sorted by expert, stable in token-major order; row_idx maps each (token, k) to its row.
    assert torch.equal(sorted_x[row_idx.long()], x.repeat_interleave(2, 0))
    _, _, cumsum, _ = torch_npu.npu_moe_init_routing_v2(
        x, ids, active_num=12, expert_num=4, expert_tokens_num_type=0,
        expert_tokens_num_flag=True, quant_mode=-1)
    assert cumsum.tolist() == [3, 8, 10, 12]
    # Another rank's experts are not routed here: their pairs map to -1, their rows are NaN.
    sorted_x, row_idx, counts, _ = torch_npu.npu_moe_init_routing_v2(
        x, ids, active_num=12, expert_num=4, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, active_expert_range=[2, 4], quant_mode=-1)
    assert counts.tolist() == [2, 2] and int((row_idx >= 0).sum()) == 4
    assert sorted_x[4:].isnan().all()


def test_the_chips_checks():
    x, logits = inputs()
    w13, _ = weights()
    ids = torch.tensor([[0, 4]] * TOKENS, dtype=torch.int32)
    with pytest.raises(AscendOpError, match="expert_idx holds ids outside"):
        torch_npu.npu_moe_init_routing_v2(x, ids, expert_num=4, quant_mode=-1)
    with pytest.raises(AscendOpError, match="expert_idx must be int32"):
        torch_npu.npu_moe_init_routing_v2(x, ids.long(), expert_num=4, quant_mode=-1)
    with pytest.raises(NotImplementedError, match="only dropless"):
        torch_npu.npu_moe_init_routing_v2(x, ids.clamp(max=3), expert_num=4, quant_mode=-1,
                                          drop_pad_mode=1)
    with pytest.raises(AscendOpError, match="k 5 must be in"):
        torch_npu.npu_moe_gating_top_k_softmax(logits, k=5)
    counts = torch.tensor([2, 2, 2], dtype=torch.int64)  # three groups, four experts
    with pytest.raises(AscendOpError, match="group_list must be a 1-D int64 tensor of 4"):
        torch_npu.npu_grouped_matmul([x], [w13], split_item=2, group_type=0, group_list=counts,
                                     group_list_type=1)
    with pytest.raises(AscendOpError, match="within x's 6 rows"):
        torch_npu.npu_grouped_matmul([x], [w13], split_item=2, group_type=0,
                                     group_list=torch.tensor([4, 4, 0, 0]), group_list_type=1)
    with pytest.raises(AscendOpError, match="bfloat16 x takes no scale or per_token_scale"):
        torch_npu.npu_grouped_matmul([x], [w13], split_item=2, group_type=0,
                                     group_list=torch.tensor([6, 0, 0, 0]), group_list_type=1,
                                     scale=[torch.ones(4)])
    with pytest.raises(AscendOpError, match="padded_mode is false"):
        torch_npu.npu_moe_token_unpermute(x, torch.arange(TOKENS, dtype=torch.int32),
                                          padded_mode=True)


def test_a_bias_per_expert_in_the_dtype_of_torch_npus_table():
    """GPT-OSS's expert biases: group e's rows get bias[e]; the bias is float32 with bfloat16
    x (float16 with float16), as torch_npu's table of npu_grouped_matmul has it."""
    x, _ = inputs()
    w13, _ = weights()
    bias = torch.randn(EXPERTS, 2 * INTER)
    counts = torch.tensor([2, 1, 0, 3])
    out = torch_npu.npu_grouped_matmul([x], [w13], bias=[bias], split_item=2, group_type=0,
                                       group_list=counts, group_list_type=1)[0]
    rows = torch.repeat_interleave(torch.arange(EXPERTS), counts)
    ref = torch.einsum("mk,mkn->mn", x.float(), w13[rows].float()) + bias[rows]
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=1e-2)
    with pytest.raises(AscendOpError, match="bias must be torch.float32 with torch.bfloat16 x"):
        torch_npu.npu_grouped_matmul([x], [w13], bias=[bias.bfloat16()], split_item=2,
                                     group_type=0, group_list=counts, group_list_type=1)


def test_rows_past_the_routed_tokens_are_poison():
    x, _ = inputs()
    w13, _ = weights()
    out = torch_npu.npu_grouped_matmul([x], [w13], split_item=2, group_type=0,
                                       group_list=torch.tensor([2, 1, 0, 0]), group_list_type=1)[0]
    assert not out[:3].isnan().any() and out[3:].isnan().all()


def test_captured_routing_follows_the_replayed_logits():
    # Routing is data on the device: a graph captured with one set of router logits, replayed
    # with another, routes the new way (no host value is frozen into the graph).
    x, logits = inputs()
    w13, w2 = weights()
    static_x, static_logits = x.clone(), logits.clone()
    graph = npu.NPUGraph()
    with npu.graph(graph):
        out = moe(static_x, static_logits, w13, w2, True)
    new_x, new_logits = inputs(seed=7)
    static_x.copy_(new_x)
    static_logits.copy_(new_logits)
    graph.replay()
    torch.testing.assert_close(out.float(), reference(new_x, new_logits, w13, w2, True),
                               atol=3e-2, rtol=3e-2)
    graph.reset()


def _deepseek_v3_router(experts=16, groups=4, chosen=2, top_k=4, scale=2.5, seed=0):
    """HF's DeepSeek-V3 router (transformers' DeepseekV3TopkRouter) with random weights and a
    random correction bias, and a batch of hidden states."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=experts, n_group=groups,
                              topk_group=chosen, num_experts_per_tok=top_k,
                              routed_scaling_factor=scale, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, HIDDEN, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=g) * 0.3)
    return router, torch.randn(32, HIDDEN, generator=g)


def _by_expert(weights, ids):
    """Each token's (expert, weight) pairs in expert order: the choice, whatever its order."""
    order = ids.long().argsort(-1)
    return ids.long().gather(1, order), weights.float().gather(1, order)


def test_grouped_sigmoid_gating_is_deepseek_v3s_router():
    """npu_moe_gating_top_k with sigmoid scores (norm_type 1), the bias and the group choice by
    the top-two sum (mode 1) chooses HF's experts with HF's weights: normalised, times the
    routed scaling factor; the bias in the choice only."""
    router, h = _deepseek_v3_router()
    logits, hf_weights, hf_ids = router(h)
    with torch.no_grad():
        weights, ids, norm_out = torch_npu.npu_moe_gating_top_k(
            logits, k=4, bias=router.e_score_correction_bias, k_group=2, group_count=4,
            group_select_mode=1, renorm=0, norm_type=1, out_flag=False,
            routed_scaling_factor=2.5, eps=1e-20)
    assert ids.dtype == torch.int32 and weights.dtype == logits.dtype
    hf_ids, hf_weights = _by_expert(hf_weights.detach(), hf_ids)
    ids, weights = _by_expert(weights, ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)
    assert norm_out.numel() == 0  # normOut only with out_flag
    # the bias changes the choice here: the same call without it chooses other experts
    unbiased = torch_npu.npu_moe_gating_top_k(logits.detach(), k=4, k_group=2, group_count=4,
                                              group_select_mode=1, norm_type=1)[1]
    assert not torch.equal(_by_expert(weights, unbiased)[0], ids)


def test_grouped_softmax_gating_takes_each_groups_best():
    """Softmax scores (norm_type 0) with groups scored by their best expert (mode 0): DeepSeek-V2's
    group-limited greedy routing, as vLLM's grouped_topk computes it without a bias; the weights
    are the softmax probabilities, not normalised by the operator."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 16, generator=g) * 2
    probs = torch.softmax(logits, -1)
    best = probs.view(32, 4, 4).amax(-1).topk(2, -1).indices
    allowed = torch.zeros(32, 4, dtype=torch.bool).scatter_(1, best, True)
    ref_weights, ref_ids = probs.masked_fill(~allowed.repeat_interleave(4, 1), 0).topk(3, -1)
    weights, ids, _ = torch_npu.npu_moe_gating_top_k(logits, k=3, k_group=2, group_count=4,
                                                     group_select_mode=0, norm_type=0)
    assert torch.equal(*(_by_expert(w, i)[0] for w, i in ((weights, ids), (ref_weights, ref_ids))))
    torch.testing.assert_close(_by_expert(weights, ids)[1], _by_expert(ref_weights, ref_ids)[1])


@pytest.mark.parametrize("change,match", [
    (dict(bias=torch.zeros(16, dtype=torch.bfloat16)), "bias must be 1-D of the expert num 16 "
     "in x's dtype torch.float32"),
    (dict(bias=torch.zeros(8)), "bias must be 1-D of the expert num 16"),
    (dict(renorm=1), "renorm only supports 0"),
    (dict(norm_type=2), "norm_type"),
    (dict(group_count=3), "divisible by group_count 3"),
    (dict(group_count=8, k_group=4), "more than 2 experts"),  # 2 per group
    (dict(k_group=5), r"1 <= k_group \(5\) <= group_count"),
    (dict(k=9), r"1 <= k \(9\) <= min\(32, k_group \* experts / group_count = 8\)"),
])
def test_grouped_gating_checks(change, match):
    args = dict(k=4, bias=torch.zeros(16), k_group=2, group_count=4, group_select_mode=1,
                norm_type=1)
    args.update(change)
    with pytest.raises(AscendOpError, match=match):
        torch_npu.npu_moe_gating_top_k(torch.zeros(3, 16), **args)


def test_grouped_gating_limits():
    with pytest.raises(AscendOpError, match="at most 2048"):
        torch_npu.npu_moe_gating_top_k(torch.zeros(1, 4096), k=4)
    with pytest.raises(AscendOpError, match=r"min\(32"):
        torch_npu.npu_moe_gating_top_k(torch.zeros(1, 256), k=33, group_count=8, k_group=8)
    with pytest.raises(AscendOpError, match="aligned to 32"):  # 40 per group: 64 x 40 > 2048
        torch_npu.npu_moe_gating_top_k(torch.zeros(1, 1600), k=4, group_count=40, k_group=4)


def _int8_experts(seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-128, 128, (TOKENS, HIDDEN), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (EXPERTS, HIDDEN, INTER), generator=g, dtype=torch.int8)
    scale = torch.rand(EXPERTS, INTER, generator=g) / 100
    token_scale = torch.rand(TOKENS, generator=g) / 100
    return x, w, scale, token_scale


@pytest.mark.parametrize("scale_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16),
                                                   (torch.float32, torch.float16)])
def test_per_token_quantized_grouped_matmul(scale_dtype, out_dtype):
    """int8 x and weights: each group's exact int32 products times the weight scale of each
    output channel and the token scale of each row, in the dtype the scale's dtype selects."""
    x, w, scale, token_scale = _int8_experts()
    counts = torch.tensor([2, 0, 3, 1])
    (out,) = torch_npu.npu_grouped_matmul(
        [x], [w], scale=[scale.to(scale_dtype)], per_token_scale=[token_scale], split_item=2,
        group_type=0, group_list=counts, group_list_type=1, output_dtype=out_dtype)
    expert = torch.repeat_interleave(torch.arange(EXPERTS), counts)
    exact = torch.einsum("tk,tkn->tn", x.double(), w[expert].double())
    ref = exact * scale.to(scale_dtype).double()[expert] * token_scale.double().unsqueeze(1)
    assert out.dtype == out_dtype
    torch.testing.assert_close(out.double(), ref.to(out_dtype).double())


def test_per_token_quantized_grouped_matmul_checks():
    x, w, scale, token_scale = _int8_experts()
    counts = torch.tensor([2, 0, 3, 1])
    args = dict(split_item=2, group_type=0, group_list=counts, group_list_type=1)
    with pytest.raises(AscendOpError, match="a bfloat16 scale with output_dtype bfloat16 or a "
                       "float32 scale with float16"):
        torch_npu.npu_grouped_matmul([x], [w], scale=[scale.bfloat16()],
                                     per_token_scale=[token_scale], output_dtype=torch.float16,
                                     **args)
    with pytest.raises(AscendOpError, match="scale must be"):
        torch_npu.npu_grouped_matmul([x], [w], scale=[scale.bfloat16().flatten()],
                                     per_token_scale=[token_scale], output_dtype=torch.bfloat16,
                                     **args)
    with pytest.raises(AscendOpError, match="per_token_scale must be float32"):
        torch_npu.npu_grouped_matmul([x], [w], scale=[scale.bfloat16()],
                                     per_token_scale=[token_scale.bfloat16()],
                                     output_dtype=torch.bfloat16, **args)
    with pytest.raises(NotImplementedError, match="per-token full quantization"):
        torch_npu.npu_grouped_matmul([x], [w], scale=[scale.bfloat16()],
                                     output_dtype=torch.bfloat16, **args)
