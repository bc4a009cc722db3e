"""The host-side checks of torch_npu's fused infer attention (FIA v1,
``npu_fused_infer_attention_score``) in the TND layout, as the chip's tiling makes them: what
the simulator enforces, with the chip's messages and aclnn's codes
(../shared/TORCH_NPU_CONTRACTS.md, F1-F17 and section 10; docs/torch_npu_calls.md). FIA v2's
dense path (sim/mla.py) makes the same checks. The kernels are in sim/fia.py.

The checks split as a captured task splits them: ``check_fia_tensors`` (the tensors and
attributes, checked once at capture: a task update may change the host lists only) and
``check_fia_lengths`` (the host lists against the tensors, checked at every call and replay).
"""

import torch
from torch.utils._python_dispatch import _disable_current_modes

from vllm_ascend.device.sim.aclnn import INT32_MAX, require_contiguous
from vllm_ascend.device.sim.errors import PARAM_INVALID, TILING_ERROR, AscendOpError

FIA_MAX_BATCH = 4096  # actual_seq_lengths(_kv) entries the chip accepts
ATTEN_MASK_SIZE = 2048  # sparse_mode 3/4 take the compressed 2048x2048 causal mask
FIA_DTYPES = (torch.float16, torch.bfloat16)
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)


def fia_error(code, message):
    return AscendOpError("npu_fused_infer_attention_score", "aclnnFusedInferAttentionScoreV3",
                         code, message)


def check_fia(query, key, value, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
              block_table, num_heads, num_key_value_heads, input_layout, sparse_mode,
              block_size, pre_tokens, next_tokens, err=fia_error):
    """The host-side checks of FIA in the TND layout; returns (q_lens, kv_lens, head_dim).
    ``err`` words the errors (v1's by default; FIA v2's dense path makes the same checks)."""
    check_fia_tensors(query, key, value, atten_mask, block_table, num_heads, num_key_value_heads,
                      input_layout, sparse_mode, block_size, pre_tokens, next_tokens, err)
    return check_fia_lengths(query, key, value, actual_seq_lengths, actual_seq_lengths_kv,
                             block_table, block_size, sparse_mode, err)


