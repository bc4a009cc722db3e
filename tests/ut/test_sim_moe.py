"""The simulator's MoE operators, chained as upstream vllm-ascend's all-gather MoE path chains
them (gating top-k, routing, grouped matmul with SwiGLU between, unpermute), against a
reference mixture of experts in plain torch; expert parallelism's expert range; the chip's
checks; and the chain captured in a graph, replayed with new routing."""

import pytest
import torch

import vllm_ascend.device.sim as torch_npu
from vllm_ascend.device.sim import npu
from vllm_ascend.device.sim.ops import AscendOpError

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
    with pytest.raises(NotImplementedError, match="unquantized only"):
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
