"""How MoE tokens reach other ranks' experts: one pure function of the layer's setup (chip, EP
size, experts, hidden size, the largest graph batch, HCCL's buffer) and the step's tokens a rank,
as upstream's select_moe_comm_method decides, with what vllm-ascend runs."""

import dataclasses

import pytest

from vllm_ascend.ops.fused_moe.comm import (MoEComm, MoECommSetup, chip_generation,
                                            mc2_window_bytes, select_moe_comm)

AG, MC2, A2A = MoEComm.ALLGATHER, MoEComm.MC2, MoEComm.ALLTOALL
MB = 1 << 20
# DP=2 x EP over a Qwen3-MoE-like layer on an A3, capture sizes up to 32, 200 MB of HCCL buffer.
A3 = MoECommSetup(generation="A3", ep_size=2, experts=8, top_k=2, hidden=1024,
                  partitioned=True, largest_batch=32, window=200 * MB)
A2_16 = dataclasses.replace(A3, generation="A2", ep_size=16, experts=64)


def setup(base=A3, **change):
    return dataclasses.replace(base, **change)


# (setup, tokens a rank) -> (what vllm-ascend runs, what upstream runs, words of the reason)
TABLE = [
    (setup(ep_size=1), 8, AG, AG, "no expert parallelism"),
    (A3, 1, MC2, MC2, "MC2 up to 32 tokens a rank"),          # decode, any graph size
    (A3, 32, MC2, MC2, "MC2 up to 32 tokens a rank"),         # the largest graph
    (A3, 33, AG, A2A, "above 32 tokens a rank"),              # a large prefill: eager
    (setup(largest_batch=4096), 600, AG, A2A, "above 512"),   # the chip's per-rank limit
    (setup(hidden=128), 1, AG, MC2, "hidden size of 128"),    # below A3's 1024
    (setup(hidden=8448), 1, AG, MC2, "hidden size of 8448"),
    (setup(partitioned=False), 1, AG, MC2, "every EP rank holds every token"),
    (setup(mc2_ops=False), 1, AG, MC2, "no npu_moe_distribute_dispatch_v2"),
    (setup(experts=9), 1, AG, MC2, "9 experts over 2 ranks"),
    (setup(top_k=17, experts=32), 1, AG, MC2, "top-17"),
    (setup(window=1 * MB), 1, AG, MC2, "HCCL's buffer (1 MB) is below"),
    (setup(generation="A2", ep_size=2), 1, AG, AG, "below upstream's MC2 threshold"),
    (A2_16, 1, MC2, MC2, "MC2 up to 32 tokens a rank (A2"),  # A2: MC2 from 16 EP ranks
    (A2_16, 33, AG, AG, "above 32 tokens a rank"),
    (setup(A2_16, experts=16 * 25), 1, AG, AG, "EP over 16 ranks"),  # > 24 experts a rank
    (setup(A2_16, largest_batch=300), 300, AG, AG, "above 256"),  # A2's per-rank limit
    (setup(generation="other"), 1, AG, AG, "EP over 2 ranks"),  # the default simulator
]


@pytest.mark.parametrize("s,tokens,comm,upstream,words", TABLE)
def test_comm_choice_table(s, tokens, comm, upstream, words):
    choice = select_moe_comm(s, tokens)
    assert (choice.comm, choice.upstream) == (comm, upstream)
    assert words in choice.reason, choice.reason


def test_the_buffer_refusal_names_the_size_that_fits():
    choice = select_moe_comm(setup(window=1 * MB), 1)
    need = -(-mc2_window_bytes("A3", 4, 32, 2, 1024, 2) // MB)
    assert f"set HCCL_BUFFSIZE={need} or more" in choice.reason
    assert select_moe_comm(setup(window=need * MB), 1).comm == MC2


def test_chip_generation_from_the_device_name():
    assert chip_generation("Ascend910B2") == "A2"
    assert chip_generation("Ascend910_9382") == "A3"
    assert chip_generation("Ascend simulator (CPU)") == "other"


def test_each_ep_rank_holds_one_contiguous_range_of_experts():
    import torch

    from vllm_ascend.ops.fused_moe.method import expert_range

    assert expert_range(None, 8) == (0, 8)  # no expert parallelism: every expert
    rank_1_of_2 = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3])  # vLLM's linear placement
    assert expert_range(rank_1_of_2, 4) == (4, 8)
    round_robin = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1])
    with pytest.raises(ValueError, match="contiguous range.*--expert-placement-strategy linear"):
        expert_range(round_robin, 4)


def _router_layer(**changes):
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe import MoEActivation

    deepseek_v3 = dict(
        layer_name="model.layers.3.mlp.experts", scoring_func="sigmoid", use_grouped_topk=True,
        num_expert_group=8, topk_group=4, top_k=8, global_num_experts=256, renormalize=True,
        custom_routing_function=None, e_score_correction_bias=object(),
        apply_router_weight_on_input=False, activation=MoEActivation.SILU)
    return SimpleNamespace(**{**deepseek_v3, **changes})


