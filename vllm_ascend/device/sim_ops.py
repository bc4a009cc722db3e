"""The simulator's device operators: CPU kernels with the Ascend chip's contracts.

Each operator is a ``torch.library`` op, so a graph recorder sees it as one device kernel whose
non-tensor arguments (e.g. FIA's host lists) are recorded by value, exactly as on the chip. The
checks run inside the kernels, so they also guard replays whose host values were updated.
Messages follow the chip's wording where it is known; where the chip's rule is not documented the
stricter reading is taken and the comment says so.
"""

import torch
from torch.library import Library

LIB_NAME = "ascend_sim"
_lib = Library(LIB_NAME, "DEF")

FIA_MAX_BATCH = 4096  # the chip accepts at most 4096 entries in actual_seq_lengths(_kv)
ATTEN_MASK_SIZE = 2048  # sparse_mode 2/3/4 take a compressed 2048x2048 causal mask


class AscendOpError(RuntimeError):
    """An operator check failed; the message is the chip's where known."""


_lib.define(
    "fia(Tensor query, Tensor key, Tensor value, Tensor? block_table, Tensor? atten_mask, "
    "int[] actual_seq_lengths, int[] actual_seq_lengths_kv, int num_heads, "
    "int num_key_value_heads, float scale, str input_layout, int sparse_mode, int block_size) "
    "-> Tensor"
)
_lib.define(
    "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping) -> ()"
)


def check_block_size(block_size: int) -> None:
    # The FIA documentation asks fp16/bf16 paged KV for a block size that is a multiple of 16 and
    # at most 512; the plugin uses 128. Stricter reading where the docs are vague: both rules.
    if block_size <= 0 or block_size % 16 != 0 or block_size > 512:
        raise AscendOpError(
            f"blockSize({block_size}) is invalid: paged attention needs a multiple of 16 "
            "no larger than 512 (vllm-ascend uses 128)"
        )


def _check_fia(query, block_table, atten_mask, cu_q, kv_lens, num_heads, num_kv_heads,
               input_layout, sparse_mode, block_size, paged, kv_tokens):
    if input_layout != "TND":
        raise AscendOpError(f"input_layout {input_layout!r} is not simulated; use 'TND'")
    if query.dim() != 3 or query.shape[1] != num_heads:
        raise AscendOpError(
            f"When layout is TND, query must be [T, N={num_heads}, D], got {list(query.shape)}")
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise AscendOpError(
            f"numHeads({num_heads}) must be a multiple of numKeyValueHeads({num_kv_heads})")
    for name, lst in (("actualSequenceLengthQ", cu_q), ("actualSequenceLengthKV", kv_lens)):
        if len(lst) == 0:
            raise AscendOpError(f"When layout is TND, {name} must not be empty")
        if len(lst) > FIA_MAX_BATCH:
            raise AscendOpError(
                f"{name} has {len(lst)} elements, at most {FIA_MAX_BATCH} are supported")
    if len(cu_q) != len(kv_lens):
        raise AscendOpError(
            f"batch of actualSequenceLengthQ({len(cu_q)}) must be equal to batch of "
            f"actualSequenceLengthKV({len(kv_lens)})")
    prev = 0
    for i, v in enumerate(cu_q):
        if v < prev:
            raise AscendOpError(
                "When layout is TND, actualSequenceLengthQ must be cumulative and "
                f"non-decreasing, but element {i} ({v}) is less than {prev}")
        prev = v
    if query.shape[0] != cu_q[-1]:
        raise AscendOpError(
            f"When layout is TND, queryT({query.shape[0]}) must be equal to the last element "
            f"of actualSequenceLengthQ({cu_q[-1]})")
    if sparse_mode not in (0, 3):
        raise AscendOpError(f"sparse_mode {sparse_mode} is not simulated; use 0 or 3")
    if sparse_mode == 3 and (atten_mask is None
                             or tuple(atten_mask.shape[-2:]) != (ATTEN_MASK_SIZE,) * 2):
        raise AscendOpError(
            f"sparse_mode 3 needs a {ATTEN_MASK_SIZE}x{ATTEN_MASK_SIZE} atten_mask")
    q_lens = [b - a for a, b in zip([0] + cu_q[:-1], cu_q)]
    if sparse_mode == 0 and any(q > 1 for q in q_lens):
        # Without a mask every query token would see every key: only right for decode.
        raise AscendOpError("sparse_mode 0 (no mask) with a query length > 1 is not causal")
    if paged:
        check_block_size(block_size)
        if block_table is None or block_table.dim() != 2:
            raise AscendOpError("paged attention needs a 2-D block_table")
        if block_table.shape[0] != len(cu_q):
            raise AscendOpError(
                f"batch of actualSequenceLengthQ({len(cu_q)}) must be equal to the rows of "
                f"blockTable({block_table.shape[0]})")
        capacity = block_table.shape[1] * block_size
        for b, (q, kv) in enumerate(zip(q_lens, kv_lens)):
            if kv > capacity:
                raise AscendOpError(
                    f"actualSequenceLengthKV[{b}]({kv}) exceeds blockTable capacity({capacity})")
    else:
        # Without paging, KV lengths are cumulative like the query's.
        if kv_lens[-1] != kv_tokens:
            raise AscendOpError(
                f"When layout is TND, keyT({kv_tokens}) must be equal to the last element "
                f"of actualSequenceLengthKV({kv_lens[-1]})")
    return q_lens


