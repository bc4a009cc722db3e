"""The simulator's MC2 operators: ``npu_moe_distribute_dispatch_v2`` sends each token to the EP
ranks that hold its top-k experts, ``npu_moe_distribute_combine_v2`` brings the experts' outputs
back the same way and sums them by the routing weights, as upstream vllm-ascend's
``TokenDispatcherWithMC2`` calls them (ops/fused_moe/token_dispatcher.py).

Contracts (docs/torch_npu_calls.md): torch_npu's API reference of each op (Ascend/op-plugin
``docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_distribute_dispatch_v2.md`` and
``..._combine_v2.md``), with the limits of the chip ``VLLM_ASCEND_SIM_SOC`` names (sim/devices.py):
on the default simulator, which is neither an A2 nor an A3, they refuse to run. The chip's
options beyond upstream's call (quantized communication, shared-expert ranks, special experts,
the hierarchical algorithm, a 2-D active mask) are refused by name, not ignored.

On the chip each op is one kernel that moves data over HCCL's window; here each runs, inside
one operator (one node of a captured graph, re-run at each replay), fixed-size all-gathers over
the EP group's gloo process group, which ``comm_name`` registers under the name the product
passes as ``group_ep``. Rows of ``expand_x`` past those received, and outputs of inactive
tokens, are undefined on the chip: NaN here. ``assist_info_for_combine`` and
``ep_recv_counts`` carry what combine needs ("the model's other logic must not depend on them").
"""

import torch
from torch.library import Library

from vllm_ascend.device.sim import devices, memory
from vllm_ascend.device.sim.errors import PARAM_INVALID, TILING_ERROR, AscendOpError
from vllm_ascend.device.sim.trace import kernel

_lib = Library("ascend_sim", "FRAGMENT")
_GROUPS: dict = {}  # group_ep name -> the torch.distributed process group
ASSIST_WIDTH = 128  # assist_info_for_combine holds A x 128 int32
# per chip: (EP sizes, hidden sizes, tokens a rank sends); the fullmesh algorithms
LIMITS = {"A3": (lambda ep: 2 <= ep <= 768, lambda h: 1024 <= h <= 8192, 512),
          "A2": (lambda ep: ep in (2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256),
                 lambda h: 0 < h <= 7168 and h % 32 == 0, 256)}
ALGORITHMS = {"A3": ("", "fullmesh_v1"), "A2": ("", "fullmesh")}


def comm_name(group) -> str:
    """The name of ``group`` as ``group_ep`` (on the chip, its HCCL communicator's name)."""
    name = f"hccl_sim_{group.group_name}"
    _GROUPS[name] = group
    return name