def check_fia_tensors(query, key, value, atten_mask, block_table, num_heads,
                      num_key_value_heads, input_layout, sparse_mode, block_size, pre_tokens,
                      next_tokens, err=fia_error):
    """check_fia's checks of the tensors and attributes: a captured task keeps them (a task
    update may change its host lists only: sim/graph.py), so a replay does not repeat these."""
    if input_layout != "TND":
        raise err(TILING_ERROR, f"input_layout {input_layout!r} is not simulated "
                  "(vllm-ascend uses TND)")
    if query.dim() != 3:  # F1
        raise RuntimeError("query's dim should be consistent with that of Layout")
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in FIA_DTYPES:  # F8
        raise err(PARAM_INVALID, "Input dtype of Q, K, and V must be consitent, and "
                  f"float16 or bfloat16 (got {query.dtype}, {key.dtype}, {value.dtype})")
    require_contiguous(err, query=query, key=key, value=value, atten_mask=atten_mask,
                        block_table=block_table)
    n, d = query.shape[1:]
    nkv = num_key_value_heads or num_heads
    if n != num_heads:
        raise err(TILING_ERROR, f"query's head number({n}) must be equal to "
                  f"numHeads({num_heads})")
    # F10
    if num_heads > 256 or nkv > 256 or num_heads % nkv != 0 or num_heads // nkv > 64:
        raise err(TILING_ERROR, f"numHeads({num_heads}) and numKeyValueHeads({nkv}) are "
                  "invalid: each at most 256, numHeads a multiple of numKeyValueHeads, "
                  "ratio at most 64")
    # F8, F9: TND head dim at most 256 and 16-element aligned for fp16/bf16.
    if d > 256:
        raise err(TILING_ERROR, "When input layout is TND, headDim shall not exceed 256")
    if d % 16 != 0:
        raise err(TILING_ERROR, f"D should be 16 elements aligned, but got D={d}")
    # F11-F13
    if sparse_mode in (5, 6, 7, 8) or sparse_mode not in (0, 1, 2, 3, 4):
        raise err(TILING_ERROR, f"sparse_mode {sparse_mode} is not supported")
    if sparse_mode not in (0, 3, 4):
        # Modes 1 and 2 exist on the chip; vllm-ascend's decoder path uses 3 (causal) and 4
        # (a sliding window).
        raise err(TILING_ERROR, f"sparse_mode {sparse_mode} is not simulated (use 3 "
                  "with the causal mask, 4 for a band, or 0 without a mask)")
    if atten_mask is not None and sparse_mode not in (3, 4):
        raise err(TILING_ERROR, "When attnMask is provided, sparseMode must be 3 or 4")
    if sparse_mode in (3, 4):
        # Mode 4 takes the same compressed mask as 3 (the CANN FIA doc: "band" mode, the
        # optimised 2048x2048 lower-triangular mask; upstream passes its causal mask to both).
        if atten_mask is None:
            raise err(TILING_ERROR, f"sparseMode {sparse_mode} needs the 2048x2048 "
                      "attnMask")
        if atten_mask.dtype not in MASK_DTYPES:
            raise err(PARAM_INVALID, f"attnMask dtype must be bool, int8 or uint8, got "
                      f"{atten_mask.dtype}")
        if atten_mask.dim() not in (2, 3, 4) or any(s != 1 for s in atten_mask.shape[:-2]):
            raise err(TILING_ERROR, "attnMask must be 2/3/4-D with leading dims of 1")
        for dim in atten_mask.shape[-2:]:
            if dim != ATTEN_MASK_SIZE:
                raise err(TILING_ERROR, f"When sparseMode is {sparse_mode}, maskDim "
                          f"{dim} shall be {ATTEN_MASK_SIZE}")
        check_causal_mask(atten_mask, sparse_mode)
    if sparse_mode == 4:
        # The band: preTokens + nextTokens >= 0 (CANN FIA doc, sparse_mode 4), so that every
        # query row keeps at least the key on its diagonal (see band_of).
        if pre_tokens + next_tokens < 0:
            raise err(TILING_ERROR, f"When sparseMode is 4, preTokens({pre_tokens}) + "
                      f"nextTokens({next_tokens}) must be >= 0")
    elif pre_tokens != INT32_MAX or next_tokens != INT32_MAX:
        # The chip ignores them outside mode 4 (the CANN doc: "该场景下忽略pre_tockens、
        # next_tockens取值"), so a band asked for there is silently not applied: refused here.
        raise err(TILING_ERROR, f"pre_tokens/next_tokens ({pre_tokens}, {next_tokens}) "
                  f"are ignored in sparse_mode {sparse_mode}: a band takes sparse_mode 4")
    if block_table is None:
        # F4: without paged attention KV is TND like the query, lengths cumulative.
        if key.dim() != 3 or value.dim() != 3 or key.shape[1:] != (nkv, d) or \
                value.shape[1] != nkv:
            raise err(TILING_ERROR, f"When layout is TND, key/value must be [T, "
                      f"{nkv}, {d}], got {list(key.shape)} and {list(value.shape)}")
        dv = value.shape[2]
        if dv != d and not (d == 192 and dv == 128):  # F15: MLA's prefill, 192/128 only
            raise err(TILING_ERROR, f"When layout is TND, queryD({d}) or keyD({d}) must "
                      f"be 192, valueD({dv}) must be 192/128!")
        if dv != d and query.dtype != torch.bfloat16:
            # Upstream casts MLA's prefill to bfloat16: "FIA with TND layout only supports
            # bfloat16" (mla_v1.py _forward_prefill); the stricter reading.
            raise err(PARAM_INVALID, f"TND with queryD {d} and valueD {dv} takes "
                      f"bfloat16 only, got {query.dtype}")
        return
    # Paged attention (F5, F6).
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise err(PARAM_INVALID, f"block_table must be a 2-D int32 tensor, got "
                  f"{block_table.dim()}-D {block_table.dtype}")
    if key.dim() != 3 or value.dim() != 3:
        raise err(TILING_ERROR, "When layout is TND and page attention is enabled, the "
                  "cache shape must be BnBsH (3-D [num_blocks, block_size, H]), got "
                  f"{key.dim()}-D key and {value.dim()}-D value")
    # The tiling's message says "less than 512" and the doc says up to 1024: stricter reading.
    if block_size % 16 != 0 or not 0 < block_size < 512:
        raise err(TILING_ERROR, f"blockSize({block_size}) must be a multiple of 16 and "
                  "less than 512 (vllm-ascend uses 128)")
    if key.shape[1] != block_size or value.shape[1] != block_size:
        raise err(TILING_ERROR, "the first dim of K and V must be consistent with input "
                  f"blockSize attr: cache block size {key.shape[1]} vs blockSize "
                  f"{block_size}")
    if key.shape[2] != nkv * d or value.shape[2] != nkv * d or key.shape[0] != value.shape[0]:
        raise err(TILING_ERROR, f"key/value cache H must be numKeyValueHeads({nkv}) x "
                  f"D({d}) = {nkv * d}, got {key.shape[2]} and {value.shape[2]}")


