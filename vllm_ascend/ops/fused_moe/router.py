"""The MoE layer's router on torch_npu's gating operators, as upstream vllm-ascend's
``AscendFusedTopKRouter`` (ops/fused_moe/router/) calls them: softmax top-k
(``npu_moe_gating_top_k_softmax``: Qwen2/3-MoE, DeepSeek-V2-Lite, GPT-OSS) and, for a router
with sigmoid scores, expert groups or a score-correction bias (DeepSeek-V3/R1's ``noaux_tc``,
GLM-4.5, Kimi-K2; DeepSeek-V2's group-limited greedy), ``npu_moe_gating_top_k``. Contracts and
limits: docs/torch_npu_calls.md."""

import torch

from vllm_ascend.device import torch_npu

# npu_moe_gating_top_k's limits (torch_npu's API reference): the experts, the groups, top-k
MAX_EXPERTS, MAX_TOP_K = 2048, 32


def grouped(layer) -> bool:
    """Whether the layer routes on npu_moe_gating_top_k rather than softmax top-k."""
    return (layer.scoring_func == "sigmoid" or layer.e_score_correction_bias is not None
            or _groups(layer)[0] > 1)


def _groups(layer) -> tuple[int, int]:
    """(expert groups, groups chosen per token): (1, 1) for an ungrouped router."""
    if not layer.use_grouped_topk:
        return 1, 1
    return layer.num_expert_group or 1, layer.topk_group or 1


def routing_problems(layer) -> list[str]:
    """What of the layer's router the gating operators cannot run, by name (empty if none)."""
    groups, chosen = _groups(layer)
    experts, top_k = layer.global_num_experts, layer.top_k
    per_group = experts // groups
    fits = (experts <= MAX_EXPERTS and experts % groups == 0 and per_group > 2
            and -(-per_group // 32) * 32 * groups <= MAX_EXPERTS and 1 <= chosen <= groups
            and 1 <= top_k <= min(MAX_TOP_K, chosen * per_group))
    return [name for name, used in (
        (f"{layer.scoring_func} scores", layer.scoring_func not in ("softmax", "sigmoid")),
        # npu_moe_gating_top_k normalises sigmoid weights always (it takes renorm 0 only)
        ("sigmoid scores without renormalisation",
         layer.scoring_func == "sigmoid" and not layer.renormalize),
        (f"{experts} experts in {groups} groups with top-{top_k} of {chosen} groups (the "
         f"grouped gating operator takes at most {MAX_EXPERTS} experts, more than 2 per group, "
         f"and a top-k of at most {MAX_TOP_K} within the chosen groups)",
         grouped(layer) and not fits),
        ("a custom routing function", layer.custom_routing_function is not None),
        ("router weights applied to the input", layer.apply_router_weight_on_input)) if used]


def describe(layer) -> str:
    """The layer's routing, in words, for the start-up log."""
    if not grouped(layer):
        return (f"softmax top-{layer.top_k}{', renormalised' * bool(layer.renormalize)} "
                "(npu_moe_gating_top_k_softmax)")
    groups, chosen = _groups(layer)
    return (f"{layer.scoring_func} scores"
            + " plus a correction bias for the choice" * (layer.e_score_correction_bias
                                                          is not None)
            + (f", the best {chosen} of {groups} expert groups" if groups > 1 else "")
            + f", top-{layer.top_k}"
            + ", renormalised" * bool(layer.renormalize or layer.scoring_func == "sigmoid")
            + " (npu_moe_gating_top_k)")


def route(layer, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts (int32 ids) and their weights, routed_scaling_factor
    included. A grouped router's group score is the sum of its top two with a correction
    bias and its max without, as vLLM's ``grouped_topk``; the bias joins the choice only."""
    scale = layer.routed_scaling_factor
    if grouped(layer):
        sigmoid = layer.scoring_func == "sigmoid"
        bias = layer.ascend_gating_bias  # in the logits' dtype (method.py place)
        groups, chosen = _groups(layer)
        weights, ids, _ = torch_npu.npu_moe_gating_top_k(
            router_logits, k=layer.top_k, bias=bias,
            k_group=chosen, group_count=groups, group_select_mode=int(bias is not None),
            renorm=0, norm_type=int(sigmoid), out_flag=False,
            # the operator normalises sigmoid weights, then scales them; softmax weights are
            # renormalised below (if the model asks) before they are scaled
            routed_scaling_factor=scale if sigmoid else 1.0, eps=1e-20)
        if sigmoid:
            return weights, ids
    else:
        weights, ids, _ = torch_npu.npu_moe_gating_top_k_softmax(router_logits, k=layer.top_k)
    if layer.renormalize:  # Qwen3-MoE's norm_topk_prob
        weights = weights / weights.sum(dim=-1, keepdim=True)
    # (DeepSeek-V2/V3 in vLLM 0.32 may pass 1.0 here and have vLLM's MoE runner scale the
    # output: test_mla.py's bfloat16 case.)
    if scale != 1.0:
        weights = weights * scale
    return weights, ids