def test_the_routers_of_deepseek_v3_glm_and_kimi_are_built():
    from vllm_ascend.ops.fused_moe.router import describe, grouped, routing_problems

    assert describe(_router_layer()) == (  # the start-up log's words
        "sigmoid scores plus a correction bias for the choice, the best 4 of 8 expert groups, "
        "top-8, renormalised (npu_moe_gating_top_k)")

    for layer in (_router_layer(),  # DeepSeek-V3/R1: 256 experts, 8 groups, top-4 groups
                  _router_layer(num_expert_group=1, topk_group=1, global_num_experts=160),  # GLM
                  _router_layer(num_expert_group=1, topk_group=1, global_num_experts=384)):  # K2
        assert grouped(layer) and routing_problems(layer) == []
    v2_lite = _router_layer(scoring_func="softmax", num_expert_group=1, topk_group=1,
                            e_score_correction_bias=None, global_num_experts=64, top_k=6)
    assert not grouped(v2_lite) and routing_problems(v2_lite) == []


def test_a_sigmoid_router_is_hfs_deepseek_v3_router():
    """route() on a DeepSeek-V3 layer (sigmoid scores, the correction bias, 2 of 4 groups, a
    routed scaling factor the layer applies itself) chooses HF's experts with HF's weights."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from vllm_ascend.ops.fused_moe.router import route

    config = DeepseekV3Config(hidden_size=32, n_routed_experts=16, n_group=4, topk_group=2,
                              num_experts_per_tok=4, routed_scaling_factor=2.5)
    hf = DeepseekV3TopkRouter(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(16, 32, generator=g))
        hf.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.3)
        logits, hf_weights, hf_ids = hf(torch.randn(24, 32, generator=g))
    layer = _router_layer(num_expert_group=4, topk_group=2, top_k=4, global_num_experts=16,
                          routed_scaling_factor=2.5,
                          e_score_correction_bias=hf.e_score_correction_bias,
                          ascend_gating_bias=hf.e_score_correction_bias)  # float32 logits
    weights, ids = route(layer, logits)
    order, hf_order = ids.long().argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.long().gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))


def test_a_routing_the_layer_does_not_build_fails_at_load_naming_the_layer():
    llama4_like = _router_layer(renormalize=False, custom_routing_function=lambda *a: a,
                                use_grouped_topk=False, global_num_experts=16, top_k=1,
                                e_score_correction_bias=None)
    method = _method(has_bias=False)
    with pytest.raises(ValueError, match=(
            r"model.layers.3.mlp.experts: vllm-ascend's MoE layer routes by softmax top-k, or by "
            r"sigmoid or softmax scores over expert groups with a correction bias, to SwiGLU "
            r"experts \(Qwen2/3-MoE, DeepSeek-V2/V3, GLM-4.5, GPT-OSS\); this model uses "
            r"sigmoid scores without renormalisation, a custom routing function, which it does "
            r"not build")):
        method.process_weights_after_loading(llama4_like)
    too_many = _router_layer(num_expert_group=1, topk_group=1, global_num_experts=4096)
    with pytest.raises(ValueError, match="4096 experts in 1 groups with top-8 of 1 groups"):
        method.process_weights_after_loading(too_many)


E, H, INTER, TOP_K = 8, 16, 8, 2


def _weights():
    """Experts in vLLM's layout: w13 [E, 2 * inter, hidden] (gate | up), w2 [E, hidden, inter]."""
    import torch

    g = torch.Generator().manual_seed(0)
    return (torch.randn(E, 2 * INTER, H, generator=g) / 4,
            torch.randn(E, H, INTER, generator=g) / 4)


def _reference(x, logits, renormalize, experts=range(E), scale=1.0):
    """HF's MoE block in float32: softmax, top-k, optional renormalisation, each chosen expert's
    SwiGLU MLP weighted by its probability (times DeepSeek's routed_scaling_factor); another
    rank's experts add 0."""
    import torch

    w13, w2 = _weights()
    probs, ids = torch.softmax(logits.float(), -1).topk(TOP_K, -1)
    if renormalize:
        probs = probs / probs.sum(-1, keepdim=True)
    probs = probs * scale
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for p, e in zip(probs[t], ids[t].tolist()):
            if e in experts:
                gate, up = (w13[e] @ x[t].float()).chunk(2)
                out[t] += p * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def _method(has_bias: bool):
    """The product's MoE method as vLLM builds it for a layer, without vLLM's config."""
    from types import SimpleNamespace

    from vllm_ascend.ops.fused_moe.method import AscendUnquantizedFusedMoEMethod

    method = AscendUnquantizedFusedMoEMethod.__new__(AscendUnquantizedFusedMoEMethod)
    method.moe = SimpleNamespace(has_bias=has_bias)
    return method


