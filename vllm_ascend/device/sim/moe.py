"""The simulator's mixture-of-experts operators, as upstream vllm-ascend's all-gather MoE path
calls them (ops/fused_moe/token_dispatcher.py ``TokenDispatcherWithAllGather``, moe_mlp.py
``unquant_apply_mlp``, device/device_op.py): gating top-k (softmax, and grouped with a
correction bias), routing, grouped matmul, unpermute.
docs/torch_npu_calls.md holds each contract and its source. Unquantized, dropless
(``drop_pad_mode=0``) only, plus the grouped matmul's per-token int8 quantization (upstream's
W8A8_DYNAMIC experts): anything else is refused by name, not ignored.

Where the chip leaves a value undefined (the rows of a grouped matmul's output past the routed
tokens, ``expanded_x`` rows past the valid count), the simulator writes NaN, so a consumer that
reads them gets poison, not a plausible zero.
"""

import torch
from torch.library import Library

from vllm_ascend.device.sim.errors import PARAM_INVALID, TILING_ERROR, AscendOpError
from vllm_ascend.device.sim.library_caches import first_calls_measured
from vllm_ascend.device.sim.trace import kernel

_lib = Library("ascend_sim", "FRAGMENT")
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
GMM_DTYPES = (torch.float16, torch.bfloat16)


def _error(op):
    return lambda code, message: AscendOpError(op, f"aclnn op of {op}", code, message)


_lib.define("npu_moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1) "
            "-> (Tensor, Tensor, Tensor)")
_lib.define("npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, int k_group=1, "
            "int group_count=1, int group_select_mode=0, int renorm=0, int norm_type=0, "
            "bool out_flag=False, float routed_scaling_factor=1.0, float eps=1e-20) "
            "-> (Tensor, Tensor, Tensor)")
_lib.define("npu_moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None, "
            "Tensor? offset=None, int active_num=-1, int expert_capacity=-1, int expert_num=-1, "
            "int drop_pad_mode=0, int expert_tokens_num_type=0, "
            "bool expert_tokens_num_flag=False, int quant_mode=0, "
            "int[] active_expert_range=[], int row_idx_type=0) "
            "-> (Tensor, Tensor, Tensor, Tensor)")
_lib.define("npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, "
            "Tensor[]? scale=None, Tensor[]? per_token_scale=None, Tensor? group_list=None, "
            "int split_item=0, int? group_type=None, int group_list_type=0, "
            "ScalarType? output_dtype=None) -> Tensor[]")
_lib.define("npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, "
            "Tensor? probs=None, bool padded_mode=False, int[]? restore_shape=None) -> Tensor")


def _gating_impl(x, finished=None, k=1):
    error = _error("npu_moe_gating_top_k_softmax")
    if x.dim() not in (2, 3) or x.dtype not in FLOATS:
        raise error(PARAM_INVALID, f"x must be 2-D or 3-D float16/bfloat16/float32, got "
                    f"{x.dim()}-D {x.dtype}")
    experts = x.shape[-1]
    if not 1 <= k <= experts:
        raise error(TILING_ERROR, f"k {k} must be in [1, expert num {experts}]")
    if finished is not None:
        raise NotImplementedError("npu_moe_gating_top_k_softmax: finished is not simulated")
    probs = torch.softmax(x.float(), dim=-1)
    y, expert_idx = probs.topk(k, dim=-1)
    rows = x.shape[:-1].numel()
    # row_idx[i][j] = j * rows + i: the order npu_moe_init_routing (v1) expects.
    row_idx = torch.arange(rows * k, dtype=torch.int32).view(k, rows).t().reshape(
        *x.shape[:-1], k)
    return y.to(x.dtype), expert_idx.to(torch.int32), row_idx.contiguous()


# npu_moe_gating_top_k's limits (torch_npu's API reference of the op): at most 2048 experts; per
# group more than 2, and the group size aligned up to 32 times the group count at most 2048;
# k at most 32 (the A2/A3 range in torch_npu 7.0's reference, the stricter of its two versions).
GATING_MAX_EXPERTS = 2048
GATING_MAX_K = 32