def _pad_gather(flat: torch.Tensor, starts: list[int], lens: list[int], max_len: int):
    """[T, H, D] -> [B, max_len, H, D] by request, padding with row 0."""
    device = flat.device
    idx = torch.tensor(starts, device=device)[:, None] + torch.arange(max_len, device=device)
    valid = torch.arange(max_len, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
    idx = torch.where(valid, idx, 0)
    return flat[idx], valid


def fia_reference_kernel(query, key, value, block_table, atten_mask, cu_q, kv_lens, num_heads,
                         num_kv_heads, scale, input_layout, sparse_mode, block_size):
    paged = block_table is not None
    kv_tokens = key.shape[0]
    q_lens = _check_fia(query, block_table, atten_mask, list(cu_q), list(kv_lens), num_heads,
                        num_kv_heads, input_layout, sparse_mode, block_size, paged, kv_tokens)
    B = len(cu_q)
    T, N, D = query.shape
    out = torch.zeros_like(query)
    if T == 0:
        return out
    if paged:
        q_kv = list(kv_lens)
        for b, (q, kv) in enumerate(zip(q_lens, q_kv)):
            if q > kv:
                # The query's tokens are the last q of the request's kv_len tokens.
                raise AscendOpError(
                    f"actualSequenceLengthKV[{b}]({kv}) is less than the query length({q})")
    else:
        q_kv = [b - a for a, b in zip([0] + list(kv_lens[:-1]), kv_lens)]
    max_q, max_kv = max(q_lens), max(q_kv)
    if max_q == 0:
        return out
    q_starts = [c - q for c, q in zip(cu_q, q_lens)]
    qp, q_valid = _pad_gather(query, q_starts, q_lens, max_q)  # [B, Sq, N, D]
    if paged:
        nblk = max(1, -(-max_kv // block_size))
        bt = block_table[:, :nblk].long()
        # key/value: [num_blocks, block_size, Hkv, D] (or BSH [num_blocks, block_size, Hkv*D])
        kp = key[bt].reshape(B, nblk * block_size, num_kv_heads, D)[:, :max_kv]
        vp = value[bt].reshape(B, nblk * block_size, num_kv_heads, D)[:, :max_kv]
    else:
        kv_starts = [c - k for c, k in zip(kv_lens, q_kv)]
        kp, _ = _pad_gather(key, kv_starts, q_kv, max_kv)
        vp, _ = _pad_gather(value, kv_starts, q_kv, max_kv)
    dev = query.device
    kv_len_t = torch.tensor(q_kv, device=dev)[:, None, None]
    j = torch.arange(max_kv, device=dev)[None, None, :]
    # Causal with the KV offset: query i of a request sits at position kv_len - q_len + i.
    qpos = (kv_len_t - torch.tensor(q_lens, device=dev)[:, None, None]
            + torch.arange(max_q, device=dev)[None, :, None])
    allowed = (j < kv_len_t) & (j <= qpos)
    allowed |= ~q_valid[:, :, None]  # padded query rows: any finite row, discarded below
    o = torch.nn.functional.scaled_dot_product_attention(
        qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
        attn_mask=allowed[:, None], scale=scale, enable_gqa=num_heads != num_kv_heads,
    ).transpose(1, 2)  # [B, Sq, N, D]
    rows = torch.tensor(q_starts, device=dev)[:, None] + torch.arange(max_q, device=dev)
    out[rows[q_valid]] = o[q_valid]
    return out


def _fia_cpu(query, key, value, block_table, atten_mask, actual_seq_lengths,
             actual_seq_lengths_kv, num_heads, num_key_value_heads, scale, input_layout,
             sparse_mode, block_size):
    return fia_reference_kernel(query, key, value, block_table, atten_mask, actual_seq_lengths,
                                actual_seq_lengths_kv, num_heads, num_key_value_heads, scale,
                                input_layout, sparse_mode, block_size)


def _reshape_and_cache_cpu(key, value, key_cache, value_cache, slot_mapping):
    slots = slot_mapping[: key.shape[0]].long()
    keep = slots >= 0  # slot -1 marks padding: the chip writes nothing for it
    slots, k, v = slots[keep], key[keep], value[keep]
    block_size = key_cache.shape[1]
    blk, off = slots // block_size, slots % block_size
    key_cache[blk, off] = k.to(key_cache.dtype)
    value_cache[blk, off] = v.to(value_cache.dtype)


_lib.impl("fia", _fia_cpu, "CPU")
_lib.impl("reshape_and_cache", _reshape_and_cache_cpu, "CPU")

fia_op = torch.ops.ascend_sim.fia.default
reshape_and_cache_op = torch.ops.ascend_sim.reshape_and_cache.default
