"""The simulator's torch_npu operators: CPU kernels with the chip's contracts.

Each operator is a ``torch.library`` op in the ``ascend_sim`` namespace, so the graph recorder sees
one device kernel whose host arguments (FIA's ``actual_seq_lengths`` lists, for instance) are
recorded by value, as on the chip. The checks run inside the kernels: a replay whose host values
were changed by a task update is checked again. The Python wrappers at the bottom give each op
torch_npu's own name, keywords and ``.out`` overload.

Messages and codes follow the chip (../shared/TORCH_NPU_CONTRACTS.md, F1-F17 and section 10)
where they are known; where the chip's rule is not documented, the stricter reading is taken and
the comment says so.
"""

import functools
import threading

import torch
from torch.library import Library
from torch.utils._python_dispatch import _disable_current_modes

from vllm_ascend.device.sim import memory as _memory
from vllm_ascend.device.sim.matmul import rows_alike
from vllm_ascend.device.sim.trace import kernel

_lib = Library("ascend_sim", "DEF")

FIA_MAX_BATCH = 4096  # actual_seq_lengths(_kv) entries the chip accepts
ATTEN_MASK_SIZE = 2048  # sparse_mode 3/4 take the compressed 2048x2048 causal mask
INT32_MAX = 2147483647
TILING_ERROR = 561002  # ACLNN_ERR_INNER_TILING_ERROR: a host-side shape or value check
PARAM_INVALID = 161002  # ACLNN_ERR_PARAM_INVALID: dtype or format
FIA_DTYPES = (torch.float16, torch.bfloat16)
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)


class _Capturing(threading.local):
    active = False
    _garbage = torch.Generator().manual_seed(20261203)  # its own: the process's RNG is untouched

    def __init__(self):
        self._noise: dict[torch.dtype, torch.Tensor] = {}

    def unwritten(self, t: torch.Tensor) -> torch.Tensor:
        """What a captured task's output holds until a replay writes it: garbage (finite, so
        the ops after it in the capture still run their checks on sane values). Copied from a
        buffer of uniform(-1, 1) noise drawn once per dtype: drawing it anew for every output
        took a quarter of a capture's time."""
        n = t.numel()
        noise = self._noise.get(t.dtype)
        if noise is None or noise.numel() < n:
            noise = torch.empty(max(n, 1 << 20), dtype=t.dtype).uniform_(
                -1, 1, generator=self._garbage)
            self._noise[t.dtype] = noise
        return t.copy_(noise[:n].view(t.shape))


# Set by the graph recorder while it captures (graph.py): the attention kernels then run their
# host-side checks, as the chip's tiling does at capture, and leave garbage in the output, as a
# captured task runs at replay only. The capture of a FULL graph cost twice its attention before.
CAPTURING = _Capturing()


class AscendOpError(RuntimeError):
    """An operator check failed, worded as torch_npu reports it."""

    def __init__(self, op: str, aclnn: str, code: int, message: str):
        super().__init__(f"{op} call {aclnn} failed, error code is {code}\n"
                         f"[ERROR] EZ9999: Inner Error!\nEZ9999: {message}")
        self.code = code


def _sampling(impl):
    """The op, then, while a peak is measured, a look at the device's memory: its inputs and
    outputs live now (sim/memory.py)."""
    def op(*args, **kwargs):
        out = impl(*args, **kwargs)
        _memory.op_ran()
        return out

    return op


def _fia_error(code, message):
    return AscendOpError("npu_fused_infer_attention_score", "aclnnFusedInferAttentionScoreV3",
                         code, message)


def _require_contiguous(op_error, **tensors):
    # F14: the op-plugin does not call .contiguous(); non-contiguous inputs are not supported.
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise op_error(PARAM_INVALID, f"{name} must be contiguous (non-contiguous tensors "
                           f"are not supported), got shape {list(t.shape)} stride {t.stride()}")


# -- fused infer attention (FIA v1) -------------------------------------------------------------

_FIA_ARGS = (
    "Tensor query, Tensor key, Tensor value, *, Tensor? atten_mask=None, "
    "SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, "
    "Tensor? block_table=None, int num_heads=1, float scale=1.0, "
    "int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout=\"BSH\", "
    "int num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int block_size=0, "
    "bool softmax_lse_flag=False")
_lib.define(f"npu_fused_infer_attention_score({_FIA_ARGS}) -> (Tensor, Tensor)")
_lib.define(f"npu_fused_infer_attention_score.out({_FIA_ARGS}, Tensor? workspace=None, "
            "Tensor(a!) attention_out, Tensor(b!) softmax_lse) -> (Tensor(a!), Tensor(b!))")


def check_fia(query, key, value, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
              block_table, num_heads, num_key_value_heads, input_layout, sparse_mode,
              block_size, pre_tokens, next_tokens, err=_fia_error):
    """The host-side checks of FIA in the TND layout; returns (q_lens, kv_lens, head_dim).
    ``err`` words the errors (v1's by default; FIA v2's dense path makes the same checks)."""
    check_fia_tensors(query, key, value, atten_mask, block_table, num_heads, num_key_value_heads,
                      input_layout, sparse_mode, block_size, pre_tokens, next_tokens, err)
    return check_fia_lengths(query, key, value, actual_seq_lengths, actual_seq_lengths_kv,
                             block_table, block_size, sparse_mode, err)