def _gating_groups_impl(x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0,
                        renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                        eps=1e-20):
    """Scores (softmax: norm_type 0, sigmoid: 1), plus the bias for the choice only; with
    group_count > 1, the k_group groups of the best score (the group's max: mode 0, or the sum of
    its top two: mode 1) are the only candidates; the top k of those, weighted by their scores
    without the bias, normalised in sigmoid mode (y / (sum + eps)), then times
    routed_scaling_factor: the formula and reference code of torch_npu's API reference."""
    error = _error("npu_moe_gating_top_k")
    if x.dim() != 2 or x.dtype not in FLOATS:
        raise error(PARAM_INVALID, f"x must be 2-D float16/bfloat16/float32, got {x.dim()}-D "
                    f"{x.dtype}")
    experts = x.shape[-1]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != experts or
                             bias.dtype != x.dtype):
        raise error(PARAM_INVALID, f"bias must be 1-D of the expert num {experts} in x's dtype "
                    f"{x.dtype}, got {bias.dim()}-D {list(bias.shape)} {bias.dtype}")
    if renorm != 0:
        raise error(PARAM_INVALID, f"renorm only supports 0, got {renorm}")
    if norm_type not in (0, 1) or group_select_mode not in (0, 1):
        raise error(PARAM_INVALID, f"norm_type ({norm_type}) and group_select_mode "
                    f"({group_select_mode}) must each be 0 or 1")
    if experts > GATING_MAX_EXPERTS or group_count <= 0 or experts % group_count:
        raise error(TILING_ERROR, f"the expert num {experts} must be at most "
                    f"{GATING_MAX_EXPERTS} and divisible by group_count {group_count}")
    per_group = experts // group_count
    if per_group <= 2 or -(-per_group // 32) * 32 * group_count > GATING_MAX_EXPERTS:
        raise error(TILING_ERROR, f"each of the {group_count} groups must hold more than 2 "
                    f"experts, and its size aligned to 32 times group_count at most "
                    f"{GATING_MAX_EXPERTS}; got {per_group} per group")
    if not 1 <= k_group <= group_count or not 1 <= k <= min(GATING_MAX_K, k_group * per_group):
        raise error(TILING_ERROR, f"need 1 <= k_group ({k_group}) <= group_count "
                    f"({group_count}) and 1 <= k ({k}) <= min({GATING_MAX_K}, k_group * "
                    f"experts / group_count = {k_group * per_group})")
    scores = torch.softmax(x.float(), -1) if norm_type == 0 else torch.sigmoid(x.float())
    choice = scores if bias is None else scores + bias.float()
    if group_count > 1:
        grouped = choice.view(-1, group_count, per_group)
        group_score = (grouped.amax(-1) if group_select_mode == 0 else
                       grouped.topk(2, dim=-1).values.sum(-1))
        keep = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :k_group]
        mask = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, keep, False)
        choice = grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).view(-1, experts)
    expert_idx = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k]
    y = scores.gather(1, expert_idx)
    if norm_type == 1:
        y = y / (y.sum(-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    # normOut only with out_flag; otherwise an empty tensor, so a reader fails
    out = scores if out_flag else scores.new_empty(0)
    return y.to(x.dtype), expert_idx.to(torch.int32), out


def _routing_impl(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                  expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0,
                  expert_tokens_num_flag=False, quant_mode=0, active_expert_range=(),
                  row_idx_type=0):
    error = _error("npu_moe_init_routing_v2")
    if x.dim() != 2 or x.dtype not in FLOATS:
        raise error(PARAM_INVALID, f"x must be 2-D float16/bfloat16/float32, got {x.dim()}-D "
                    f"{x.dtype}")
    if expert_idx.dim() != 2 or expert_idx.dtype != torch.int32 or \
            expert_idx.shape[0] != x.shape[0]:
        raise error(PARAM_INVALID, f"expert_idx must be int32 (NUM_ROWS={x.shape[0]}, K), got "
                    f"{expert_idx.dtype} {list(expert_idx.shape)}")
    if quant_mode != -1 or scale is not None or offset is not None:
        raise NotImplementedError("npu_moe_init_routing_v2: quantization is not simulated "
                                  "(quant_mode=-1, no scale or offset)")
    if drop_pad_mode != 0 or expert_capacity not in (-1, 0):
        raise NotImplementedError("npu_moe_init_routing_v2: only dropless routing "
                                  "(drop_pad_mode=0) is simulated")
    if expert_tokens_num_type not in (0, 1) or row_idx_type != 0:
        raise NotImplementedError("npu_moe_init_routing_v2: expert_tokens_num_type 0 (cumsum) "
                                  "or 1 (count) and row_idx_type 0 are simulated")
    if expert_num <= 0:
        raise error(TILING_ERROR, f"expert_num must be positive, got {expert_num}")
    start, end = active_expert_range if active_expert_range else (0, expert_num)
    if not 0 <= start < end <= expert_num:
        raise error(TILING_ERROR, f"active_expert_range [{start}, {end}) must lie in "
                    f"[0, expert_num {expert_num})")
    flat = expert_idx.reshape(-1).long()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= expert_num):
        raise error(TILING_ERROR, f"expert_idx holds ids outside [0, {expert_num})")
    rows_k = flat.numel()
    active = rows_k if active_num < 0 else min(active_num, rows_k)
    order = torch.sort(flat, stable=True).indices  # token-major positions, by expert
    kept = order[(flat[order] >= start) & (flat[order] < end)][:active]
    k = expert_idx.shape[1]
    expanded_x = torch.full((rows_k, x.shape[1]), float("nan"), dtype=x.dtype)
    expanded_x[:kept.numel()] = x[kept // k]
    expanded_row_idx = torch.full((rows_k,), -1, dtype=torch.int32)
    expanded_row_idx[kept] = torch.arange(kept.numel(), dtype=torch.int32)
    counts = torch.bincount(flat[kept] - start, minlength=end - start).to(torch.int64)
    tokens = counts if expert_tokens_num_type == 1 else counts.cumsum(0)
    if not expert_tokens_num_flag:
        tokens = torch.empty(0, dtype=torch.int64)
    expanded_scale = torch.full((rows_k,), float("nan"), dtype=torch.float32)  # undefined
    return expanded_x, expanded_row_idx, tokens, expanded_scale


# Per-token full quantization (int8 x and weights, a per-token scale): the scale's dtype picks
# the output's (torch_npu's table for a group_list tensor on A2/A3).
PER_TOKEN_OUTPUT = {torch.bfloat16: torch.bfloat16, torch.float32: torch.float16}


@first_calls_measured(lambda x, weight, **kw: (x[0].shape, weight[0].shape))
def _grouped_matmul_impl(x, weight, *, bias=None, scale=None, per_token_scale=None,
                         group_list=None, split_item=0, group_type=None, group_list_type=0,
                         output_dtype=None):
    error = _error("npu_grouped_matmul")
    if len(x) != 1 or len(weight) != 1 or split_item not in (2, 3) or group_type != 0:
        raise NotImplementedError("npu_grouped_matmul: one x split along M (group_type=0), "
                                  "one 3-D weight and one output (split_item 2 or 3) are "
                                  "simulated, as upstream's MoE calls it")
    (h,), (w,) = x, weight
    quantized = h.dtype == torch.int8
    if h.dim() != 2 or w.dim() != 3 or w.dtype != h.dtype or \
            h.dtype not in GMM_DTYPES + (torch.int8,):
        raise error(PARAM_INVALID, f"x must be 2-D and weight 3-D (E, K, N), float16, bfloat16 "
                    f"or int8 alike; got {h.dim()}-D {h.dtype} and {w.dim()}-D {w.dtype}")
    if w.shape[1] != h.shape[1]:
        raise error(TILING_ERROR, f"x's K {h.shape[1]} differs from weight's {w.shape[1]}")
    if group_list is None or group_list.dim() != 1 or group_list.dtype != torch.int64 or \
            group_list.shape[0] != w.shape[0]:
        raise error(PARAM_INVALID, f"group_list must be a 1-D int64 tensor of {w.shape[0]} "
                    "groups (one per expert)")
    if group_list_type not in (0, 1):
        raise error(PARAM_INVALID, f"group_list_type must be 0 (cumsum) or 1 (count), got "
                    f"{group_list_type}")
    counts = group_list if group_list_type == 1 else torch.diff(
        group_list, prepend=group_list.new_zeros(1))
    sizes = [int(n) for n in counts]  # the kernel reads its device input (not a host copy)
    if min(sizes, default=0) < 0 or sum(sizes) > h.shape[0]:
        raise error(TILING_ERROR, f"group_list {sizes} must be non-decreasing cumsums or "
                    f"non-negative counts within x's {h.shape[0]} rows")
    if quantized:
        out_dtype, factor = _per_token_factor(error, w, scale, per_token_scale, bias,
                                              output_dtype, h.shape[0])
    else:
        if scale is not None or per_token_scale is not None or \
                output_dtype not in (None, h.dtype):
            raise error(PARAM_INVALID, f"{h.dtype} x takes no scale or per_token_scale, and "
                        f"outputs {h.dtype}")
        out_dtype = h.dtype
    if bias is not None:
        (b,) = bias
        if tuple(b.shape) != (w.shape[0], w.shape[2]):
            raise error(PARAM_INVALID, f"bias must be (E, N) = {(w.shape[0], w.shape[2])}")
        # torch_npu's table (unquantized): float16 bias with float16 x, float32 with bfloat16.
        want = torch.float32 if h.dtype == torch.bfloat16 else torch.float16
        if b.dtype != want:
            raise error(PARAM_INVALID, f"bias must be {want} with {h.dtype} x, got {b.dtype}")
    out = torch.full((h.shape[0], w.shape[2]), float("nan"), dtype=out_dtype)
    start = 0
    for e, n in enumerate(sizes):
        if n:
            if quantized:  # int8 products summed exactly, then the two scales
                y = (h[start:start + n].double() @ w[e].double()).float() * factor(e, start, n)
            else:
                y = h[start:start + n].float() @ w[e].float()
            if bias is not None:
                y = y + bias[0][e].float()
            out[start:start + n] = y.to(out_dtype)
        start += n
    return [out]


def _per_token_factor(error, w, scale, per_token_scale, bias, output_dtype, rows):
    """The output dtype and ``factor(e, start, n)``, the [n, N] float32 multiplier of group e's
    int32 products: its weight scale per output channel times each row's token scale. Only
    per-token quantization without a bias is simulated (upstream's W8A8_DYNAMIC experts)."""
    if scale is None or per_token_scale is None or bias is not None:
        raise NotImplementedError("npu_grouped_matmul: int8 x is simulated with a per-token "
                                  "scale and a weight scale, without a bias (per-token full "
                                  "quantization) only")
    (s,), (t,) = scale, per_token_scale
    want = PER_TOKEN_OUTPUT.get(s.dtype)
    if want is None or output_dtype != want:
        raise error(PARAM_INVALID, f"per-token quantization takes a bfloat16 scale with "
                    f"output_dtype bfloat16 or a float32 scale with float16; got a {s.dtype} "
                    f"scale and output_dtype {output_dtype}")
    if tuple(s.shape) != (w.shape[0], w.shape[2]):
        raise error(TILING_ERROR, f"scale must be (E, N) = {(w.shape[0], w.shape[2])}, got "
                    f"{list(s.shape)}")
    if t.dtype != torch.float32 or tuple(t.shape) != (rows,):
        raise error(PARAM_INVALID, f"per_token_scale must be float32 [{rows}], got {t.dtype} "
                    f"{list(t.shape)}")
    return want, lambda e, start, n: s[e].float() * t[start:start + n].unsqueeze(1)


def _unpermute_impl(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
                    restore_shape=None):
    error = _error("npu_moe_token_unpermute")
    if padded_mode:
        raise error(PARAM_INVALID, "current version only support padded_mode is false")
    if permuted_tokens.dim() != 2 or permuted_tokens.dtype not in FLOATS:
        raise error(PARAM_INVALID, "permuted_tokens must be 2-D float16/bfloat16/float32")
    if sorted_indices.dim() != 1 or sorted_indices.dtype != torch.int32 or \
            sorted_indices.shape[0] != permuted_tokens.shape[0]:
        raise error(PARAM_INVALID, f"sorted_indices must be 1-D int32 of "
                    f"{permuted_tokens.shape[0]} entries")
    k = 1 if probs is None else probs.shape[1]
    if probs is not None and (probs.dim() != 2 or probs.numel() != sorted_indices.shape[0]):
        raise error(PARAM_INVALID, f"probs must be (tokens, topk) with tokens x topk = "
                    f"{sorted_indices.shape[0]}")
    rows = sorted_indices.long()
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= permuted_tokens.shape[0]):
        raise error(TILING_ERROR, "sorted_indices hold rows outside permuted_tokens")
    gathered = permuted_tokens[rows].float().view(-1, k, permuted_tokens.shape[1])
    if probs is not None:
        gathered = gathered * probs.float().unsqueeze(-1)
    return gathered.sum(1).to(permuted_tokens.dtype)


_lib.impl("npu_moe_gating_top_k_softmax",
          kernel("npu_moe_gating_top_k_softmax", _gating_impl), "CPU")
_lib.impl("npu_moe_gating_top_k", kernel("npu_moe_gating_top_k", _gating_groups_impl), "CPU")
_lib.impl("npu_moe_init_routing_v2", kernel("npu_moe_init_routing_v2", _routing_impl), "CPU")
_lib.impl("npu_grouped_matmul", kernel("npu_grouped_matmul", _grouped_matmul_impl), "CPU")
_lib.impl("npu_moe_token_unpermute", kernel("npu_moe_token_unpermute", _unpermute_impl), "CPU")
