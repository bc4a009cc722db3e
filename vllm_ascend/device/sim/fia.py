"""torch_npu's fused infer attention, FIA v1 (``npu_fused_infer_attention_score`` and its
``.out`` overload, the graph path), on the CPU: attention of each request's query tokens over
its paged (or TND) KV, causal from the bottom-right corner, in a band for sparse_mode 4. The
host-side checks it makes first are in sim/fia_checks.py; the Python wrapper that gives the op
torch_npu's keywords is in sim/__init__.py. The contract: ../shared/TORCH_NPU_CONTRACTS.md
section 1; the call sites: docs/torch_npu_calls.md, "Attention".
"""

import functools

import torch

from vllm_ascend.device.sim import aclnn
from vllm_ascend.device.sim.aclnn import CAPTURING, INT32_MAX, sampling
from vllm_ascend.device.sim.errors import TILING_ERROR
from vllm_ascend.device.sim.fia_checks import (band_of, check_fia, check_fia_lengths, fia_error,
                                               fia_workspace_elements)
from vllm_ascend.device.sim.library_caches import first_calls_measured
from vllm_ascend.device.sim.matmul import rows_alike
from vllm_ascend.device.sim.trace import kernel

_lib = torch.library.Library("ascend_sim", "FRAGMENT")

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


@first_calls_measured(lambda query, key, value, block_table, seq, seq_kv, q_lens, *rest,
                      **kw: (query.shape[1:], key.shape[1:], len(q_lens), max(q_lens) > 1))
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
        raise fia_error(TILING_ERROR, "softmax_lse_flag=True is simulated without paging and "
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


@first_calls_measured(lambda query, key, seq, *rest: (query.shape[1:], key.shape[1:], len(seq)))
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
            raise fia_error(TILING_ERROR, f"softmax_lse_flag=True with request {b}'s "
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
            raise fia_error(TILING_ERROR, "softmax_lse_flag=True is not simulated")
        need = fia_workspace_elements(query, block_table, num_heads)
        if workspace is None or workspace.dtype != query.dtype or workspace.numel() < need:
            got = "none" if workspace is None else f"{workspace.numel()} {workspace.dtype}"
            raise fia_error(TILING_ERROR, f"the .out call needs workspace= from "
                             "_npu_fused_infer_attention_score_get_max_workspace "
                             f"({need} elements of {query.dtype}), got {got}")
        if attention_out.shape != query.shape or attention_out.dtype != query.dtype or \
                not attention_out.is_contiguous():
            raise fia_error(TILING_ERROR, f"attention_out must be a contiguous "
                             f"{list(query.shape)} {query.dtype} tensor, got "
                             f"{list(attention_out.shape)} {attention_out.dtype}")
    fia_kernel(query, key, value, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
               block_table, num_heads, scale, pre_tokens, next_tokens, input_layout,
               num_key_value_heads, sparse_mode, block_size, attention_out,
               tensors_checked=_replay)
    return attention_out, softmax_lse


_lib.impl("npu_fused_infer_attention_score",
          kernel("npu_fused_infer_attention_score", sampling(_fia_impl)), "CPU")
_lib.impl("npu_fused_infer_attention_score.out",
          kernel("npu_fused_infer_attention_score.out", sampling(_fia_out_impl)), "CPU")
# A replay's .out call: its tensors and attributes are those the capture checked (sim/aclnn.py).
aclnn.REPLAY["npu_fused_infer_attention_score.out"] = sampling(
    functools.partial(_fia_out_impl, _replay=True))