def _layer_experts(x, logits, renormalize, first=0, last=E, scale=1.0, biases=None):
    """The product's expert computation (AscendUnquantizedFusedMoEMethod._experts) on a layer
    holding experts [first, last), with its weights as process_weights_after_loading leaves
    them (transposed to [E, K, N], bfloat16). With ``biases`` (w13's, w2's): GPT-OSS's experts,
    biased, behind the clamped SwiGLU on interleaved gate/up columns."""
    from types import SimpleNamespace

    import torch
    from vllm.model_executor.layers.fused_moe import MoEActivation

    w13, w2 = _weights()
    layer = SimpleNamespace(
        top_k=TOP_K, renormalize=renormalize, global_num_experts=E, routed_scaling_factor=scale,
        ascend_expert_range=(first, last), scoring_func="softmax", use_grouped_topk=False,
        e_score_correction_bias=None,
        activation=MoEActivation.SWIGLUOAI if biases else MoEActivation.SILU,
        w13_weight=w13[first:last].transpose(1, 2).contiguous().to(torch.bfloat16),
        w2_weight=w2[first:last].transpose(1, 2).contiguous().to(torch.bfloat16))
    if biases:
        layer.w13_bias, layer.w2_bias = (b[first:last].float() for b in biases)
    return _method(has_bias=biases is not None)._experts(layer, x.to(torch.bfloat16),
                                                         logits.to(torch.bfloat16)).float()


def _inputs(tokens=6, seed=1):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, H, generator=g), torch.randn(tokens, E, generator=g) * 3


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_layer_is_hfs_mixture_of_experts(renormalize):
    """Qwen3-MoE renormalises the top-k probabilities (norm_topk_prob), Qwen2-MoE does not: the
    two differ by far more than the tolerance, so either mistake fails."""
    import torch

    x, logits = _inputs()
    out = _layer_experts(x, logits, renormalize)
    torch.testing.assert_close(out, _reference(x, logits, renormalize), atol=0.03, rtol=0.03)
    assert (out - _reference(x, logits, not renormalize)).abs().max() > 0.1


def test_the_routed_scaling_factor_weighs_the_routed_experts():
    """DeepSeek's routed_scaling_factor (vLLM's monolithic MoE leaves it to the method)."""
    import torch

    x, logits = _inputs()
    out = _layer_experts(x, logits, False, scale=2.5)
    torch.testing.assert_close(out, _reference(x, logits, False, scale=2.5), atol=0.05,
                               rtol=0.03)
    assert (out - _reference(x, logits, False)).abs().max() > 0.1


def test_expert_parallel_ranks_add_up_even_when_a_rank_gets_one_pair_or_none():
    """Two EP ranks' outputs sum to the whole layer's. Here every token goes to experts 0-3
    except one pair: rank [4, 8) computes one routed row, rank [0, 4) all but one. The rows of
    the grouped matmul past a rank's pairs are undefined (NaN on the simulator), and the
    unpermute reads one of them, with weight 0, for every pair the rank dropped."""
    import torch

    x, logits = _inputs()
    logits[:, 4:] = -20.0
    logits[0, 5] = 20.0  # token 0's top expert is 5, on the second rank
    halves = [_layer_experts(x, logits, True, first, last) for first, last in ((0, 4), (4, 8))]
    assert all(torch.isfinite(h).all() for h in halves)
    torch.testing.assert_close(halves[0] + halves[1], _reference(x, logits, True),
                               atol=0.03, rtol=0.03)
    logits[0, 5] = -20.0  # now rank [4, 8) receives no pair at all
    assert torch.isfinite(_layer_experts(x, logits, True, 4, 8)).all()


def test_gpt_oss_experts_are_hfs_with_their_biases_and_clamped_swiglu():
    """GPT-OSS (HF's GptOssExperts): softmax over the top-k router logits, each expert's
    x @ W13 + b13 with gate and up interleaved, (up + 1) * gate * sigmoid(1.702 gate) after
    clamping both at 7, then @ W2 + b2, weighted."""
    import torch

    x, logits = _inputs()
    x = x * 4  # reach the clamp at 7 now and then
    g = torch.Generator().manual_seed(2)
    biases = (torch.randn(E, 2 * INTER, generator=g), torch.randn(E, H, generator=g))
    w13, w2 = _weights()
    probs, ids = torch.softmax(logits.float(), -1).topk(TOP_K, -1)
    probs = probs / probs.sum(-1, keepdim=True)
    ref, largest = torch.zeros(x.shape), 0.0
    xb = x.to(torch.bfloat16).float()
    for t in range(x.shape[0]):
        for p, e in zip(probs[t], ids[t].tolist()):
            gate_up = xb[t] @ w13[e].to(torch.bfloat16).float().T + biases[0][e]
            largest = max(largest, gate_up.abs().max().item())
            gate, up = gate_up[::2].clamp(max=7.0), gate_up[1::2].clamp(-7.0, 7.0)
            hidden = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            ref[t] += p * (hidden @ w2[e].to(torch.bfloat16).float().T + biases[1][e])
    out = _layer_experts(x, logits, True, biases=biases)
    torch.testing.assert_close(out, ref, atol=0.1, rtol=0.03)
    assert largest > 7.0  # the clamp took part
    halves = [_layer_experts(x, logits, True, first, last, biases=biases)
              for first, last in ((0, 4), (4, 8))]
    torch.testing.assert_close(halves[0] + halves[1], out, atol=0.1, rtol=0.03)
