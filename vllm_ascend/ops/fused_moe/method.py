"""The MoE layer's expert computation on torch_npu's fused-MoE operators, as upstream
vllm-ascend's all-gather path calls them (``TokenDispatcherWithAllGather`` and
``unquant_apply_mlp``; contracts in docs/torch_npu_calls.md).

vLLM builds every MoE layer's experts with ``UnquantizedFusedMoEMethod`` (a CustomOp); registered
out of tree, this class takes its place. It routes inside the layer (a monolithic method: it gets
the router logits, as upstream's does), and it moves tokens between data-parallel ranks itself
rather than through vLLM's naive dispatch, which needs an all-to-all manager the NPU
communicator does not have: an all-gather and reduce-scatter, with the padding to the largest
rank's token count that upstream's ``PrepareAndFinalizeWithAllGather`` does, or, where the
choice of comm.py says so, MC2's dispatch and combine as upstream's ``TokenDispatcherWithMC2``
calls them.
"""

import torch
from vllm.config import CUDAGraphMode, get_current_vllm_config
from vllm.distributed import get_dp_group, get_ep_group
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.activation import SwigluOAIAndMul
from vllm.model_executor.layers.fused_moe import MoEActivation, UnquantizedFusedMoEMethod

from vllm_ascend import device
from vllm_ascend.device import torch_npu
from vllm_ascend.logger import get_logger
from vllm_ascend.ops.fused_moe.comm import (MoEComm, MoECommSetup, chip_generation,
                                             mc2_capacity, select_moe_comm)
from vllm_ascend.ops.fused_moe.router import describe, route, routing_problems

logger = get_logger(__name__)


def expert_range(expert_map: torch.Tensor | None, local_experts: int) -> tuple[int, int]:
    """The global ids [first, last) of this rank's experts: all of them without expert
    parallelism; with it, one contiguous range (vLLM's linear placement), which is what
    ``npu_moe_init_routing_v2``'s ``active_expert_range`` can express."""
    if expert_map is None:
        return 0, local_experts
    local = expert_map.tolist()  # global id -> local slot, or -1 (another rank's)
    ids = [e for e, slot in enumerate(local) if slot >= 0]
    first = ids[0] if ids else 0
    if ids != list(range(first, first + local_experts)) or \
            [local[e] for e in ids] != list(range(local_experts)):
        raise ValueError(
            "vllm-ascend's MoE layer needs each expert-parallel rank's experts to be one "
            f"contiguous range of global ids in order (got {ids}): use the default "
            "--expert-placement-strategy linear, without redundant experts")
    return first, first + local_experts