def check_fia_tensors(query, key, value, atten_mask, block_table, num_heads,
                      num_key_value_heads, input_layout, sparse_mode, block_size, pre_tokens,
                      next_tokens, err=_fia_error):
    """check_fia's checks of the tensors and attributes: a captured task keeps them (a task
    update may change its host lists only, sim/graph.py), so a replay does not repeat these."""
    if input_layout != "TND":
        raise err(TILING_ERROR, f"input_layout {input_layout!r} is not simulated "
                  "(vllm-ascend uses TND)")
    if query.dim() != 3:  # F1
        raise RuntimeError("query's dim should be consistent with that of Layout")
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in FIA_DTYPES:  # F8
        raise err(PARAM_INVALID, "Input dtype of Q, K, and V must be consitent, and "
                  f"float16 or bfloat16 (got {query.dtype}, {key.dtype}, {value.dtype})")
    _require_contiguous(err, query=query, key=key, value=value, atten_mask=atten_mask,
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
        _check_causal_mask(atten_mask, sparse_mode)
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
                      block_table, block_size, sparse_mode, err=_fia_error):
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


def _check_causal_mask(mask: torch.Tensor, sparse_mode: int = 3) -> None:
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
        raise _fia_error(PARAM_INVALID, f"When sparseMode is {sparse_mode}, attnMask must be "
                         "the 2048x2048 causal mask: 1 (masked) above the diagonal, 0 on and "
                         "below it (torch.triu(torch.ones(2048, 2048), diagonal=1))")
    mask._ascend_sim_causal_at = version


def _gather_rows(flat: torch.Tensor, starts: list[int], lens: list[int], width: int):
    """[T, ...] -> [B, width, ...] by request (padded with row 0) and the validity mask."""
    dev = flat.device
    pos = torch.arange(width, device=dev)
    valid = pos[None, :] < torch.tensor(lens, device=dev)[:, None]
    idx = torch.where(valid, torch.tensor(starts, device=dev)[:, None] + pos, 0)
    return flat[idx], valid


def _one_block(key, block_table, max_kv, block_size) -> "int | None":
    """The block of a batch of one request whose first max_kv tokens fit in it, to be read where
    it lies (no gather); None otherwise, or when out of range (index_select refuses it). Its id
    is read from the table as the kernel reads it (the scatter's slots alike)."""
    if block_table.shape[0] != 1 or max_kv > block_size:
        return None
    block = torch._C.TensorBase.tolist(block_table[:, 0])[0]
    return block if 0 <= block < key.shape[0] else None