def _align(x: int, to: int) -> int:
    return -(-x // to) * to


def window_bytes(generation: str, local_experts: int, max_bs: int, ep: int, hidden: int,
                 top_k: int, shared_expert_num: int) -> int:
    """The HCCL buffer (HCCL_BUFFSIZE) dispatch_v2/combine_v2 need, by the API reference's
    formula for the chip: A3 fullmesh_v1, A2 fullmesh with a 16-bit x."""
    if generation == "A3":
        return 2 * (local_experts * max_bs * ep * _align(_align(2 * hidden, 32) + 64, 512)
                    + (top_k + shared_expert_num) * max_bs * _align(2 * hidden, 512))
    return 2 * (max_bs * ep * min(local_experts, top_k) * hidden * 2 + (2 << 20))


def _check_common(op, x_shape, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num,
                  x_active_mask, tp_world_size, expert_shard_type, shared_expert_rank_num,
                  global_bs, comm_alg, special_experts, elastic_info):
    """The checks dispatch and combine share; returns (chip generation, group, local experts,
    the largest BS of the ranks)."""
    def error(code, message):
        return AscendOpError(op, f"aclnn op of {op}", code, message)

    generation = devices.soc_generation()
    if generation is None:
        raise error(PARAM_INVALID, f"{op} runs on Atlas A2 and A3 chips; this device is "
                    f"{devices.soc_name()!r} (the simulator's {devices.SOC_ENV} names the chip)")
    ep_ok, hidden_ok, max_bs = LIMITS[generation]
    if any(special_experts) or elastic_info is not None or shared_expert_rank_num:
        raise NotImplementedError(f"{op}: shared-expert ranks, zero/copy/constant experts and "
                                  "elastic_info are not simulated")
    if comm_alg not in ALGORITHMS[generation]:
        raise NotImplementedError(f"{op}: comm_alg {comm_alg!r} is not simulated on "
                                  f"{generation} (only {ALGORITHMS[generation]})")
    if tp_world_size not in (0, 1) or expert_shard_type != 0:
        raise error(PARAM_INVALID, f"tp_world_size must be 0 or 1 and expert_shard_type 0, got "
                    f"{tp_world_size} and {expert_shard_type}")
    group = _GROUPS.get(group_ep)
    if group is None or not 1 <= len(group_ep) < 128:
        raise error(PARAM_INVALID, f"group_ep {group_ep!r} names no communicator of this "
                    "process")
    if ep_world_size != group.size() or ep_rank_id != group.rank():
        raise error(PARAM_INVALID, f"ep_world_size {ep_world_size} / ep_rank_id {ep_rank_id} "
                    f"do not match group_ep's {group.size()} ranks / rank {group.rank()}")
    if not ep_ok(ep_world_size):
        raise error(TILING_ERROR, f"ep_world_size {ep_world_size} is outside {generation}'s "
                    "range")
    if not 1 <= moe_expert_num <= 1024 or moe_expert_num % ep_world_size:
        raise error(TILING_ERROR, f"moe_expert_num {moe_expert_num} must be in [1, 1024] and a "
                    f"multiple of ep_world_size {ep_world_size}")
    local_experts = moe_expert_num // ep_world_size
    if generation == "A3" and local_experts * ep_world_size > 2048:
        raise error(TILING_ERROR, "local_expert_num x ep_world_size must be at most 2048")
    bs, hidden = x_shape
    if not hidden_ok(hidden):
        raise error(TILING_ERROR, f"H {hidden} is outside {generation}'s range for MC2")
    if not 0 < bs <= max_bs:
        raise error(TILING_ERROR, f"BS {bs} must be in (0, {max_bs}] on {generation}")
    if expert_ids.dim() != 2 or expert_ids.dtype != torch.int32 or expert_ids.shape[0] != bs:
        raise error(PARAM_INVALID, f"expert_ids must be int32 (BS={bs}, K), got "
                    f"{tuple(expert_ids.shape)} {expert_ids.dtype}")
    k = expert_ids.shape[1]
    if not 0 < k <= min(16, moe_expert_num):
        raise error(TILING_ERROR, f"K {k} must be in (0, min(16, moe_expert_num))")
    ids = expert_ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= moe_expert_num):
        raise error(TILING_ERROR, f"expert_ids hold ids outside [0, {moe_expert_num})")
    if k > 1 and bool((ids.sort(1).values.diff(dim=1) == 0).any()):
        raise error(TILING_ERROR, "an expert_ids row repeats an expert")
    if x_active_mask is not None:
        if x_active_mask.dim() == 2:
            raise NotImplementedError(f"{op}: a 2-D x_active_mask is not simulated")
        if x_active_mask.dtype != torch.bool or tuple(x_active_mask.shape) != (bs,):
            raise error(PARAM_INVALID, f"x_active_mask must be bool (BS={bs},)")
        if bool((x_active_mask[1:] & ~x_active_mask[:-1]).any()):
            raise error(PARAM_INVALID, "x_active_mask's true values must all precede its false "
                        "ones")
    # Every rank's BS (and mask), for the global_bs rule: fixed-size all-gathers.
    counts = _all_gather(group, torch.tensor([bs], dtype=torch.int64)).view(-1)
    most = int(counts.max())
    all_active = x_active_mask is None or bool(x_active_mask.all())
    unequal = int(counts.min()) != most
    if global_bs not in (0, most * ep_world_size) or (global_bs == 0 and unequal):
        sizes = [int(c) for c in counts]
        raise error(TILING_ERROR, f"global_bs {global_bs} with the ranks' BS {sizes}: pass 0 "
                    "or BS x ep_world_size when every rank sends the same BS, else "
                    "max BS x ep_world_size")
    if unequal and not bool(_all_gather(group, torch.tensor([all_active])).all()):
        raise error(PARAM_INVALID, "when the ranks' BS differ, every token must be active")
    return generation, group, local_experts, most


def _all_gather(group, t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(group.size())]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.stack(parts)