def check_fia_lengths(query, key, value, actual_seq_lengths, actual_seq_lengths_kv,
                      block_table, block_size, sparse_mode, err=fia_error):
    """check_fia's checks of the host lists against the (checked) tensors, which a task update
    re-issues: each replay makes them. Returns (q_lens, kv_lens, head_dim)."""
    t, d = query.shape[0], query.shape[2]
    # F2
    for name, lst in (("actualSequenceLengthQ", actual_seq_lengths),
                      ("actualSequenceLengthKV", actual_seq_lengths_kv)):
        if not lst:
            raise err(TILING_ERROR, f"When layout is TND, {name} is required and must "
                      "not be empty")
        if len(lst) > FIA_MAX_BATCH:
            raise err(TILING_ERROR, f"{name} has {len(lst)} elements, at most "
                      f"{FIA_MAX_BATCH} are supported")
    cu_q = list(actual_seq_lengths)
    prev = 0
    for i, v in enumerate(cu_q):
        if v < prev:
            raise err(TILING_ERROR, "When layout is TND, actualSequenceLengthQ must be "
                      f"non-decreasing and non-negative, but element {i} is {v} after {prev}")
        prev = v
    if t != cu_q[-1]:  # F3
        raise err(TILING_ERROR, f"When layout is TND, queryT({t}) must be equal to the "
                  f"last element of actualSequenceLengthQ({cu_q[-1]})")
    batch = len(cu_q)
    q_lens = [b - a for a, b in zip([0] + cu_q[:-1], cu_q)]
    if sparse_mode == 0 and block_table is not None and any(q > 1 for q in q_lens):
        # Without a mask every query token sees every key. Upstream uses that without paging
        # only (a non-causal model's prefill, MLA's context chunks, which lie before every
        # query); on the paged cache a request's KV holds its own query tokens: not causal.
        raise err(TILING_ERROR, "sparse_mode 0 (no mask) with a query length > 1 over the "
                  "paged cache is not causal; use sparse_mode 3 with the causal mask")
    kv = list(actual_seq_lengths_kv)
    if block_table is None:
        if not (key.shape[0] == value.shape[0] == kv[-1]):
            raise err(TILING_ERROR, "When layout is TND and PA not enabled, "
                      f"keyT({key.shape[0]}) and valueT({value.shape[0]}) must be equal "
                      f"to the last element of actualSeqenceLengthKV({kv[-1]})")
        if len(kv) != batch:
            raise err(TILING_ERROR, f"The size({len(kv)}) of actualSeqLengthsKv is not "
                      f"equal to the batchSize({batch})")
        kv_lens = [b - a for a, b in zip([0] + kv[:-1], kv)]
        return q_lens, kv_lens, d
    if len(kv) != batch:
        raise err(TILING_ERROR, f"The size({len(kv)}) of actualSeqLengthsKv is not equal "
                  f"to the batchSize({batch})")
    need = max(-(-max(kv) // block_size), 1)
    if block_table.shape[0] != batch or block_table.shape[1] < need:
        raise err(TILING_ERROR, "When page attention enable, block table shape should be "
                  f"[{batch}, >={need}], now is [{block_table.shape[0]}, "
                  f"{block_table.shape[1]}]")
    for b, (q, k) in enumerate(zip(q_lens, kv)):
        if k < q or k < 0:
            raise err(TILING_ERROR, f"actualSeqLengthsKv[{b}]({k}) is less than the "
                      f"query length({q}): the query's tokens are the last of the "
                      "request's KV")
    return q_lens, kv, d


_UNCHECKED = object()


def check_causal_mask(mask: torch.Tensor, sparse_mode: int = 3) -> None:
    """sparse_mode 3 (and 4) reads the mask as the compressed causal pattern: the chip does not
    look at every value but builds the causal band from it, so any other mask is silently wrong.
    The simulator checks the values once per mask contents: upper triangle 1 (masked), the rest
    0 (TORCH_NPU_CONTRACTS.md section 7: upstream passes triu(ones(2048, 2048), diagonal=1))."""
    # Checked once per tensor and contents (the attention builder passes one mask throughout),
    # remembered on the tensor itself: an address or an id may be reused by another mask.
    version = None if mask.is_inference() else mask._version
    if getattr(mask, "_ascend_sim_causal_at", _UNCHECKED) == version:
        return
    with _disable_current_modes():  # the simulator's own look, not a device op of a capture
        square = mask.reshape(ATTEN_MASK_SIZE, ATTEN_MASK_SIZE).to(torch.bool)
        causal = torch.ones(ATTEN_MASK_SIZE, ATTEN_MASK_SIZE, dtype=torch.bool).triu_(1)
        same = torch.equal(square, causal)
    if not same:
        raise fia_error(PARAM_INVALID, f"When sparseMode is {sparse_mode}, attnMask must be "
                         "the 2048x2048 causal mask: 1 (masked) above the diagonal, 0 on and "
                         "below it (torch.triu(torch.ones(2048, 2048), diagonal=1))")
    mask._ascend_sim_causal_at = version


def band_of(sparse_mode: int, pre_tokens: int, next_tokens: int) -> "tuple[int, int] | None":
    """The keys mode 4 keeps, as (before, after) the query's own position, or None for no band.

    Mode 4 ("band") counts from the bottom-right corner, as mode 3 does: the query token i of a
    request with q_len queries and kv_len keys sits at position p = kv_len - q_len + i, and key
    j is kept when p - pre_tokens <= j <= p + next_tokens. Edges inclusive, the reading the CANN
    docs' rules imply: FIA's mode 4 needs preTokens + nextTokens >= 0, and
    npu_fusion_attention's band needs preTokens >= |nextTokens| when nextTokens is negative; at
    those bounds only the inclusive reading leaves a row a key (the one on its diagonal, or
    |nextTokens| before it). So a sliding window of W keys, the query's own included (vLLM's
    and HF's), is pre_tokens = W - 1, next_tokens = 0. Upstream passes W: one key more under
    this reading (the review of vllm-ascend#8210 proposed W - 1)."""
    return (pre_tokens, next_tokens) if sparse_mode == 4 else None


def fia_workspace_elements(query, block_table, num_heads) -> int:
    """The simulator's workspace size, in elements of the query's dtype. The chip's formula is
    not public; like it, this does not depend on the sequence lengths, only on the shapes, so
    one workspace per capture size serves every update."""
    batch = block_table.shape[0] if block_table is not None else 1
    return 4096 + 64 * num_heads * (query.shape[0] + batch)