def _paged_kv(key, value, block_table, max_kv, block_size, nkv, d):
    """The first max_kv tokens of each row's blocks: [B, max_kv, nkv, d] keys and values."""
    batch = block_table.shape[0]
    nblk = max(1, -(-max_kv // block_size))
    block = _one_block(key, block_table, max_kv, block_size)
    if block is not None:
        return (x[block, :max_kv].view(1, max_kv, nkv, d) for x in (key, value))
    blocks = block_table[:, :nblk].reshape(-1)
    if nblk == 1:  # within one block: gather its first max_kv tokens only
        return (x[:, :max_kv].index_select(0, blocks).view(batch, max_kv, nkv, d)
                for x in (key, value))
    kp = key.index_select(0, blocks).view(batch, nblk * block_size, nkv, d)[:, :max_kv]
    vp = value.index_select(0, blocks).view(batch, nblk * block_size, nkv, d)[:, :max_kv]
    return kp, vp


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


def fia_kernel(query, key, value, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
               block_table, num_heads, scale, pre_tokens, next_tokens, input_layout,
               num_key_value_heads, sparse_mode, block_size, out, tensors_checked=False):
    """Attention of each request's query tokens over its KV (causal: query i sits at position
    kv_len - q_len + i), written into ``out`` [T, N, D]. ``tensors_checked``: a replay's call,
    whose tensors and attributes the capture checked (only its host lists are checked)."""
    if tensors_checked:
        q_lens, kv_lens, d = check_fia_lengths(query, key, value, actual_seq_lengths,
                                               actual_seq_lengths_kv, block_table, block_size,
                                               sparse_mode)
    else:
        q_lens, kv_lens, d = check_fia(
            query, key, value, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
            block_table, num_heads, num_key_value_heads, input_layout, sparse_mode, block_size,
            pre_tokens, next_tokens)
    if query.shape[0] == 0 or max(q_lens) == 0:
        return  # F17: nothing to attend for
    if CAPTURING.active:
        CAPTURING.unwritten(out)
        return
    fia_attend(query, key, value, block_table, actual_seq_lengths, actual_seq_lengths_kv,
               q_lens, kv_lens, num_heads, num_key_value_heads or num_heads, d, scale,
               sparse_mode, band_of(sparse_mode, pre_tokens, next_tokens), block_size, out)


def fia_attend(query, key, value, block_table, actual_seq_lengths, actual_seq_lengths_kv,
               q_lens, kv_lens, num_heads, nkv, d, scale, sparse_mode, band, block_size, out,
               sink=None):
    """The checked attention itself (FIA v1, and v2's dense path). ``sink``: FIA v2's
    learnable_sink, one logit per query head that joins each row's softmax with no value (the
    row's output scaled by sigmoid(lse - sink)), as GPT-OSS's attention sinks."""
    if block_table is not None and q_lens == [1] and band is None and sink is None:
        _attend_one_token(query, key, value, block_table, kv_lens[0], num_heads, nkv, d, scale,
                          block_size, out)
        return
    cu_q = list(actual_seq_lengths)
    q_starts = [c - q for c, q in zip(cu_q, q_lens)]
    single = [b for b, q in enumerate(q_lens) if q == 1]
    if block_table is not None and single:
        # Requests of one query token (decode, and a mixed FULL graph's padding requests) each
        # attend over their own KV, whatever else the batch holds (graph padding requests
        # without a query token are skipped).
        _attend_single_tokens(query, key, value, block_table, single,
                              [q_starts[b] for b in single], [kv_lens[b] for b in single],
                              num_heads, nkv, d, scale, block_size, band, out, sink)
    longer = [b for b, q in enumerate(q_lens) if q > 1 or (q == 1 and block_table is None)]
    if longer:
        _attend_padded(query, key, value, block_table, actual_seq_lengths_kv, longer, q_starts,
                       q_lens, kv_lens, num_heads, nkv, d, scale, sparse_mode, band, block_size,
                       out, sink)


def _attend_one_token(query, key, value, block_table, length, num_heads, nkv, d, scale,
                      block_size, out):
    """A batch of one request of one query token (a batch-1 decode): _attend_single_tokens'
    products, on views made directly (the same values in the same call shapes: the same bits,
    tests/ut/test_sim_fia.py), in half its Python."""
    block = _one_block(key, block_table, length, block_size)
    if block is not None:
        # Its first tokens where they lie, heads first (the caches are contiguous [blocks,
        # block_size, nkv * d]: check_fia_tensors, at capture for a replay).
        kv = (x.as_strided((nkv, length, d), (d, nkv * d, 1),
                           x.storage_offset() + block * x.stride(0)) for x in (key, value))
    else:
        kv = (x.view(length, nkv, d).permute(1, 0, 2)
              for x in _paged_kv(key, value, block_table, length, block_size, nkv, d))
    kf, vf = (x.to(torch.float32, memory_format=torch.contiguous_format) for x in kv)
    qf = query.view(nkv, num_heads // nkv, d).float()
    probs = torch.bmm(qf, kf.transpose(1, 2)).mul_(scale).softmax(-1)  # [nkv, g, L]
    out.copy_(torch.bmm(probs, vf).view(1, num_heads, d))


def _attend_single_tokens(query, key, value, block_table, batch_rows, token_rows, kv_lens,
                          num_heads, nkv, d, scale, block_size, band, out, sink=None):
    """One query token per request, the last of its KV: the KV lengths mask, and the band's
    start (its end is the query's own position)."""
    dev = query.device
    everything = len(token_rows) == query.shape[0] and token_rows == list(range(len(token_rows)))
    q = query if everything else query[torch.tensor(token_rows, device=dev)]
    table = block_table if len(batch_rows) == block_table.shape[0] else \
        block_table[torch.tensor(batch_rows, device=dev)]
    t, length = q.shape[0], max(kv_lens)
    nblk = max(1, -(-length // block_size))
    used = table[:, :nblk]
    same_blocks = rows_alike(used)
    if same_blocks and min(kv_lens) == length and rows_alike(q):
        # Every request the same query token over the same KV (vLLM's dummy batches): one
        # request's attention is each one's, bit for bit (a request attends alike alone or in
        # any batch: tests/ut/test_sim_fia.py).
        one = out.new_empty(1, *out.shape[1:])
        _attend_single_tokens(q[:1], key, value, table[:1], [0], [0], kv_lens[:1], num_heads,
                              nkv, d, scale, block_size, band, one, sink)
        if everything:
            out.copy_(one.expand_as(out))
        else:
            out[torch.tensor(token_rows, device=dev)] = one
        return
    if same_blocks:
        # Every request reads the same blocks (the dummy and padding requests of a capture, all
        # on the null block): gather them once; each request's products below read them through
        # a stride-0 batch, the same bits as a copy each (the mixed captures of vLLM's default
        # sizes read 256 requests x up to 512 positions).
        kp, vp = _paged_kv(key, value, used[:1], length, block_size, nkv, d)
    else:
        kp, vp = _paged_kv(key, value, used, length, block_size, nkv, d)
    # Grouped-query attention in fp32, every KV head at once: a batch of [g, D] x [D, L] products
    # (faster on a CPU than bf16 SDPA at decode shapes, and the same for a request whatever else
    # the batch holds; the chip's FIA also accumulates the softmax in fp32). K and V heads first:
    # [b, nkv, L, D], b = 1 when every request reads the same blocks.
    kf, vf = (x.permute(0, 2, 1, 3).to(torch.float32, memory_format=torch.contiguous_format)
              for x in (kp, vp))
    g = num_heads // nkv
    qf = q.view(t, nkv, g, d).float()
    masked = None
    short, banded = min(kv_lens) != length, band is not None and length - 1 - band[0] > 0
    if short or banded:  # (a decode batch of equal lengths and no band builds no mask)
        j = torch.arange(length, device=dev)
        kv_t = torch.tensor(kv_lens, device=dev)[:, None]
        masked = j >= kv_t if short else None
    if banded:
        before = j < kv_t - 1 - band[0]
        masked = before if masked is None else before | masked
        # Keys before the band are not read (the chip's tiling skips them; vLLM points the
        # blocks that hold only such keys at the null block, whose values may be anything).
        kf, vf = (torch.where(masked[:, None, :, None], 0.0, x) for x in (kf, vf))

    def products(a, b, transpose):  # per request and head: a[r, h] @ b[r or 0, h] (^T)
        if b.shape[0] == a.shape[0]:  # one bmm over (request, head): matmul's own kernel
            flat = b.view(-1, *b.shape[2:])
            out = torch.bmm(a.view(-1, *a.shape[2:]), flat.transpose(1, 2) if transpose else flat)
            return out.view(*a.shape[:3], out.shape[-1])
        rows = [b[0, h].t() if transpose else b[0, h] for h in range(nkv)]
        return torch.stack([torch.bmm(a[:, h], m.expand(a.shape[0], *m.shape))
                            for h, m in enumerate(rows)], 1)

    scores = products(qf, kf, True).mul_(scale)  # [T, nkv, g, L]
    if masked is not None:
        scores.masked_fill_(masked[:, None, None], float("-inf"))
    if sink is None:
        probs = scores.softmax(-1)
    else:  # the sink's logit joins the softmax, its column dropped after
        sinks = sink.float().view(1, nkv, g, 1).expand(t, nkv, g, 1)
        probs = torch.cat([scores, sinks], -1).softmax(-1)[..., :-1].contiguous()
    o = products(probs, vf, False)  # [T, nkv, g, D]
    if everything:
        out.copy_(o.view(t, num_heads, d))
    else:
        out[torch.tensor(token_rows, device=dev)] = o.view(t, num_heads, d).to(out.dtype)


def _attend_padded(query, key, value, block_table, actual_seq_lengths_kv, batch_rows, q_starts,
                   q_lens, kv_lens, num_heads, nkv, d, scale, sparse_mode, band, block_size,
                   out, sink=None):
    """Requests of several query tokens (causal: query i sits at position kv_len - q_len + i),
    padded to the longest; in mode 4, within the band around that position."""
    dev = query.device
    q_lens = [q_lens[b] for b in batch_rows]
    kv_all, kv_lens = kv_lens, [kv_lens[b] for b in batch_rows]
    q_starts = [q_starts[b] for b in batch_rows]
    max_q, max_kv = max(q_lens), max(kv_lens)
    qp, q_valid = _gather_rows(query, q_starts, q_lens, max_q)  # [B, Sq, N, D]
    rows = torch.tensor(q_starts, device=dev)[:, None] + torch.arange(max_q, device=dev)
    if block_table is not None:
        table = block_table if len(batch_rows) == block_table.shape[0] else \
            block_table[torch.tensor(batch_rows, device=dev)]
        if (len(set(q_lens)) == 1 and len(set(kv_lens)) == 1
                and rows_alike(table[:, :max(1, -(-max_kv // block_size))]) and rows_alike(qp)):
            # Every request the same queries over the same KV (vLLM's dummy batches): one
            # request's attention, written to each (alike alone or in any batch).
            _attend_padded(query, key, value, table[:1], None, [0], q_starts[:1], q_lens[:1],
                           kv_lens[:1], num_heads, nkv, d, scale, sparse_mode, band, block_size,
                           out, sink)
            out[rows[1:]] = out[rows[:1]]
            return
        kp, vp = _paged_kv(key, value, table, max_kv, block_size, nkv, d)
    else:
        kv_cu = list(actual_seq_lengths_kv)
        kv_starts = [kv_cu[b] - kv_all[b] for b in batch_rows]
        kp, _ = _gather_rows(key, kv_starts, kv_lens, max_kv)
        vp, _ = _gather_rows(value, kv_starts, kv_lens, max_kv)
    kv_len_t = torch.tensor(kv_lens, device=dev)[:, None, None]
    j = torch.arange(max_kv, device=dev)[None, None, :]
    qpos = (kv_len_t - torch.tensor(q_lens, device=dev)[:, None, None]
            + torch.arange(max_q, device=dev)[None, :, None])
    allowed = (j < kv_len_t).expand(-1, max_q, -1)  # mode 0: every key (no paging)
    if sparse_mode == 3:
        allowed = allowed & (j <= qpos)
    if band is not None:
        allowed = allowed & (j >= qpos - band[0]) & (j <= qpos + band[1])
        # Keys no query of the request keeps are not read (as in _attend_single_tokens).
        read = (allowed & q_valid[:, :, None]).any(1)[:, :, None, None]  # [B, Skv, 1, 1]
        kp, vp = (torch.where(read, x, torch.zeros((), dtype=x.dtype)) for x in (kp, vp))
    allowed = allowed | ~q_valid[:, :, None]  # padded query rows: any finite row, discarded
    mask = allowed[:, None]
    if sink is not None:
        # The sink as one more key: a zero key and value, its score the sink's logit (an
        # additive mask, in the query's dtype: the sink is bfloat16, exact in it).
        b, skv = kp.shape[0], kp.shape[1]
        zero = kp.new_zeros(b, 1, nkv, d)
        kp, vp = torch.cat([kp, zero], 1), torch.cat([vp, zero], 1)
        mask = torch.zeros(b, num_heads, max_q, skv + 1, dtype=qp.dtype, device=dev)
        mask[..., :skv].masked_fill_(~allowed[:, None], float("-inf"))
        mask[..., skv] = sink.to(qp.dtype).view(1, num_heads, 1)
    o = torch.nn.functional.scaled_dot_product_attention(
        qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), attn_mask=mask,
        scale=scale, enable_gqa=num_heads != nkv).transpose(1, 2)  # [B, Sq, N, D]
    out[rows[q_valid]] = o[q_valid].to(out.dtype)


def _fia_impl(query, key, value, *, atten_mask=None, actual_seq_lengths=None,
              actual_seq_lengths_kv=None, block_table=None, num_heads=1, scale=1.0,
              pre_tokens=INT32_MAX, next_tokens=INT32_MAX, input_layout="BSH",
              num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
              softmax_lse_flag=False):
    if softmax_lse_flag and (block_table is not None or sparse_mode not in (0, 3)):
        raise _fia_error(TILING_ERROR, "softmax_lse_flag=True is simulated without paging and "
                         "in sparse_mode 0 or 3 only (vllm-ascend asks for the LSE in MLA's "
                         "prefill only)")
    out = query.new_zeros(*query.shape[:-1], value.shape[-1] if block_table is None
                          else query.shape[-1])
    fia_kernel(query, key, value, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
               block_table, num_heads, scale, pre_tokens, next_tokens, input_layout,
               num_key_value_heads, sparse_mode, block_size, out)
    if softmax_lse_flag:
        return out, fia_lse(query, key, actual_seq_lengths, actual_seq_lengths_kv, num_heads,
                            num_key_value_heads or num_heads, scale, sparse_mode)
    # With the flag off the op returns an empty float32 lse (OpApi.cpp:356).
    return out, torch.empty(0, dtype=torch.float32, device=query.device)


def fia_lse(query, key, actual_seq_lengths, actual_seq_lengths_kv, num_heads, nkv, scale,
            sparse_mode):
    """The log-sum-exp of each query row's scaled scores over the keys it attends to, float32
    [T, N, 1] in TND (TORCH_NPU_CONTRACTS.md: softmax_lse's shape). The KV is TND (no paging),
    checked by fia_kernel before. A request without keys has no LSE the docs define (upstream
    never relies on one): refused, the stricter reading."""
    cu_q, cu_kv = list(actual_seq_lengths), list(actual_seq_lengths_kv)
    lse = torch.empty(query.shape[0], num_heads, 1, dtype=torch.float32, device=query.device)
    g = num_heads // nkv
    for b, (q1, k1) in enumerate(zip(cu_q, cu_kv)):
        q0, k0 = (cu_q[b - 1], cu_kv[b - 1]) if b else (0, 0)
        if q1 == q0:
            continue
        if k1 == k0:
            raise _fia_error(TILING_ERROR, f"softmax_lse_flag=True with request {b}'s "
                             "actualSeqLengthsKv 0: its LSE is not defined")
        q = query[q0:q1].float().transpose(0, 1)  # [N, q, D]
        k = key[k0:k1].float().repeat_interleave(g, 1).transpose(0, 1)  # [N, kv, D]
        scores = torch.bmm(q, k.transpose(1, 2)) * scale
        if sparse_mode == 3:  # bottom-right causal, as fia_attend
            ql, kl = q1 - q0, k1 - k0
            qpos = torch.arange(ql, device=q.device)[:, None] + (kl - ql)
            scores.masked_fill_(torch.arange(kl, device=q.device)[None, :] > qpos,
                                float("-inf"))
        lse[q0:q1, :, 0] = torch.logsumexp(scores, -1).transpose(0, 1)
    return lse


def _fia_out_impl(query, key, value, *, atten_mask=None, actual_seq_lengths=None,
                  actual_seq_lengths_kv=None, block_table=None, num_heads=1, scale=1.0,
                  pre_tokens=INT32_MAX, next_tokens=INT32_MAX, input_layout="BSH",
                  num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                  softmax_lse_flag=False, workspace=None, attention_out, softmax_lse,
                  _replay=False):
    if not _replay:  # (a replay's tensors and attributes are the ones checked at capture)
        if softmax_lse_flag:
            raise _fia_error(TILING_ERROR, "softmax_lse_flag=True is not simulated")
        need = fia_workspace_elements(query, block_table, num_heads)
        if workspace is None or workspace.dtype != query.dtype or workspace.numel() < need:
            got = "none" if workspace is None else f"{workspace.numel()} {workspace.dtype}"
            raise _fia_error(TILING_ERROR, f"the .out call needs workspace= from "
                             "_npu_fused_infer_attention_score_get_max_workspace "
                             f"({need} elements of {query.dtype}), got {got}")
        if attention_out.shape != query.shape or attention_out.dtype != query.dtype or \
                not attention_out.is_contiguous():
            raise _fia_error(TILING_ERROR, f"attention_out must be a contiguous "
                             f"{list(query.shape)} {query.dtype} tensor, got "
                             f"{list(attention_out.shape)} {attention_out.dtype}")
    fia_kernel(query, key, value, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
               block_table, num_heads, scale, pre_tokens, next_tokens, input_layout,
               num_key_value_heads, sparse_mode, block_size, attention_out,
               tensors_checked=_replay)
    return attention_out, softmax_lse


def fia_workspace_elements(query, block_table, num_heads) -> int:
    """The simulator's workspace size, in elements of the query's dtype. The chip's formula is
    not public; like it, this does not depend on the sequence lengths, only on the shapes, so
    one workspace per capture size serves every update."""
    batch = block_table.shape[0] if block_table is not None else 1
    return 4096 + 64 * num_heads * (query.shape[0] + batch)


_lib.impl("npu_fused_infer_attention_score",
          kernel("npu_fused_infer_attention_score", _sampling(_fia_impl)), "CPU")
_lib.impl("npu_fused_infer_attention_score.out",
          kernel("npu_fused_infer_attention_score.out", _sampling(_fia_out_impl)), "CPU")


# -- writing K/V into the paged caches -----------------------------------------------------------

_lib.define("npu_scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
            "Tensor(b!) value_cache, Tensor slot_mapping, *, str? cache_mode='PA_NZ') -> ()")


def _scatter_error(code, message):
    return AscendOpError("npu_scatter_pa_kv_cache", "aclnnScatterPaKvCache", code, message)


def _scatter_impl(key, value, key_cache, value_cache, slot_mapping, *, cache_mode="PA_NZ",
                  _replay=False):
    if not _replay:  # (a replay's tensors and attributes are the ones checked at capture)
        _check_scatter(key, value, key_cache, value_cache, slot_mapping, cache_mode)
    num_blocks, block_size = key_cache.shape[:2]
    # The checks on a host list (fewer ops than on the tensor): the kernel's own read, which a
    # capture's refusal of the product's .tolist() (sim/graph.py) does not apply to.
    values = torch._C.TensorBase.tolist(slot_mapping)
    if not values:
        return
    slots = slot_mapping.long()
    low, high = min(values), max(values)
    if low < 0:  # -1 marks a padded token: nothing is written for it
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
        values = [v for v in values if v >= 0]
    if high >= num_blocks * block_size:
        raise _scatter_error(TILING_ERROR, f"slot {high} is out of range "
                             f"[0, {num_blocks * block_size - 1}]")
    if len(set(values)) != len(values):
        raise _scatter_error(TILING_ERROR, "slot_mapping values must be unique")
    # Contiguous [blocks, block_size, heads, head_size] caches: a slot is a row of the flat view.
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, value)


def _check_scatter(key, value, key_cache, value_cache, slot_mapping, cache_mode):
    if cache_mode != "Norm":
        # 'PA_NZ' (the default) expects NZ-format caches; vLLM's caches are ND.
        raise _scatter_error(PARAM_INVALID, f"cache_mode {cache_mode!r} expects NZ caches, but "
                             "the caches are ND [num_blocks, block_size, heads, head_size]: pass "
                             "cache_mode='Norm'")
    _require_contiguous(_scatter_error, key=key, value=value, key_cache=key_cache,
                        value_cache=value_cache, slot_mapping=slot_mapping)
    if not (key.dtype == value.dtype == key_cache.dtype == value_cache.dtype):
        raise _scatter_error(PARAM_INVALID, "key, value and the caches must share one dtype, got "
                             f"{key.dtype}, {value.dtype}, {key_cache.dtype}, {value_cache.dtype}")
    # The doc allows int32 or int64 slots; upstream passes int32, and so must the product.
    if slot_mapping.dtype != torch.int32 or slot_mapping.dim() != 1:
        raise _scatter_error(PARAM_INVALID, f"slot_mapping must be a 1-D int32 tensor, got "
                             f"{slot_mapping.dim()}-D {slot_mapping.dtype}")
    if key.dim() != 3 or value.dim() != 3 or key_cache.dim() != 4 or value_cache.dim() != 4:
        raise _scatter_error(TILING_ERROR, "key/value must be [T, heads, head_size] and the "
                             "caches [num_blocks, block_size, heads, head_size]")
    if key.shape[1:] != key_cache.shape[2:] or value.shape[1:] != value_cache.shape[2:] or \
            key.shape[0] != value.shape[0] or key_cache.shape[:2] != value_cache.shape[:2]:
        raise _scatter_error(TILING_ERROR, f"shapes do not match: key {list(key.shape)}, value "
                             f"{list(value.shape)}, caches {list(key_cache.shape)} and "
                             f"{list(value_cache.shape)}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise _scatter_error(TILING_ERROR, f"slot_mapping has {slot_mapping.shape[0]} slots for "
                             f"{key.shape[0]} tokens")


_lib.impl("npu_scatter_pa_kv_cache", kernel("npu_scatter_pa_kv_cache", _scatter_impl), "CPU")

# What a graph replay calls for these in-place ops (sim/graph.py): the kernel without the checks
# of its tensors and attributes, which the capture made as the chip's tiling does (a task update
# may change host lists only); the checks of what changes between replays (FIA's host lists, the
# slots' values the scatter reads) stay.
REPLAY = {"npu_fused_infer_attention_score.out": _sampling(functools.partial(_fia_out_impl,
                                                                             _replay=True)),
          "npu_scatter_pa_kv_cache": functools.partial(_scatter_impl, _replay=True)}


# -- norms, activation, rotary embedding ---------------------------------------------------------

_lib.define("npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)")
_lib.define("npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) "
            "-> (Tensor, Tensor, Tensor)")
_lib.define("npu_swiglu(Tensor self, int dim=-1) -> Tensor")
_lib.define("npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') "
            "-> Tensor")
_lib.define("npu_mrope(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, "
            "int head_size, *, int[]? mrope_section=None, str? rotary_mode='half', "
            "str? cache_mode='default') -> (Tensor, Tensor)")
ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _op_error(op):
    return lambda code, message: AscendOpError(op, f"aclnn op of {op}", code, message)


def rms_float(x, gamma, eps):
    """(y, rstd) in float32: the norm before any rounding to x's dtype. (xf * xf is pow(xf, 2)'s
    arithmetic; a 16-bit gamma times a float32 tensor is its exact widening's product.)"""
    xf = x.float()
    rstd = torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps)
    return xf * rstd * gamma, rstd


def _rms(x, gamma, eps):
    """(y, rstd): rstd is float32 [..., 1], as torch_npu returns it."""
    y, rstd = rms_float(x, gamma, eps)
    return y.to(x.dtype), rstd


def _check_norm(op, x, gamma):
    error = _op_error(op)
    if not 2 <= x.dim() <= 8:
        raise error(PARAM_INVALID, f"input must be 2-8-D, got {x.dim()}-D")
    if x.dtype not in ACT_DTYPES or gamma.dtype not in (x.dtype, torch.float32):
        raise error(PARAM_INVALID, f"input dtype {x.dtype} with gamma {gamma.dtype} is not "
                    "supported")
    if tuple(gamma.shape) != tuple(x.shape[x.dim() - gamma.dim():]):
        raise error(TILING_ERROR, f"gamma {list(gamma.shape)} must equal the trailing dims of "
                    f"the input {list(x.shape)}")
    # Upstream passes strided q/k head views (Qwen3's q_norm): no contiguity rule here.


def _rms_into(x, gamma, eps, y, rstd):
    """_rms written into y and rstd: the same arithmetic in the same order, in place."""
    xf = x.to(torch.float32, copy=True)
    torch.rsqrt((xf * xf).mean(-1, keepdim=True).add_(eps), out=rstd)
    torch.mul(xf.mul_(rstd), gamma, out=y)  # in float32, rounded once into y


def _rms_norm_impl(x, gamma, epsilon=1e-6):
    _check_norm("npu_rms_norm", x, gamma)
    return _rms(x, gamma, epsilon)


def _rms_norm_into(outs, x, gamma, epsilon=1e-6):
    _rms_into(x, gamma, epsilon, *outs)


def _check_add_rms_norm(x1, x2, gamma):
    _check_norm("npu_add_rms_norm", x1, gamma)
    if x2.shape != x1.shape or x2.dtype != x1.dtype or gamma.dtype != x1.dtype:
        raise _op_error("npu_add_rms_norm")(PARAM_INVALID, "x1, x2 and gamma must share the "
                                             "dtype, and x1 and x2 the shape")
    if x1.numel() == 0:
        raise _op_error("npu_add_rms_norm")(PARAM_INVALID, "empty tensors are not supported")


def _add_rms_norm_impl(x1, x2, gamma, epsilon=1e-6):
    _check_add_rms_norm(x1, x2, gamma)
    summed = x1 + x2
    y, rstd = _rms(summed, gamma, epsilon)
    return y, rstd, summed


def _add_rms_norm_into(outs, x1, x2, gamma, epsilon=1e-6):
    y, rstd, summed = outs
    torch.add(x1, x2, out=summed)
    _rms_into(summed, gamma, epsilon, y, rstd)


def _check_swiglu(x, dim):
    error = _op_error("npu_swiglu")
    _require_contiguous(error, input=x)
    if x.shape[dim] % 2 or x.dtype not in ACT_DTYPES:
        raise error(TILING_ERROR, f"dim {dim} of {list(x.shape)} must be even and the dtype "
                    f"fp32/fp16/bf16, got {x.dtype}")


def _swiglu_impl(x, dim=-1):
    _check_swiglu(x, dim)
    a, b = x.chunk(2, dim=dim)
    return torch.nn.functional.silu(a) * b


def _swiglu_into(outs, x, dim=-1):
    a, b = x.chunk(2, dim=dim)
    torch.mul(torch.nn.functional.silu(a), b, out=outs[0])


def rotate(x, cos, sin, interleaved):
    """x*cos + rot(x)*sin with full-width cos/sin in the same layout as x."""
    if interleaved:
        turned = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        turned = torch.cat((-x2, x1), dim=-1)
    return x * cos + turned * sin


def _rotary_mul_impl(x, r1, r2, rotary_mode="half"):
    _check_rotary_mul(x, r1, r2, rotary_mode)
    return rotate(x, r1, r2, rotary_mode == "interleave")


def _rotary_mul_into(outs, x, r1, r2, rotary_mode="half"):
    if rotary_mode == "interleave":
        outs[0].copy_(rotate(x, r1, r2, True))
        return
    # rotate(): x*cos + cat(-x2, x1)*sin; the sign after the product, which is symmetric
    half = x.shape[-1] // 2
    turned = x.roll(half, -1).mul_(r2)
    turned[..., :half].neg_()
    torch.add(x * r1, turned, out=outs[0])


def _check_rotary_mul(x, r1, r2, rotary_mode):
    error = _op_error("npu_rotary_mul")
    if x.dim() not in (3, 4) or x.shape[-1] % 2 or x.shape[-1] >= 896:
        raise error(TILING_ERROR, f"input must be 3/4-D with an even last dim below 896, got "
                    f"{list(x.shape)}")
    if rotary_mode not in ("half", "interleave"):
        raise error(PARAM_INVALID, f"rotary_mode {rotary_mode!r} must be 'half' or 'interleave'")
    if r1.shape != r2.shape or r1.shape[-1] != x.shape[-1] or r1.dim() != x.dim() or any(
            r not in (1, s) for r, s in zip(r1.shape, x.shape)):
        raise error(TILING_ERROR, f"cos/sin {list(r1.shape)} must broadcast to the input "
                    f"{list(x.shape)} (e.g. 1S1D, 11SD) with the same last dim")
    if not (x.dtype == r1.dtype == r2.dtype):
        raise error(PARAM_INVALID, f"input, r1 and r2 must share the dtype, got {x.dtype}, "
                    f"{r1.dtype}, {r2.dtype}")
    _require_contiguous(error, input=x, r1=r1, r2=r2)


def _mrope_impl(positions, query, key, cos_sin_cache, head_size, *, mrope_section=None,
                rotary_mode="half", cache_mode="default"):
    error = _op_error("npu_mrope")
    rot = cos_sin_cache.shape[-1]
    if list(mrope_section or [0, 0, 0]) != [0, 0, 0]:
        raise error(TILING_ERROR, "multimodal mrope_section is not simulated")
    if rotary_mode not in ("half", "interleaved") or cache_mode != "default":
        raise error(PARAM_INVALID, f"rotary_mode {rotary_mode!r} / cache_mode {cache_mode!r} "
                    "are not supported")
    if query.dim() != 2 or key.dim() != 2 or positions.dim() != 1 or \
            positions.shape[0] != query.shape[0] or query.shape[1] % head_size or \
            key.shape[1] % head_size:
        raise error(TILING_ERROR, "query/key must be [T, heads*head_size] and positions [T]")
    if cos_sin_cache.dtype != query.dtype or query.dtype != key.dtype:
        raise error(PARAM_INVALID, "cos_sin_cache, query and key must share the dtype")
    if query.dtype != torch.float32 and (head_size % 32 or rot % 32) or rot > head_size:
        raise error(TILING_ERROR, f"head_size({head_size}) and rotary_dim({rot}) must be "
                    "multiples of 32 for fp16/bf16, rotary_dim at most head_size")
    _require_contiguous(error, positions=positions, query=query, key=key,
                        cos_sin_cache=cos_sin_cache)
    cos, sin = cos_sin_cache.index_select(0, positions.long()).chunk(2, dim=-1)
    interleaved = rotary_mode == "interleaved"
    if interleaved:
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    else:
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def apply(x):
        x = x.unflatten(-1, (-1, head_size))
        turned = rotate(x[..., :rot], cos, sin, interleaved)
        return torch.cat((turned, x[..., rot:]), -1).flatten(-2) if rot < head_size else \
            turned.flatten(-2)

    return apply(query), apply(key)


_lib.impl("npu_rms_norm", kernel("npu_rms_norm", _rms_norm_impl), "CPU")
_lib.impl("npu_add_rms_norm", kernel("npu_add_rms_norm", _add_rms_norm_impl), "CPU")
_lib.impl("npu_swiglu", kernel("npu_swiglu", _sampling(_swiglu_impl)), "CPU")
_lib.impl("npu_rotary_mul", kernel("npu_rotary_mul", _rotary_mul_impl), "CPU")
_lib.impl("npu_mrope", kernel("npu_mrope", _mrope_impl), "CPU")
# The same kernels writing into a replay's outputs, ``into(outs, *args, **kwargs)``: a captured
# task writes its output buffers; a replay of the functional kernel copied each result there.
# They check nothing: the functional kernel checked the same tensors at capture, as the chip's
# tiling does, and a replay reads those tensors again (their shapes, dtypes and layouts).
REPLAY_INTO = {"npu_rms_norm": _rms_norm_into, "npu_add_rms_norm": _add_rms_norm_into,
               "npu_swiglu": _sampling(_swiglu_into), "npu_rotary_mul": _rotary_mul_into}


# Shapes only, for torch.compile's tracing (torch_npu registers Meta kernels for its ops too).
@torch.library.register_fake("ascend_sim::npu_rms_norm")
def _rms_norm_fake(x, gamma, epsilon=1e-6):
    return torch.empty_like(x), x.new_empty(x.shape[:-1] + (1,), dtype=torch.float32)


@torch.library.register_fake("ascend_sim::npu_add_rms_norm")
def _add_rms_norm_fake(x1, x2, gamma, epsilon=1e-6):
    rstd = x1.new_empty(x1.shape[:-1] + (1,), dtype=torch.float32)
    return torch.empty_like(x1), rstd, torch.empty_like(x1)


@torch.library.register_fake("ascend_sim::npu_swiglu")
def _swiglu_fake(x, dim=-1):
    shape = list(x.shape)
    shape[dim] //= 2
    return x.new_empty(shape)


@torch.library.register_fake("ascend_sim::npu_rotary_mul")
def _rotary_mul_fake(x, r1, r2, rotary_mode="half"):
    return torch.empty_like(x)


@torch.library.register_fake("ascend_sim::npu_mrope")
def _mrope_fake(positions, query, key, cos_sin_cache, head_size, *, mrope_section=None,
                rotary_mode="half", cache_mode="default"):
    return torch.empty_like(query), torch.empty_like(key)