_lib.define(
    "npu_moe_distribute_dispatch_v2(Tensor x, Tensor expert_ids, str group_ep, "
    "int ep_world_size, int ep_rank_id, int moe_expert_num, *, Tensor? scales=None, "
    "Tensor? x_active_mask=None, Tensor? expert_scales=None, Tensor? elastic_info=None, "
    "Tensor? performance_info=None, str group_tp='', int tp_world_size=0, int tp_rank_id=0, "
    "int expert_shard_type=0, int shared_expert_num=1, int shared_expert_rank_num=0, "
    "int quant_mode=0, int global_bs=0, int expert_token_nums_type=1, str comm_alg='', "
    "int zero_expert_num=0, int copy_expert_num=0, int const_expert_num=0) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _dispatch_impl(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                   scales=None, x_active_mask=None, expert_scales=None, elastic_info=None,
                   performance_info=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                   expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0,
                   quant_mode=0, global_bs=0, expert_token_nums_type=1, comm_alg="",
                   zero_expert_num=0, copy_expert_num=0, const_expert_num=0):
    op = "npu_moe_distribute_dispatch_v2"
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16):
        raise AscendOpError(op, f"aclnn op of {op}", PARAM_INVALID,
                            f"x must be 2-D float16/bfloat16 (BS, H), got {x.dim()}-D {x.dtype}")
    if quant_mode != 0 or scales is not None or expert_scales is not None or \
            performance_info is not None:
        raise NotImplementedError(f"{op}: quant_mode 2, scales, expert_scales and "
                                  "performance_info are not simulated")
    if expert_token_nums_type not in (0, 1):
        raise AscendOpError(op, f"aclnn op of {op}", PARAM_INVALID,
                            "expert_token_nums_type must be 0 (cumsum) or 1 (counts)")
    generation, group, local, most = _check_common(
        op, tuple(x.shape), expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num,
        x_active_mask, tp_world_size, expert_shard_type, shared_expert_rank_num, global_bs,
        comm_alg, (zero_expert_num, copy_expert_num, const_expert_num), elastic_info)
    bs, hidden = x.shape
    k = expert_ids.shape[1]
    need = window_bytes(generation, local, most, ep_world_size, hidden, k, shared_expert_num)
    have = memory.hccl_buffer_bytes(devices.total_memory()) // 2
    if need > have:
        raise AscendOpError(op, f"aclnn op of {op}", TILING_ERROR,
                            f"the HCCL buffer ({have >> 20} MB, HCCL_BUFFSIZE) is smaller than "
                            f"the {-(-need // (1 << 20))} MB {op} needs for BS {most}")
    # Fixed-size exchange: every rank's tokens (padded to the largest BS), ids, activity.
    pad = most - bs
    active = torch.ones(bs, dtype=torch.bool) if x_active_mask is None else x_active_mask
    xs = _all_gather(group, torch.nn.functional.pad(x, (0, 0, 0, pad)))
    ids = _all_gather(group, torch.nn.functional.pad(expert_ids, (0, 0, 0, pad), value=-1))
    act = _all_gather(group, torch.nn.functional.pad(active, (0, pad)))
    first = ep_rank_id * local
    # (source rank, token, k) pairs routed here, in the chip's order: by local expert, then by
    # source rank, then by token.
    mine = (ids >= first) & (ids < first + local) & act.unsqueeze(-1)
    src, tok, kk = mine.nonzero(as_tuple=True)
    expert = ids[src, tok, kk].long() - first
    order = torch.argsort(expert * (ep_world_size * most) + src * most + tok, stable=True)
    src, tok, kk, expert = src[order], tok[order], kk[order], expert[order]
    rows = (global_bs or bs * ep_world_size) * min(local, k)
    expand_x = torch.full((rows, hidden), float("nan"), dtype=x.dtype)
    expand_x[:src.numel()] = xs[src, tok]
    assist = torch.full((rows, ASSIST_WIDTH), -1, dtype=torch.int32)
    assist[:src.numel(), :3] = torch.stack([src, tok, kk], 1).to(torch.int32)
    per_expert = torch.bincount(expert, minlength=local)
    per_pair = torch.bincount(expert * ep_world_size + src, minlength=local * ep_world_size)
    tokens = per_expert if expert_token_nums_type == 1 else per_expert.cumsum(0)
    return (expand_x, torch.empty(0, dtype=torch.float32), assist.view(-1),
            tokens.to(torch.int64), per_pair.cumsum(0).to(torch.int32),
            torch.zeros(max(tp_world_size, 1), dtype=torch.int32),
            torch.empty(0, dtype=torch.float32))  # expand_scales: none without "hierarchy"


_lib.define(
    "npu_moe_distribute_combine_v2(Tensor expand_x, Tensor expert_ids, "
    "Tensor assist_info_for_combine, Tensor ep_send_counts, Tensor expert_scales, str group_ep, "
    "int ep_world_size, int ep_rank_id, int moe_expert_num, *, Tensor? tp_send_counts=None, "
    "Tensor? x_active_mask=None, Tensor? expand_scales=None, Tensor? shared_expert_x=None, "
    "Tensor? elastic_info=None, Tensor? ori_x=None, Tensor? const_expert_alpha_1=None, "
    "Tensor? const_expert_alpha_2=None, Tensor? const_expert_v=None, "
    "Tensor? performance_info=None, str group_tp='', int tp_world_size=0, int tp_rank_id=0, "
    "int expert_shard_type=0, int shared_expert_num=1, int shared_expert_rank_num=0, "
    "int global_bs=0, int comm_quant_mode=0, str comm_alg='', int zero_expert_num=0, "
    "int copy_expert_num=0, int const_expert_num=0) -> Tensor")


