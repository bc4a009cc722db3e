"""The simulator's MLA operators, as upstream vllm-ascend's ``attention/mla_v1.py`` calls them:
the interleaved RoPE of the query's rope part, the fused KV RMSNorm + RoPE + cache write, FIA v2
on the latent cache (the decode path, with ``query_rope``/``key_rope``), and the batched matmul
that projects the latent output back to the value heads. docs/torch_npu_calls.md holds each
contract and its source; anything outside the MLA path upstream runs is refused by name.
"""

import torch
from torch.library import Library

from vllm_ascend.device.sim.aclnn import CAPTURING, INT32_MAX, require_contiguous, sampling
from vllm_ascend.device.sim.errors import PARAM_INVALID, TILING_ERROR, AscendOpError
from vllm_ascend.device.sim.fia import fia_attend
from vllm_ascend.device.sim.fia_checks import (ATTEN_MASK_SIZE, FIA_DTYPES, FIA_MAX_BATCH, band_of,
                                               check_causal_mask, check_fia)
from vllm_ascend.device.sim.library_caches import first_calls_measured
from vllm_ascend.device.sim.trace import kernel

_lib = Library("ascend_sim", "FRAGMENT")

ROPE_DIM = 64  # npu_interleave_rope and npu_kv_rmsnorm_rope_cache: D must be 64
RMS_DIM = 512  # npu_kv_rmsnorm_rope_cache: rms_size 512 only (hidden_size 576)
# FIA with query_rope (MLA): numHeads a power of two; upstream pads the heads to the next one
# ("ascend attention ops require padding heads to the next power of 2", mla_v1.py). Nkv is 1.
MLA_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_SPEC_QUERY = 16  # TND per-request query length (upstream asserts decode_threshold <= 16)


def _error(op, aclnn):
    return lambda code, message: AscendOpError(op, aclnn, code, message)