def gather_group(parallel, num_tokens: int):
    """The group whose ranks' tokens an MoE layer gathers, and the most tokens a rank brings
    this step: none without data parallelism; with it, the DP group (each rank brings its step's
    tokens), or under vLLM's sequence-parallel MoE (DP x TP with expert parallelism) the EP
    group, each TP rank bringing its chunk of its DP rank's tokens (upstream's
    ``_prepare_with_ep_group``). The counts are host values (vLLM keeps them on the CPU), read
    without a device op; while a graph is captured they are hidden (compilation/acl_graph.py),
    since in a graph step every rank runs the same count."""
    if parallel.dp_size <= 1:
        return None, num_tokens
    group = get_ep_group() if parallel.is_sequence_parallel else get_dp_group()
    dp_metadata = get_forward_context().dp_metadata
    if dp_metadata is None:
        return group, num_tokens
    most = int(dp_metadata.num_tokens_across_dp_cpu.numpy().max())
    if parallel.is_sequence_parallel:
        most = -(-most // parallel.sp_size)  # sequence_parallel_chunk pads to a multiple
    return group, most


def comm_setup(moe, vllm_config) -> MoECommSetup:
    """The layer's side of the communication choice (comm.py): its chip, experts and parallel
    layout, the largest batch a rank runs in a graph (upstream's MC2 capacity: the largest
    capture size, or without graphs the largest decode batch), HCCL's buffer."""
    parallel = moe.moe_parallel_config
    compilation, scheduler = vllm_config.compilation_config, vllm_config.scheduler_config
    spec = vllm_config.speculative_config
    graphs = compilation.cudagraph_capture_sizes and compilation.cudagraph_mode not in (
        None, CUDAGraphMode.NONE)
    largest = (compilation.max_cudagraph_capture_size if graphs else
               scheduler.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0)))
    if parallel.is_sequence_parallel:
        largest = -(-largest // parallel.sp_size)
    return MoECommSetup(
        generation=chip_generation(device.current.device_name()), ep_size=parallel.ep_size,
        experts=moe.num_experts, top_k=moe.experts_per_token, hidden=moe.hidden_dim,
        partitioned=parallel.dp_size > 1 and (parallel.tp_size == 1
                                             or parallel.is_sequence_parallel),
        largest_batch=largest, window=device.current.hccl_buffer_bytes(),
        mc2_ops=all(hasattr(torch_npu, f"npu_moe_distribute_{op}_v2")
                    for op in ("dispatch", "combine")))


def first_moe_layer(model: torch.nn.Module):
    """The model's first MoE layer (its experts placed: process_weights_after_loading), or
    None."""
    return next((m for m in model.modules() if hasattr(m, "ascend_expert_range")), None)


def step_comm(layer, num_tokens: int) -> str | None:
    """The communication of the MoE layers in a step of ``num_tokens`` (the size the DP ranks
    agreed on), as apply_monolithic chooses it, also for the graph a replay runs; ``layer``
    the model's first MoE layer (first_moe_layer), None for a dense model."""
    if layer is None:
        return None
    parallel = layer.quant_method.moe.moe_parallel_config
    per_rank = -(-num_tokens // parallel.sp_size) if parallel.is_sequence_parallel else num_tokens
    return select_moe_comm(layer.quant_method.comm_setup, per_rank).comm.value


def log_layout(model: torch.nn.Module) -> None:
    """One line per worker (after its model loaded): where this rank's experts are and how
    tokens reach them; nothing for a dense model."""
    layer = first_moe_layer(model)
    if layer is None:
        return
    moe = layer.quant_method.moe
    parallel = moe.moe_parallel_config
    setup = layer.quant_method.comm_setup
    small, large = (select_moe_comm(setup, n)
                    for n in (1, max(moe.max_num_tokens, mc2_capacity(setup) + 1)))
    first, last = layer.ascend_expert_range
    where = (f"experts {first}-{last - 1} of {layer.global_num_experts} on EP rank "
             f"{parallel.ep_rank} of {parallel.ep_size}" if parallel.use_ep else
             f"all {layer.global_num_experts} experts"
             + (f", their weights split over {parallel.tp_size} ranks" if parallel.tp_size > 1
                else ""))
    if parallel.dp_size <= 1:
        gather = "every rank sees every token, no dispatch"
    elif parallel.is_sequence_parallel:
        gather = (f"all-gather and reduce-scatter over the EP group ({parallel.ep_size} ranks, "
                  f"each TP rank bringing 1/{parallel.sp_size} of its DP rank's tokens)")
    else:
        gather = f"all-gather and reduce-scatter over the DP group ({parallel.dp_size} ranks)"
    if small.comm == MoEComm.MC2:
        how = (f"tokens reach them by MC2 dispatch and combine over the EP group "
               f"({parallel.ep_size} ranks) up to {mc2_capacity(setup)} tokens a rank, every "
               f"graph size included; above, by {gather}")
    else:
        how = (f"tokens reach them by {gather}" if parallel.dp_size > 1 else gather) + \
            ", in every phase and graph mode"
    reasons = [small.reason] + [large.reason] * (large.reason != small.reason)
    logger.info("vllm-ascend: MoE layers: top-%d of %s; %s (%s)", layer.top_k, where, how,
                "; ".join(reasons))
    logger.info("vllm-ascend: MoE routing: %s; experts %s", describe(layer),
                getattr(layer.quant_method, "experts_kind", f"in {moe.in_dtype}"))


# The experts' activations, as upstream's unquant_apply_mlp runs them: SwiGLU in one kernel;
# GPT-OSS's clamped SwiGLU on interleaved gate/up columns through vLLM's torch version.
_OAI = type("SwigluOAIParams", (), dict(alpha=1.702, limit=7.0))  # vLLM's fixed values
ACTIVATIONS = {MoEActivation.SILU: lambda x: torch_npu.npu_swiglu(x),
               MoEActivation.SWIGLUOAI: lambda x: SwigluOAIAndMul.forward_native(_OAI, x)}
# npu_grouped_matmul's bias dtype for its x's (torch_npu's table: float16 with float16,
# float32 with bfloat16)
GMM_BIAS_DTYPE = {torch.bfloat16: torch.float32}


class AscendMoEExperts:
    """What the Ascend MoE methods share (unquantized here, W8A8_DYNAMIC in quantization/
    w8a8_moe.py): the refusals at load, routing inside the layer from the router logits, the
    data-parallel gather, the (token, expert) pairs sorted to this rank's experts and summed
    back by their weights. A method computes its experts' MLP on the sorted tokens (``_mlp``)."""

    activations = ACTIVATIONS  # the expert activations the method runs

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.comm_setup = comm_setup(self.moe, get_current_vllm_config())
        self._group_ep = None  # MC2's name of the EP group, at the first MC2 step

    @property
    def is_monolithic(self) -> bool:
        return True  # routes from the router logits itself (router.py)

    @property
    def supports_internal_mk(self) -> bool:
        return True  # its own DP all-gather/reduce-scatter: vLLM's runner must not dispatch

    def check_layer(self, layer) -> None:
        """Refuse a reload and what the layer cannot run, naming the layer."""
        if hasattr(layer, "ascend_expert_range"):  # processed once: this is a reload
            raise NotImplementedError(
                f"{layer.layer_name}: vllm-ascend cannot reload MoE expert weights in place yet: "
                "the experts are stored transposed in new memory after loading, which the "
                "captured graphs read, and a reload would leave them reading the old experts "
                "(docs/moe.md). Start a new engine on the new checkpoint instead.")
        unsupported = routing_problems(layer) + [
            f"{layer.activation.value} experts"] * (layer.activation not in self.activations)
        if unsupported:
            raise ValueError(
                f"{layer.layer_name}: vllm-ascend's MoE layer routes by softmax top-k, or by "
                "sigmoid or softmax scores over expert groups with a correction bias, to SwiGLU "
                "experts (Qwen2/3-MoE, DeepSeek-V2/V3, GLM-4.5, GPT-OSS); this model uses "
                f"{', '.join(unsupported)}, which it does not build (docs/moe.md). Serve one of "
                "those families.")

    def place(self, layer) -> None:
        """After loading: this rank's experts, and the router's correction bias in the router
        logits' dtype (npu_moe_gating_top_k's), cast once rather than at every step."""
        layer.ascend_expert_range = expert_range(layer.expert_map, layer.local_num_experts)
        bias = layer.e_score_correction_bias
        layer.ascend_gating_bias = None if bias is None else bias.data.to(
            self.moe.router_logits_dtype)

    def apply_monolithic(self, layer, x: torch.Tensor, router_logits: torch.Tensor,
                         input_ids: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens = x.shape[0]
        group, most = gather_group(self.moe.moe_parallel_config, num_tokens)
        if select_moe_comm(self.comm_setup, most).comm == MoEComm.MC2:
            return self._mc2(layer, x, router_logits, most)
        if group is not None:  # every rank routes every rank's tokens to its own experts
            pad = most - num_tokens
            if pad > 0:
                x = torch.nn.functional.pad(x, (0, 0, 0, pad))
                router_logits = torch.nn.functional.pad(router_logits, (0, 0, 0, pad))
            x = group.all_gather(x, 0)
            router_logits = group.all_gather(router_logits, 0)
        out = self._experts(layer, x, router_logits)
        if group is not None:  # each rank gets back its own tokens, summed over all experts
            out = group.reduce_scatter(out, 0)[:num_tokens]
        return out

    def _mc2(self, layer, x: torch.Tensor, router_logits: torch.Tensor, most: int):
        """Each rank sends its tokens to the ranks holding their experts and gets back their
        weighted sum, with upstream's arguments (TokenDispatcherWithMC2, A3). Every rank sends
        ``most`` tokens (global_bs 0): a rank with fewer pads, and its mask leaves the padding
        out. (In a graph every row is sent: upstream also masks the graph's padding, through a
        buffer it rewrites before each replay.)"""
        num_tokens = x.shape[0]
        if most > num_tokens:
            x = torch.nn.functional.pad(x, (0, 0, 0, most - num_tokens))
            router_logits = torch.nn.functional.pad(router_logits, (0, 0, 0, most - num_tokens))
        active = torch.arange(most, device=x.device) < num_tokens
        topk_weights, topk_ids = route(layer, router_logits)
        ep = get_ep_group()
        if self._group_ep is None:
            self._group_ep = device.current.hccl_comm_name(ep.device_group)
        common = dict(expert_ids=topk_ids, expert_shard_type=0, shared_expert_rank_num=0,
                      moe_expert_num=layer.global_num_experts, global_bs=0,
                      x_active_mask=active, group_ep=self._group_ep, ep_world_size=ep.world_size,
                      ep_rank_id=ep.rank_in_group, group_tp=self._group_ep, tp_world_size=1,
                      tp_rank_id=0)
        expand_x, _, assist, expert_tokens, ep_counts, tp_counts, expand_scales = \
            torch_npu.npu_moe_distribute_dispatch_v2(
                x=x, expert_token_nums_type=1, scales=None, quant_mode=0, **common)
        down = self._mlp(layer, expand_x, expert_tokens)
        out = torch_npu.npu_moe_distribute_combine_v2(
            expand_x=down, expert_scales=topk_weights.to(torch.float32),
            ep_send_counts=ep_counts, expand_scales=expand_scales, comm_quant_mode=0,
            assist_info_for_combine=assist, tp_send_counts=tp_counts, **common)
        return out[:num_tokens]

    def _experts(self, layer, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        top_k = layer.top_k
        topk_weights, topk_ids = route(layer, router_logits)
        first, last = layer.ascend_expert_range
        if last - first < layer.global_num_experts:
            # Another rank computes the tokens routed to its experts: weigh them 0 here.
            topk_weights = topk_weights * ((topk_ids >= first) & (topk_ids < last))
        sorted_x, expanded_row_idx, expert_tokens, _ = torch_npu.npu_moe_init_routing_v2(
            x, topk_ids, scale=None, active_num=x.shape[0] * top_k,
            expert_num=layer.global_num_experts, expert_tokens_num_type=1,
            expert_tokens_num_flag=True, active_expert_range=[first, last], quant_mode=-1)
        down = self._mlp(layer, sorted_x, expert_tokens.to(torch.int64))
        if last - first < layer.global_num_experts:
            # The pairs routed to other ranks point (through abs(-1)) at row 1, weighted 0; the
            # grouped matmul leaves the rows past this rank's routed pairs undefined, and
            # 0 x NaN is NaN: zero those rows (a rank may hold one routed pair, or none).
            routed = expert_tokens.sum()
            rows = torch.arange(down.shape[0], device=down.device)
            down = down.masked_fill((rows >= routed).unsqueeze(1), 0)
        return torch_npu.npu_moe_token_unpermute(
            permuted_tokens=down, sorted_indices=torch.abs(expanded_row_idx),
            probs=topk_weights)

    def _mlp(self, layer, sorted_x: torch.Tensor, expert_tokens: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for the tokens sorted by expert, ``expert_tokens`` to each."""
        raise NotImplementedError


@UnquantizedFusedMoEMethod.register_oot(name="UnquantizedFusedMoEMethod")
class AscendUnquantizedFusedMoEMethod(AscendMoEExperts, UnquantizedFusedMoEMethod):

    def process_weights_after_loading(self, layer) -> None:
        self.check_layer(layer)
        super().process_weights_after_loading(layer)  # the OOT backend keeps the weights as is
        # npu_grouped_matmul multiplies [M, K] by [E, K, N]: store the experts' weights
        # transposed (in place of vLLM's [E, N, K]), once, as upstream does after loading.
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(layer, name)
            weight.data = weight.data.transpose(1, 2).contiguous()
        if self.moe.has_bias:  # GPT-OSS: in the dtype npu_grouped_matmul takes with x's
            for name in ("w13_bias", "w2_bias"):
                bias = getattr(layer, name)
                bias.data = bias.data.to(GMM_BIAS_DTYPE.get(bias.dtype, bias.dtype))
        self.place(layer)

    def _mlp(self, layer, sorted_x: torch.Tensor, expert_tokens: torch.Tensor) -> torch.Tensor:
        biased = self.moe.has_bias
        gate_up = torch_npu.npu_grouped_matmul(
            x=[sorted_x], weight=[layer.w13_weight], bias=[layer.w13_bias] if biased else None,
            split_item=2, group_list_type=1, group_type=0, group_list=expert_tokens)[0]
        hidden = ACTIVATIONS[layer.activation](gate_up)
        return torch_npu.npu_grouped_matmul(
            x=[hidden], weight=[layer.w2_weight], bias=[layer.w2_bias] if biased else None,
            split_item=2, group_list_type=1, group_type=0, group_list=expert_tokens)[0]
