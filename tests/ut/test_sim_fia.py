"""The simulator's FIA operator: every chip check, and numerics against a plain reference."""

import pytest
import torch

from vllm_ascend.device.sim import SimBackend
from vllm_ascend.device.sim_ops import ATTEN_MASK_SIZE, AscendOpError

sim = SimBackend(reason="test")
MASK = torch.ones(ATTEN_MASK_SIZE, ATTEN_MASK_SIZE, dtype=torch.bool).triu(1)


def reference(q, k_per_req, v_per_req, q_lens, scale):
    """Causal attention per request, the query being the last q_len of the request's tokens."""
    outs, start = [], 0
    n = q.shape[1]
    for k, v, ql in zip(k_per_req, v_per_req, q_lens):
        kl = k.shape[0]
        qq = q[start:start + ql].float()
        start += ql
        rep = n // k.shape[1]
        k, v = k.repeat_interleave(rep, 1).float(), v.repeat_interleave(rep, 1).float()
        scores = torch.einsum("qhd,khd->hqk", qq, k) * scale
        allowed = torch.arange(kl)[None, :] <= (kl - ql + torch.arange(ql))[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs).to(q.dtype)


def paged_case(q_lens, kv_lens, n_heads=8, n_kv=2, d=32, block=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-kv // block) for kv in kv_lens)
    num_blocks = len(kv_lens) * max_blocks + 3
    kc = torch.randn(num_blocks, block, n_kv, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, block, n_kv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)  # scattered, non-contiguous blocks
    table = perm[: len(kv_lens) * max_blocks].view(len(kv_lens), max_blocks).to(torch.int32)
    q = torch.randn(sum(q_lens), n_heads, d, generator=g).to(dtype)
    ks = [torch.cat([kc[b] for b in row.tolist()])[:kv] for row, kv in zip(table, kv_lens)]
    vs = [torch.cat([vc[b] for b in row.tolist()])[:kv] for row, kv in zip(table, kv_lens)]
    cu = torch.tensor(q_lens).cumsum(0).tolist()
    return q, kc, vc, table, cu, ks, vs


def run(q, kc, vc, table, cu, kv_lens, block=16, n_kv=2, **kw):
    args = dict(actual_seq_lengths=cu, actual_seq_lengths_kv=kv_lens, block_table=table,
                block_size=block, num_heads=q.shape[1], num_key_value_heads=n_kv, scale=0.125,
                input_layout="TND", sparse_mode=3, atten_mask=MASK)
    args.update(kw)
    return sim.fused_infer_attention_score(q, kc, vc, **args)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_paged_mixed_batch_matches_reference(dtype, tol):
    # prefill from empty, chunked prefill with offset, decode; GQA 8:2; blocks of 16 crossed.
    q_lens, kv_lens = [5, 7, 1, 1], [5, 40, 33, 16]
    q, kc, vc, table, cu, ks, vs = paged_case(q_lens, kv_lens, dtype=dtype)
    out = run(q, kc, vc, table, cu, kv_lens)
    torch.testing.assert_close(out.float(), reference(q, ks, vs, q_lens, 0.125).float(),
                               atol=tol, rtol=tol)


def test_unpaged_prefill_matches_reference():
    q_lens = [3, 6]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(9, 4, 16, generator=g)
    k = torch.randn(9, 1, 16, generator=g)
    v = torch.randn(9, 1, 16, generator=g)
    out = sim.fused_infer_attention_score(
        q, k, v, actual_seq_lengths=[3, 9], actual_seq_lengths_kv=[3, 9], block_table=None,
        block_size=0, num_heads=4, num_key_value_heads=1, scale=0.25, atten_mask=MASK)
    ref = reference(q, [k[:3], k[3:]], [v[:3], v[3:]], q_lens, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_query_tokens_must_equal_last_cumulative_length():
    q, kc, vc, table, cu, _, _ = paged_case([3, 2], [3, 2])
    with pytest.raises(AscendOpError, match=r"When layout is TND, queryT\(8\) must be equal to "
                                            r"the last element of actualSequenceLengthQ\(5\)"):
        run(torch.cat([q, q[:3]]), kc, vc, table, cu, [3, 2])


def test_lengths_must_be_host_lists():
    q, kc, vc, table, cu, _, _ = paged_case([1, 1], [4, 4])
    with pytest.raises(AscendOpError, match="must be a host list of ints"):
        run(q, kc, vc, table, torch.tensor(cu), [4, 4])
    with pytest.raises(AscendOpError, match="actual_seq_lengths_kv must be a host list"):
        run(q, kc, vc, table, cu, torch.tensor([4, 4]))


def test_cumulative_lengths_must_not_decrease():
    q, kc, vc, table, _, _, _ = paged_case([2, 1, 2], [2, 3, 4])
    with pytest.raises(AscendOpError, match="cumulative and non-decreasing"):
        run(q, kc, vc, table, [2, 1, 5], [2, 3, 4])


def test_batch_must_match_block_table_rows_and_kv_list():
    q, kc, vc, table, cu, _, _ = paged_case([1, 1, 1], [4, 4, 4])
    with pytest.raises(AscendOpError, match=r"rows of blockTable\(2\)"):
        run(q, kc, vc, table[:2], cu, [4, 4, 4])
    with pytest.raises(AscendOpError, match=r"actualSequenceLengthKV\(2\)"):
        run(q, kc, vc, table, cu, [4, 4])


def test_at_most_4096_entries():
    n = 4097
    q = torch.randn(n, 2, 16)
    kc = torch.randn(2, 16, 1, 16)
    table = torch.zeros(n, 1, dtype=torch.int32)
    with pytest.raises(AscendOpError, match="at most 4096"):
        run(q, kc, kc, table, list(range(1, n + 1)), [1] * n, n_kv=1)


@pytest.mark.parametrize("block", [8, 100, 1024])
def test_block_size_must_be_accepted_by_the_chip(block):
    q, kc, vc, table, cu, _, _ = paged_case([1], [4])
    with pytest.raises(AscendOpError, match=rf"blockSize\({block}\) is invalid"):
        run(q, kc, vc, table, cu, [4], block=block)


def test_kv_shorter_than_query_and_overflowing_table_are_errors():
    q, kc, vc, table, cu, _, _ = paged_case([4], [4])
    with pytest.raises(AscendOpError, match="less than the query length"):
        run(q, kc, vc, table, cu, [3])
    with pytest.raises(AscendOpError, match="exceeds blockTable capacity"):
        run(q, kc, vc, table, cu, [17])


def test_reshape_and_cache_skips_padding_slots():
    kc = torch.zeros(4, 16, 2, 8)
    vc = torch.zeros(4, 16, 2, 8)
    key = torch.randn(5, 2, 8)
    value = torch.randn(5, 2, 8)
    slots = torch.tensor([17, -1, 0, 63, -1])
    sim.reshape_and_cache(key, value, kc, vc, slots)
    torch.testing.assert_close(kc[1, 1], key[0])
    torch.testing.assert_close(vc[0, 0], value[2])
    torch.testing.assert_close(kc[3, 15], key[3])
    assert kc.flatten(0, 1).abs().sum(-1).sum(-1).count_nonzero() == 3  # padding wrote nothing