def _half_rope(x, cos, sin):
    """x in GPT-J (interleaved) order -> its rotation in half (neox) order, as the chip's
    interleave-rope kernels compute it: de-interleave, then x*cos + rotate_half(x)*sin."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.cat((x1, x2), -1) * cos + torch.cat((-x2, x1), -1) * sin


# -- npu_interleave_rope --------------------------------------------------------------------------

_lib.define("npu_interleave_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor")


def _interleave_rope_impl(x, cos, sin):
    err = _error("npu_interleave_rope", "aclnnInterleaveRope")
    if x.dim() != 4 or cos.dim() != 4 or sin.dim() != 4:
        raise err(PARAM_INVALID, "x, cos and sin must be 4-D (B, N, S, D)")
    if x.dtype not in FIA_DTYPES or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise err(PARAM_INVALID, f"x, cos and sin must share one dtype, bfloat16 or float16 "
                  f"(got {x.dtype}, {cos.dtype}, {sin.dtype})")
    require_contiguous(err, x=x, cos=cos, sin=sin)
    b, _, s, d = x.shape
    if d != ROPE_DIM or cos.shape[-1] != ROPE_DIM or sin.shape[-1] != ROPE_DIM:
        raise err(TILING_ERROR, f"the D dim of x, cos and sin must be {ROPE_DIM}, got "
                  f"{d}, {cos.shape[-1]}, {sin.shape[-1]}")
    if cos.shape != sin.shape or cos.shape[1] != 1 or cos.shape[0] != b or \
            cos.shape[2] not in (1, s):
        raise err(TILING_ERROR, f"cos/sin must be (B, 1, 1 or S, D) = ({b}, 1, 1 or {s}, {d}), "
                  f"got {list(cos.shape)} and {list(sin.shape)}")
    return _half_rope(x.float(), cos.float(), sin.float()).to(x.dtype)


_lib.impl("npu_interleave_rope", kernel("npu_interleave_rope", _interleave_rope_impl), "CPU")


# -- npu_kv_rmsnorm_rope_cache --------------------------------------------------------------------

_lib.define("npu_kv_rmsnorm_rope_cache(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, "
            "Tensor index, Tensor(a!) k_cache, Tensor(b!) ckv_cache, *, float epsilon=1e-05, "
            "str cache_mode='Norm', bool is_output_kv=False) -> (Tensor, Tensor)")


def _kv_rmsnorm_rope_cache_impl(kv, gamma, cos, sin, index, k_cache, ckv_cache, *,
                                epsilon=1e-5, cache_mode="Norm", is_output_kv=False):
    err = _error("npu_kv_rmsnorm_rope_cache", "aclnnKvRmsNormRopeCache")
    if cache_mode not in ("PA", "PA_BNSD"):
        # 'Norm' takes [batch, 1, cache_length, D] caches and per-batch offsets; the NZ and BLK
        # modes other layouts. vLLM's paged caches are ND blocks: PA.
        raise err(PARAM_INVALID, f"cache_mode {cache_mode!r} is not simulated: vllm-ascend's "
                  "paged ND caches take cache_mode='PA'")
    if kv.dim() != 4 or kv.shape[1] != 1 or kv.shape[3] != RMS_DIM + ROPE_DIM:
        raise err(TILING_ERROR, f"kv must be [batch_size, 1, seq_len, {RMS_DIM + ROPE_DIM}] "
                  f"(hidden_size {RMS_DIM} + {ROPE_DIM} only), got {list(kv.shape)}")
    if kv.dtype not in FIA_DTYPES or gamma.dtype != kv.dtype or cos.dtype != kv.dtype or \
            sin.dtype != kv.dtype:
        raise err(PARAM_INVALID, f"kv, gamma, cos and sin must share one dtype, bfloat16 or "
                  f"float16 (got {kv.dtype}, {gamma.dtype}, {cos.dtype}, {sin.dtype})")
    if k_cache.dtype != kv.dtype or ckv_cache.dtype != kv.dtype:
        raise err(PARAM_INVALID, "unquantized caches must have kv's dtype (quantized caches "
                  "are not simulated)")
    require_contiguous(err, kv=kv, gamma=gamma, cos=cos, sin=sin, index=index, k_cache=k_cache,
                        ckv_cache=ckv_cache)
    b, _, s, _ = kv.shape
    if list(gamma.shape) != [RMS_DIM]:
        raise err(TILING_ERROR, f"gamma must be [{RMS_DIM}], got {list(gamma.shape)}")
    if list(cos.shape) != [b, 1, s, ROPE_DIM] or cos.shape != sin.shape:
        raise err(TILING_ERROR, f"cos/sin must be [{b}, 1, {s}, {ROPE_DIM}], got "
                  f"{list(cos.shape)} and {list(sin.shape)}")
    if index.dtype != torch.int64 or list(index.shape) != [b * s]:
        raise err(PARAM_INVALID, f"in PA mode index must be a [batch_size*seq_len] = [{b * s}] "
                  f"int64 tensor, got {list(index.shape)} {index.dtype}")
    if k_cache.dim() != 4 or ckv_cache.dim() != 4 or k_cache.shape[2:] != (1, ROPE_DIM) or \
            ckv_cache.shape[2:] != (1, RMS_DIM) or k_cache.shape[:2] != ckv_cache.shape[:2]:
        raise err(TILING_ERROR, f"in PA mode k_cache must be [block_num, block_size, 1, "
                  f"{ROPE_DIM}] and ckv_cache [block_num, block_size, 1, {RMS_DIM}], got "
                  f"{list(k_cache.shape)} and {list(ckv_cache.shape)}")
    x = kv.float().reshape(b * s, -1)
    c = x[:, :RMS_DIM]
    c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + epsilon) * gamma.float()
    pe = _half_rope(x[:, RMS_DIM:], cos.float().reshape(b * s, -1),
                    sin.float().reshape(b * s, -1))
    c, pe = c.to(kv.dtype), pe.to(kv.dtype)
    slots = index
    keep = slots >= 0  # a padded token (-1, as vLLM marks it) writes nothing
    if not bool(keep.all()):
        slots, c_w, pe_w = slots[keep], c[keep], pe[keep]
    else:
        c_w, pe_w = c, pe
    capacity = k_cache.shape[0] * k_cache.shape[1]
    if slots.numel() and int(slots.max()) >= capacity:
        raise err(TILING_ERROR, f"index {int(slots.max())} is out of range [0, {capacity - 1}]")
    ckv_cache.view(capacity, RMS_DIM).index_copy_(0, slots, c_w)
    k_cache.view(capacity, ROPE_DIM).index_copy_(0, slots, pe_w)
    if not is_output_kv:
        empty = kv.new_empty(0)
        return empty, empty.clone()
    return pe.view(b, 1, s, ROPE_DIM), c.view(b, 1, s, RMS_DIM)


_lib.impl("npu_kv_rmsnorm_rope_cache",
          kernel("npu_kv_rmsnorm_rope_cache", _kv_rmsnorm_rope_cache_impl), "CPU")


# -- npu_transpose_batchmatmul --------------------------------------------------------------------

_lib.define("npu_transpose_batchmatmul(Tensor input, Tensor weight, *, int[]? perm_x1=None, "
            "int[]? perm_y=None) -> Tensor")


@first_calls_measured(lambda input, weight, **kw: (input.shape, weight.shape))
def _transpose_batchmatmul_impl(input, weight, *, perm_x1=None, perm_y=None):
    err = _error("npu_transpose_batchmatmul", "aclnnTransposeBatchMatMul")
    perm_x1 = list(perm_x1) if perm_x1 is not None else [0, 1, 2]
    perm_y = list(perm_y) if perm_y is not None else [1, 0, 2]
    if input.dim() != 3 or weight.dim() != 3:
        raise err(PARAM_INVALID, "input and weight must be 3-D")
    if input.dtype not in FIA_DTYPES or weight.dtype != input.dtype:
        raise err(PARAM_INVALID, f"input and weight must share one dtype, bfloat16 or float16 "
                  f"(got {input.dtype}, {weight.dtype})")
    require_contiguous(err, input=input, weight=weight)
    if perm_x1 not in ([0, 1, 2], [1, 0, 2]) or perm_y != [1, 0, 2]:
        raise err(PARAM_INVALID, f"perm_x1 must be [0, 1, 2] or [1, 0, 2] and perm_y "
                  f"[1, 0, 2], got {perm_x1} and {perm_y}")
    x = input.permute(perm_x1)  # [batch, M, K]
    if x.shape[0] != weight.shape[0] or x.shape[2] != weight.shape[1]:
        raise err(TILING_ERROR, f"input (permuted {list(x.shape)}) and weight "
                  f"{list(weight.shape)} do not multiply as [batch, M, K] x [batch, K, N]")
    return torch.bmm(x.float(), weight.float()).to(input.dtype).permute(perm_y).contiguous()


_lib.impl("npu_transpose_batchmatmul",
          kernel("npu_transpose_batchmatmul", _transpose_batchmatmul_impl), "CPU")


# -- FIA v2: on the latent cache (MLA decode), and dense with attention sinks ---------------------

_FIA_V2_ARGS = (
    "Tensor query, Tensor key, Tensor value, *, Tensor? query_rope=None, "
    "Tensor? key_rope=None, Tensor? atten_mask=None, SymInt[]? actual_seq_qlen=None, "
    "SymInt[]? actual_seq_kvlen=None, Tensor? block_table=None, int num_query_heads=1, "
    "int num_key_value_heads=0, float softmax_scale=1.0, str input_layout=\"BSH\", "
    "int sparse_mode=0, int block_size=0, bool return_softmax_lse=False, "
    "Tensor? learnable_sink=None, int pre_tokens=2147483647, int next_tokens=2147483647")
SINK_MAX_DV = 128  # learnable_sink: value head dim at most 128 (TORCH_NPU_CONTRACTS.md 1.6)
_lib.define(f"npu_fused_infer_attention_score_v2({_FIA_V2_ARGS}) -> (Tensor, Tensor)")
_lib.define(f"npu_fused_infer_attention_score_v2.out({_FIA_V2_ARGS}, Tensor? workspace=None, "
            "Tensor(a!) attention_out, Tensor(b!) softmax_lse) -> (Tensor(a!), Tensor(b!))")
V2_LAYOUTS = {"BNSD_NBSD": 4, "TND_NTD": 3}  # the layouts upstream's MLA decode passes


def fia_v2_error(code, message):
    return AscendOpError("npu_fused_infer_attention_score_v2",
                         "aclnnFusedInferAttentionScoreV4", code, message)


def check_fia_v2(query, key, value, query_rope, key_rope, atten_mask, actual_seq_qlen,
                 actual_seq_kvlen, block_table, num_query_heads, num_key_value_heads,
                 input_layout, sparse_mode, block_size, learnable_sink=None,
                 pre_tokens=INT32_MAX, next_tokens=INT32_MAX):
    """The host-side checks of FIA v2: returns (q_lens, kv_lens, out_shape). Two paths are
    simulated, as upstream calls them: the MLA decode (query_rope and key_rope given) and the
    dense TND one with attention sinks (neither given)."""
    err = fia_v2_error
    if query_rope is None and key_rope is None:
        return _check_dense_v2(query, key, value, atten_mask, actual_seq_qlen, actual_seq_kvlen,
                               block_table, num_query_heads, num_key_value_heads, input_layout,
                               sparse_mode, block_size, learnable_sink, pre_tokens, next_tokens)
    if query_rope is None or key_rope is None:
        raise err(TILING_ERROR, "query_rope and key_rope are given together (MLA) or not at all")
    if learnable_sink is not None or pre_tokens != INT32_MAX or next_tokens != INT32_MAX:
        raise err(TILING_ERROR, "learnable_sink and a band (pre_tokens/next_tokens) are not "
                  "simulated on the MLA path (query_rope given)")
    if input_layout not in V2_LAYOUTS:
        raise err(TILING_ERROR, f"input_layout {input_layout!r} is not simulated (MLA decode "
                  f"uses {' or '.join(V2_LAYOUTS)})")
    dims = V2_LAYOUTS[input_layout]
    if query.dim() != dims or query_rope.dim() != dims:
        raise RuntimeError("query's dim should be consistent with that of Layout")
    tensors = (query, key, value, query_rope, key_rope)
    if query.dtype not in FIA_DTYPES or any(t.dtype != query.dtype for t in tensors):
        raise err(PARAM_INVALID, "query, key, value, query_rope and key_rope must share one "
                  f"dtype, float16 or bfloat16 (got {[str(t.dtype) for t in tensors]})")
    require_contiguous(err, query=query, query_rope=query_rope, atten_mask=atten_mask,
                        block_table=block_table)
    if input_layout == "BNSD_NBSD":
        batch, n, s, d = query.shape
        if s != 1:
            raise err(TILING_ERROR, f"BNSD with a query length of {s}: the MLA decode takes one "
                      "token per request in BNSD (use TND_NTD for several)")
        tokens = batch
    else:
        tokens, n, d = query.shape
    dr = query_rope.shape[-1]
    if d != RMS_DIM or dr != ROPE_DIM or query_rope.shape[:-1] != query.shape[:-1]:
        raise err(TILING_ERROR, f"with query_rope, query's D must be {RMS_DIM} and "
                  f"query_rope's {ROPE_DIM} on the same leading dims, got {list(query.shape)} "
                  f"and {list(query_rope.shape)}")
    if n != num_query_heads or n not in MLA_HEADS:
        raise err(TILING_ERROR, f"numHeads({num_query_heads}) must equal query's N({n}) and be "
                  f"one of {list(MLA_HEADS)} when query_rope is given")
    if num_key_value_heads != 1:
        raise err(TILING_ERROR, f"numKeyValueHeads({num_key_value_heads}) must be 1 when "
                  "query_rope is given (MLA)")
    if block_table is None:
        raise err(TILING_ERROR, "the MLA path reads the paged latent cache: block_table is "
                  "required")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise err(PARAM_INVALID, f"block_table must be a 2-D int32 tensor, got "
                  f"{block_table.dim()}-D {block_table.dtype}")
    # Paged caches [num_blocks, Nkv, block_size, D] (upstream's k_nope.view(-1, 1, bs, 512)).
    for name, t, dim in (("key", key, d), ("value", value, d), ("key_rope", key_rope, dr)):
        if t.dim() != 4 or t.shape[1] != 1 or t.shape[2] != block_size or t.shape[3] != dim:
            raise err(TILING_ERROR, f"{name} must be the paged cache [num_blocks, 1, "
                      f"{block_size}, {dim}], got {list(t.shape)}")
    if key.shape[0] != key_rope.shape[0] or not (key.data_ptr() == value.data_ptr()):
        raise err(TILING_ERROR, "with query_rope, value is the latent key cache itself (MLA)")
    if block_size % 16 != 0 or not 0 < block_size <= 512:
        raise err(TILING_ERROR, f"blockSize({block_size}) must be a multiple of 16, at most "
                  "512")
    kv = list(actual_seq_kvlen or [])
    if input_layout == "BNSD_NBSD":
        if actual_seq_qlen is not None:
            raise err(TILING_ERROR, "BNSD takes no actual_seq_qlen (one token per request)")
        if sparse_mode != 0 or atten_mask is not None:
            raise err(TILING_ERROR, "one query token per request needs no mask: sparse_mode 0")
        q_lens = [1] * batch
        out_shape = (n, batch, 1, d)
    else:
        cu = list(actual_seq_qlen or [])
        if not cu or cu[-1] != tokens or any(b < a for a, b in zip([0] + cu[:-1], cu)):
            raise err(TILING_ERROR, f"When layout is TND, queryT({tokens}) must be equal to the "
                      f"last element of a non-decreasing actualSequenceLengthQ({cu})")
        q_lens = [b - a for a, b in zip([0] + cu[:-1], cu)]
        if max(q_lens) > MAX_SPEC_QUERY:
            raise err(TILING_ERROR, f"a request has {max(q_lens)} query tokens; TND on the "
                      f"latent cache takes at most {MAX_SPEC_QUERY}")
        if sparse_mode != 3 or atten_mask is None:
            raise err(TILING_ERROR, "TND with several query tokens per request needs "
                      "sparse_mode 3 and the 2048x2048 causal mask")
        if atten_mask.dtype not in (torch.bool, torch.int8, torch.uint8) or \
                atten_mask.shape[-2:] != (ATTEN_MASK_SIZE, ATTEN_MASK_SIZE):
            raise err(TILING_ERROR, "the causal mask must be 2048x2048 bool/int8/uint8")
        check_causal_mask(atten_mask)
        out_shape = (n, tokens, d)
    batch = len(q_lens)
    if len(kv) != batch or batch > FIA_MAX_BATCH:
        raise err(TILING_ERROR, f"The size({len(kv)}) of actualSeqLengthsKv is not equal to the "
                  f"batchSize({batch})")
    if not all(isinstance(v, int) for v in kv):
        raise TypeError("actual_seq_kvlen must be a list of host ints")
    need = max(-(-max(kv) // block_size), 1)
    if block_table.shape[0] < batch or block_table.shape[1] < need:
        raise err(TILING_ERROR, "When page attention enable, block table shape should be "
                  f"[{batch}, >={need}], now is {list(block_table.shape)}")
    for b, (q, k) in enumerate(zip(q_lens, kv)):
        if k < q:
            raise err(TILING_ERROR, f"actualSeqLengthsKv[{b}]({k}) is less than the query "
                      f"length({q})")
    return q_lens, kv, out_shape


def _check_dense_v2(query, key, value, atten_mask, actual_seq_qlen, actual_seq_kvlen,
                    block_table, num_query_heads, num_key_value_heads, input_layout,
                    sparse_mode, block_size, learnable_sink, pre_tokens, next_tokens):
    """FIA v2 without query_rope: v1's checks under v2's names (upstream's attention_v1.py calls
    it so only for layers with sinks), then the sink's: bfloat16 (Nq,), TND only, a value head
    dim of at most 128 (TORCH_NPU_CONTRACTS.md 1.6). With a float16 query the sink is refused
    too: the contract names bfloat16 only (the stricter reading)."""
    err = fia_v2_error
    q_lens, kv_lens, d = check_fia(query, key, value, atten_mask, actual_seq_qlen,
                                   actual_seq_kvlen, block_table, num_query_heads,
                                   num_key_value_heads, input_layout, sparse_mode, block_size,
                                   pre_tokens, next_tokens, err=err)
    dv = value.shape[-1] if block_table is None else d
    if learnable_sink is not None:
        if learnable_sink.dtype != torch.bfloat16 or query.dtype != torch.bfloat16:
            raise err(PARAM_INVALID, "learnable_sink takes bfloat16, with a bfloat16 query; got "
                      f"{learnable_sink.dtype} and {query.dtype}")
        if learnable_sink.dim() != 1 or learnable_sink.shape[0] != num_query_heads:
            raise err(PARAM_INVALID, f"learnable_sink must be 1-D of numHeads({num_query_heads}) "
                      f"elements, got {list(learnable_sink.shape)}")
        if dv > SINK_MAX_DV:
            raise err(TILING_ERROR, f"learnable_sink takes a value head dim of at most "
                      f"{SINK_MAX_DV}, got {dv}")
        require_contiguous(err, learnable_sink=learnable_sink)
    return q_lens, kv_lens, (query.shape[0], query.shape[1], dv)


def fia_v2_kernel(query, key, query_rope, key_rope, block_table, q_lens, kv_lens, scale,
                  block_size, out):
    """Each query token over its request's latent KV (causal: token i of q sits at position
    kv_len - q + i): scores from the latent and rope parts, values the latent itself. ``out``
    is [N, T, D] (NTD, or NBSD viewed so)."""
    n, d = query.shape[1], query.shape[-1]  # BNSD and TND both have N at dim 1
    q = query.reshape(-1, n, d).float()
    qr = query_rope.reshape(-1, n, query_rope.shape[-1]).float()
    o = out.view(n, -1, d)
    batch = len(q_lens)
    max_kv = max(kv_lens)
    if max_kv == 0:
        o.zero_()
        return
    kc = key.squeeze(1).view(-1, block_size, d)
    kr = key_rope.squeeze(1).view(-1, block_size, key_rope.shape[-1])
    nblk = max(1, -(-max_kv // block_size))
    blocks = block_table[:batch, :nblk].reshape(-1).long()
    kc = kc.index_select(0, blocks).view(batch, nblk * block_size, d)[:, :max_kv].float()
    kr = kr.index_select(0, blocks).view(batch, nblk * block_size, -1)[:, :max_kv].float()
    start = 0
    dev = query.device
    for b, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        if ql == 0:
            continue
        scores = (torch.einsum("tnd,sd->nts", q[start:start + ql], kc[b, :kl])
                  + torch.einsum("tnd,sd->nts", qr[start:start + ql], kr[b, :kl])) * scale
        pos = kl - ql + torch.arange(ql, device=dev)
        mask = torch.arange(kl, device=dev)[None, :] > pos[:, None]
        scores.masked_fill_(mask[None], float("-inf"))
        o[:, start:start + ql] = torch.einsum("nts,sd->ntd", scores.softmax(-1),
                                              kc[b, :kl]).to(o.dtype)
        start += ql


def _fia_v2_run(query, key, value, query_rope, key_rope, atten_mask, actual_seq_qlen,
                actual_seq_kvlen, block_table, num_query_heads, num_key_value_heads,
                softmax_scale, input_layout, sparse_mode, block_size, out, learnable_sink,
                pre_tokens, next_tokens):
    q_lens, kv_lens, out_shape = check_fia_v2(
        query, key, value, query_rope, key_rope, atten_mask, actual_seq_qlen, actual_seq_kvlen,
        block_table, num_query_heads, num_key_value_heads, input_layout, sparse_mode,
        block_size, learnable_sink, pre_tokens, next_tokens)
    if out is None:
        out = query.new_zeros(out_shape)
    elif tuple(out.shape) != out_shape or out.dtype != query.dtype or not out.is_contiguous():
        raise fia_v2_error(TILING_ERROR, f"attention_out must be a contiguous {list(out_shape)} "
                           f"{query.dtype} tensor, got {list(out.shape)} {out.dtype}")
    if CAPTURING.active:  # checked, not run (aclnn.CAPTURING)
        return CAPTURING.unwritten(out)
    if query_rope is None:
        fia_attend(query, key, value, block_table, actual_seq_qlen, actual_seq_kvlen, q_lens,
                   kv_lens, num_query_heads, num_key_value_heads or num_query_heads,
                   query.shape[-1], softmax_scale, sparse_mode,
                   band_of(sparse_mode, pre_tokens, next_tokens), block_size, out,
                   learnable_sink)
        return out
    fia_v2_kernel(query, key, query_rope, key_rope, block_table, q_lens, kv_lens,
                  softmax_scale, block_size, out)
    return out


def fia_v2_workspace_elements(query, block_table, num_heads) -> int:
    """As for v1: depends on the shapes only, so one workspace serves every update."""
    return 4096 + 64 * num_heads * (query.shape[0] + block_table.shape[0])


def _fia_v2_impl(query, key, value, *, query_rope=None, key_rope=None, atten_mask=None,
                 actual_seq_qlen=None, actual_seq_kvlen=None, block_table=None,
                 num_query_heads=1, num_key_value_heads=0, softmax_scale=1.0,
                 input_layout="BSH", sparse_mode=0, block_size=0, return_softmax_lse=False,
                 learnable_sink=None, pre_tokens=INT32_MAX, next_tokens=INT32_MAX):
    if return_softmax_lse:
        raise fia_v2_error(TILING_ERROR, "return_softmax_lse=True is not simulated")
    out = _fia_v2_run(query, key, value, query_rope, key_rope, atten_mask, actual_seq_qlen,
                      actual_seq_kvlen, block_table, num_query_heads, num_key_value_heads,
                      softmax_scale, input_layout, sparse_mode, block_size, None,
                      learnable_sink, pre_tokens, next_tokens)
    return out, torch.empty(0, dtype=torch.float32, device=query.device)


def _fia_v2_out_impl(query, key, value, *, query_rope=None, key_rope=None, atten_mask=None,
                     actual_seq_qlen=None, actual_seq_kvlen=None, block_table=None,
                     num_query_heads=1, num_key_value_heads=0, softmax_scale=1.0,
                     input_layout="BSH", sparse_mode=0, block_size=0, return_softmax_lse=False,
                     learnable_sink=None, pre_tokens=INT32_MAX, next_tokens=INT32_MAX,
                     workspace=None, attention_out, softmax_lse):
    if return_softmax_lse:
        raise fia_v2_error(TILING_ERROR, "return_softmax_lse=True is not simulated")
    need = fia_v2_workspace_elements(query, block_table, num_query_heads) \
        if block_table is not None else 0
    if workspace is None or workspace.dtype != query.dtype or workspace.numel() < need:
        got = "none" if workspace is None else f"{workspace.numel()} {workspace.dtype}"
        raise fia_v2_error(TILING_ERROR, "the .out call needs workspace= from "
                           "_npu_fused_infer_attention_score_v2_get_max_workspace "
                           f"({need} elements of {query.dtype}), got {got}")
    _fia_v2_run(query, key, value, query_rope, key_rope, atten_mask, actual_seq_qlen,
                actual_seq_kvlen, block_table, num_query_heads, num_key_value_heads,
                softmax_scale, input_layout, sparse_mode, block_size, attention_out,
                learnable_sink, pre_tokens, next_tokens)
    return attention_out, softmax_lse


_lib.impl("npu_fused_infer_attention_score_v2",
          kernel("npu_fused_infer_attention_score_v2", sampling(_fia_v2_impl)), "CPU")
_lib.impl("npu_fused_infer_attention_score_v2.out",
          kernel("npu_fused_infer_attention_score_v2.out", sampling(_fia_v2_out_impl)), "CPU")


# -- npu_attention_update -------------------------------------------------------------------------
# Merges partial attention results by their softmax LSE (aclnnAttentionUpdate; upstream's MLA
# prefill merges its context chunks with it). Contract: docs/torch_npu_calls.md.

_lib.define("npu_attention_update(Tensor[] lse, Tensor[] local_out, int update_type) -> "
            "(Tensor, Tensor)")
ATTENTION_UPDATE_MAX_SP = 16  # the doc's sp range [1, 16]


def _attention_update_impl(lse, local_out, update_type):
    err = _error("npu_attention_update", "aclnnAttentionUpdate")
    if update_type not in (0, 1):
        raise err(PARAM_INVALID, f"updateType must be 0 or 1, got {update_type}")
    if not 1 <= len(lse) <= ATTENTION_UPDATE_MAX_SP or len(lse) != len(local_out):
        raise err(PARAM_INVALID, f"lse and localOut must be lists of the same length sp in "
                  f"[1, {ATTENTION_UPDATE_MAX_SP}], got {len(lse)} and {len(local_out)}")
    rows, d = local_out[0].shape if local_out[0].dim() == 2 else (-1, -1)
    for i, (l, o) in enumerate(zip(lse, local_out)):
        require_contiguous(err, **{f"lse[{i}]": l, f"localOut[{i}]": o})
        if l.dtype != torch.float32 or l.dim() != 1 or l.shape[0] != rows:
            raise err(PARAM_INVALID, f"lse[{i}] must be float32 [batch * seqLen * headNum] = "
                      f"[{rows}], got {l.dtype} {list(l.shape)}")
        if o.dim() != 2 or list(o.shape) != [rows, d] or o.dtype != local_out[0].dtype or \
                o.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise err(PARAM_INVALID, f"localOut[{i}] must be [{rows}, {d}] of one dtype, "
                      f"float32, float16 or bfloat16, got {o.dtype} {list(o.shape)}")
    if not (8 <= d <= 512 and d % 8 == 0):
        raise err(PARAM_INVALID, f"headDim must be a multiple of 8 in [8, 512], got {d}")
    stacked = torch.stack([l.float() for l in lse])  # [sp, rows]
    lse_m = torch.logsumexp(stacked, 0)
    weights = torch.exp(stacked - lse_m)[..., None]  # exp(lse_i - lse_m)
    out = sum(w * o.float() for w, o in zip(weights, local_out))
    # update_type 0: the chip leaves lse_out undefined (None from torch_npu); here empty.
    lse_out = lse_m if update_type == 1 else lse_m.new_empty(0)
    return out.to(local_out[0].dtype), lse_out


_lib.impl("npu_attention_update",
          kernel("npu_attention_update", sampling(_attention_update_impl)), "CPU")