def _combine_impl(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales,
                  group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None,
                  x_active_mask=None, expand_scales=None, shared_expert_x=None,
                  elastic_info=None, ori_x=None, const_expert_alpha_1=None,
                  const_expert_alpha_2=None, const_expert_v=None, performance_info=None,
                  group_tp="", tp_world_size=0, tp_rank_id=0, expert_shard_type=0,
                  shared_expert_num=1, shared_expert_rank_num=0, global_bs=0, comm_quant_mode=0,
                  comm_alg="", zero_expert_num=0, copy_expert_num=0, const_expert_num=0):
    op = "npu_moe_distribute_combine_v2"

    def error(code, message):
        return AscendOpError(op, f"aclnn op of {op}", code, message)

    if expand_x.dim() != 2 or expand_x.dtype not in (torch.float16, torch.bfloat16):
        raise error(PARAM_INVALID, "expand_x must be 2-D float16/bfloat16 (A, H)")
    if comm_quant_mode != 0 or shared_expert_x is not None or performance_info is not None or \
            any(t is not None for t in (ori_x, const_expert_alpha_1, const_expert_alpha_2,
                                        const_expert_v)):
        raise NotImplementedError(f"{op}: comm_quant_mode 2, shared_expert_x, ori_x, constant "
                                  "experts and performance_info are not simulated")
    if expand_scales is not None and expand_scales.numel():
        raise error(PARAM_INVALID, "expand_scales is taken with comm_alg 'hierarchy' only")
    if expert_ids.dim() != 2:
        raise error(PARAM_INVALID, "expert_ids must be 2-D (BS, K)")
    bs, k = expert_ids.shape
    generation, group, local, most = _check_common(
        op, (bs, expand_x.shape[1]), expert_ids, group_ep, ep_world_size, ep_rank_id,
        moe_expert_num, x_active_mask, tp_world_size, expert_shard_type,
        shared_expert_rank_num, global_bs, comm_alg,
        (zero_expert_num, copy_expert_num, const_expert_num), elastic_info)
    rows = expand_x.shape[0]
    if rows < (global_bs or bs * ep_world_size) * min(local, k):
        raise error(TILING_ERROR, f"expand_x has {rows} rows, fewer than A of the dispatch")
    if tuple(assist_info_for_combine.shape) != (rows * ASSIST_WIDTH,) or \
            assist_info_for_combine.dtype != torch.int32:
        raise error(PARAM_INVALID, f"assist_info_for_combine must be int32 ({rows} x 128,)")
    if tuple(ep_send_counts.shape) != (ep_world_size * local,) or \
            ep_send_counts.dtype != torch.int32:
        raise error(PARAM_INVALID, f"ep_send_counts must be int32 ({ep_world_size * local},) "
                    "on A3")
    if expert_scales.dtype != torch.float32 or tuple(expert_scales.shape) != (bs, k):
        raise error(PARAM_INVALID, f"expert_scales must be float32 ({bs}, {k})")
    # Every rank's received rows, where they came from, and how many are valid.
    outs = _all_gather(group, expand_x)
    assists = _all_gather(group, assist_info_for_combine.view(rows, ASSIST_WIDTH)[:, :3])
    valid = _all_gather(group, ep_send_counts[-1:].long()).view(-1)
    owner, row = [], []
    for r in range(ep_world_size):
        info = assists[r, :int(valid[r])]
        here = (info[:, 0] == ep_rank_id).nonzero().view(-1)
        owner.append(torch.full_like(here, r))
        row.append(here)
    owner, row = torch.cat(owner), torch.cat(row)
    tok = assists[owner, row, 1].long()
    kk = assists[owner, row, 2].long()
    active = torch.ones(bs, dtype=torch.bool) if x_active_mask is None else x_active_mask
    expected = int(active.sum()) * k
    holders = expert_ids.long()[tok, kk] // local
    if tok.numel() != expected or bool((holders != owner).any()) or (
            tok.numel() and bool((~active[tok]).any())):
        raise error(TILING_ERROR, "the combine's expert_ids, assist_info_for_combine and "
                    "ep_send_counts do not match one dispatch of this rank's tokens")
    gathered = torch.zeros(bs, k, expand_x.shape[1], dtype=torch.float32)
    gathered[tok, kk] = outs[owner, row].float()
    out = (gathered * expert_scales.unsqueeze(-1)).sum(1).to(expand_x.dtype)
    return out.masked_fill(~active.unsqueeze(1), float("nan"))


_lib.impl("npu_moe_distribute_dispatch_v2", kernel("npu_moe_distribute_dispatch_v2",
                                                   _dispatch_impl), "CPU")
_lib.impl("npu_moe_distribute_combine_v2", kernel("npu_moe_distribute_combine_v2",
                                                  _combine_impl), "CPU")
