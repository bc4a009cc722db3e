"""The simulator's torch_npu.npu_fused_infer_attention_score: numerics against a plain
reference, and each of the chip's host-side checks (TORCH_NPU_CONTRACTS.md F1-F17), raised with
the chip's message and error code."""

import pytest
import torch

from vllm_ascend.device import sim as torch_npu
from vllm_ascend.device.sim.errors import AscendOpError

MASK = torch.triu(torch.ones(2048, 2048), diagonal=1).to(torch.int8)
BF16 = torch.bfloat16


def reference(q, k_per_req, v_per_req, q_lens, scale, window=None, sinks=None):
    """Causal attention per request in fp32, the query being the last q_len of its tokens;
    with ``window``, each query attends its last ``window`` keys, its own included (vLLM's and
    HF's sliding window); with ``sinks``, one more logit per head in each row's softmax, its
    column dropped after (HF's GPT-OSS eager attention)."""
    outs, start = [], 0
    n = q.shape[1]
    for k, v, ql in zip(k_per_req, v_per_req, q_lens):
        kl = k.shape[0]
        qq = q[start:start + ql].float()
        start += ql
        rep = n // k.shape[1]
        k, v = k.repeat_interleave(rep, 1).float(), v.repeat_interleave(rep, 1).float()
        scores = torch.einsum("qhd,khd->hqk", qq, k) * scale
        pos = (kl - ql + torch.arange(ql))[:, None]
        allowed = torch.arange(kl)[None, :] <= pos
        if window is not None:
            allowed &= torch.arange(kl)[None, :] > pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            column = sinks.float().view(n, 1, 1).expand(n, ql, 1)
            probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs)


class Case:
    """A paged batch as vllm-ascend passes it: TND query, BnBsH caches, int32 block table."""

    def __init__(self, q_lens, kv_lens, n_heads=8, n_kv=2, d=32, block=16, dtype=BF16, seed=0):
        g = torch.Generator().manual_seed(seed)
        max_blocks = max(-(-kv // block) for kv in kv_lens)
        num_blocks = len(kv_lens) * max_blocks + 3
        self.k4 = torch.randn(num_blocks, block, n_kv, d, generator=g).to(dtype)
        self.v4 = torch.randn(num_blocks, block, n_kv, d, generator=g).to(dtype)
        perm = torch.randperm(num_blocks, generator=g)  # scattered blocks
        self.table = perm[: len(kv_lens) * max_blocks].view(len(kv_lens), max_blocks)
        self.table = self.table.to(torch.int32).contiguous()
        self.q = torch.randn(sum(q_lens), n_heads, d, generator=g).to(dtype)
        self.q_lens, self.kv_lens, self.block, self.n_kv = q_lens, kv_lens, block, n_kv
        self.cu = torch.tensor(q_lens).cumsum(0).tolist()

    def per_request(self, cache):
        return [torch.cat([cache[b] for b in row.tolist()])[:kv]
                for row, kv in zip(self.table, self.kv_lens)]

    def kwargs(self, **overrides):
        nb = self.k4.shape[0]
        args = dict(query=self.q, key=self.k4.view(nb, self.block, -1),
                    value=self.v4.view(nb, self.block, -1), atten_mask=MASK,
                    block_table=self.table, input_layout="TND", block_size=self.block,
                    actual_seq_lengths=self.cu, actual_seq_lengths_kv=self.kv_lens,
                    num_key_value_heads=self.n_kv, num_heads=self.q.shape[1], scale=0.125,
                    sparse_mode=3)
        args.update(overrides)
        return args

    def run(self, **overrides):
        return torch_npu.npu_fused_infer_attention_score(**self.kwargs(**overrides))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_lens,kv_lens", [
    ([5, 7, 1, 1], [5, 40, 33, 16]),  # prefill from empty, chunked with an offset, decodes
    ([1, 1, 1], [33, 16, 1]),  # decodes only (one query token each), KV lengths differ
    ([1, 1], [21, 21]),  # decodes only, equal KV lengths
    ([1, 1, 0], [21, 3, 0]),  # decodes and a graph's padding request without query tokens
], ids=["mixed", "decode", "decode-equal-kv", "decode-padded"])
def test_paged_batch_matches_reference(dtype, q_lens, kv_lens):
    # GQA 8:2; blocks crossed.
    case = Case(q_lens, kv_lens, dtype=dtype)
    out, lse = case.run()
    ref = reference(case.q, case.per_request(case.k4), case.per_request(case.v4), case.q_lens,
                    0.125)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert out.dtype == dtype and lse.shape == (0,) and lse.dtype == torch.float32


@pytest.mark.parametrize("shared", [False, True], ids=["own-blocks", "shared-blocks"])
def test_a_decode_token_attends_the_same_bits_alone_or_in_any_batch(shared):
    # Graph and eager steps batch a request with different neighbours (padding requests, other
    # requests): its output must not change by a bit. With every row on the same blocks (the
    # dummy requests of a capture) the simulator gathers them once; that must change nothing.
    case = Case([1, 1, 1, 1], [37, 37, 37, 37] if shared else [37, 20, 37, 5])
    if shared:
        case.table[:] = case.table[0]
    batch, _ = case.run()
    for r in range(4):
        alone, _ = case.run(query=case.q[r:r + 1], block_table=case.table[r:r + 1].contiguous(),
                            actual_seq_lengths=[1], actual_seq_lengths_kv=[case.kv_lens[r]])
        assert torch.equal(alone, batch[r:r + 1]), r


@pytest.mark.parametrize("q_len", [1, 3], ids=["decode", "prefill"])
def test_one_request_within_one_block_reads_its_first_block_in_place(q_len):
    # A batch-1 step whose keys fit in one block reads that block where it lies (no gather):
    # the table's first column, of a row that holds more blocks (as vLLM's rows do). A decode
    # token (ops._attend_one_token) gets the same bits as in a batch, which gathers its block;
    # a prefill (ops._paged_kv) the reference's values.
    case = Case([q_len] * 3, [9, 16, 3])
    used = case.table.flatten().tolist()
    spare = [b for b in range(case.k4.shape[0]) if b not in used]
    case.table = torch.cat([case.table, torch.tensor(spare, dtype=torch.int32).view(3, 1)], 1)
    batch, _ = case.run()
    ref = reference(case.q, case.per_request(case.k4), case.per_request(case.v4), case.q_lens,
                    0.125)
    torch.testing.assert_close(batch.float(), ref, atol=2e-2, rtol=2e-2)
    for r in range(3):
        rows = slice(r * q_len, (r + 1) * q_len)
        alone, _ = case.run(query=case.q[rows], block_table=case.table[r:r + 1].contiguous(),
                            actual_seq_lengths=[q_len], actual_seq_lengths_kv=[case.kv_lens[r]])
        if q_len == 1:
            assert torch.equal(alone, batch[rows]), r
        else:
            torch.testing.assert_close(alone.float(), ref[rows], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("q_len", [1, 3])
def test_requests_all_alike_attend_once_with_the_same_bits(q_len, monkeypatch):
    # vLLM's dummy batches: every request the same queries over the same blocks. The simulator
    # attends one and writes it to each; the bits are the whole batch's, and a request that
    # differs in one bit of its query (or its KV length) takes the whole batch.
    from vllm_ascend.device.sim import fia as ops

    case = Case([q_len] * 5, [37] * 5)
    case.table[:] = case.table[0]
    case.q = case.q[:q_len].repeat(5, 1, 1)
    alike = ops.rows_alike
    monkeypatch.setattr(ops, "rows_alike", lambda x: False)
    whole, _ = case.run()
    monkeypatch.setattr(ops, "rows_alike", alike)
    got, _ = case.run()
    assert torch.equal(got, whole)
    for change in ("query", "kv"):
        other = Case([q_len] * 5, [37] * 5)
        other.table[:], other.q = case.table, case.q.clone()
        kv = [37] * 4 + [36] if change == "kv" else [37] * 5
        if change == "query":
            other.q[-1, 0, 0] = -other.q[-1, 0, 0]
        got, _ = other.run(actual_seq_lengths_kv=kv)
        monkeypatch.setattr(ops, "rows_alike", lambda x: False)
        whole, _ = other.run(actual_seq_lengths_kv=kv)
        monkeypatch.setattr(ops, "rows_alike", alike)
        assert torch.equal(got, whole), change
        assert not torch.equal(got[-q_len:], got[:q_len]), change


@pytest.mark.parametrize("q_lens,kv_lens", [
    ([5, 7, 1, 1], [5, 40, 33, 16]),  # prefill, chunked prefill, decodes
    ([1, 1, 1], [33, 16, 1]),  # decodes only
    ([12, 1], [12, 12]),  # a prefill longer than the window beside a decode at the same length
], ids=["mixed", "decode", "prefill"])
def test_band_mode_keeps_the_window_and_reads_no_key_before_it(q_lens, kv_lens):
    """sparse_mode 4 with pre_tokens W - 1, next_tokens 0 (the inclusive reading, band_of):
    each query attends its last W keys. The keys before every query's window are not read:
    NaN there (a block vLLM gave back, now the null block) leaves the output finite and equal."""
    window = 6
    case = Case(q_lens, kv_lens, dtype=torch.float16)
    ref = reference(case.q, case.per_request(case.k4), case.per_request(case.v4), case.q_lens,
                    0.125, window)
    band = dict(sparse_mode=4, pre_tokens=window - 1, next_tokens=0)
    out, _ = case.run(**band)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for b, (row, ql, kl) in enumerate(zip(case.table, q_lens, kv_lens)):
        first = kl - ql - (window - 1)  # the first key any of its queries keeps
        for j in range(max(first, 0)):
            blk, off = row[j // case.block], j % case.block
            case.k4[blk, off] = float("nan")
            case.v4[blk, off] = float("nan")
    again, _ = case.run(**band)
    assert torch.equal(again, out)
    # One key more or less is another result: the window's edge is where band_of puts it.
    for pre in (window - 2, window):
        assert not torch.equal(Case(q_lens, kv_lens, dtype=torch.float16).run(
            sparse_mode=4, pre_tokens=pre, next_tokens=0)[0], out)


def test_band_mode_takes_the_causal_mask_and_a_non_empty_band():
    case = Case([3], [9])
    with pytest.raises(AscendOpError, match="sparseMode 4 needs the 2048x2048 attnMask"):
        case.run(sparse_mode=4, atten_mask=None, pre_tokens=3, next_tokens=0)
    with pytest.raises(AscendOpError, match="When sparseMode is 4, attnMask must be"):
        case.run(sparse_mode=4, atten_mask=1 - MASK, pre_tokens=3, next_tokens=0)
    with pytest.raises(AscendOpError, match=r"preTokens\(2\) \+ nextTokens\(-3\) must be >= 0"):
        case.run(sparse_mode=4, pre_tokens=2, next_tokens=-3)
    # Outside mode 4 the chip ignores the band: asking for one there is refused, not ignored.
    with pytest.raises(AscendOpError, match="ignored in sparse_mode 3: a band takes sparse_mode 4"):
        case.run(pre_tokens=3, next_tokens=0)


def test_out_overload_writes_into_the_given_tensors_with_a_max_workspace():
    case = Case([2, 1], [6, 9])
    ws = torch_npu._npu_fused_infer_attention_score_get_max_workspace(**case.kwargs())
    assert ws.dim() == 1 and ws.dtype == case.q.dtype
    out, lse = torch.empty_like(case.q), torch.empty(1, dtype=case.q.dtype)
    got = torch_npu.npu_fused_infer_attention_score.out(**case.kwargs(), workspace=ws,
                                                        out=[out, lse])
    assert got[0] is out
    torch.testing.assert_close(out, case.run()[0])


def test_out_overload_needs_the_workspace():
    case = Case([1], [4])
    out, lse = torch.empty_like(case.q), torch.empty(1, dtype=case.q.dtype)
    with pytest.raises(AscendOpError, match="error code is 561002(.|\n)*needs workspace="):
        torch_npu.npu_fused_infer_attention_score.out(**case.kwargs(), out=[out, lse])
    with pytest.raises(AscendOpError, match="needs workspace="):
        torch_npu.npu_fused_infer_attention_score.out(
            **case.kwargs(), workspace=torch.empty(8, dtype=BF16), out=[out, lse])


def test_unpaged_prefill_matches_reference():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(9, 4, 16, generator=g).to(BF16)
    k = torch.randn(9, 1, 16, generator=g).to(BF16)
    v = torch.randn(9, 1, 16, generator=g).to(BF16)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, v, actual_seq_lengths=[3, 9], actual_seq_lengths_kv=[3, 9], num_heads=4,
        num_key_value_heads=1, scale=0.25, atten_mask=MASK, sparse_mode=3, input_layout="TND")
    ref = reference(q, [k[:3], k[3:]], [v[:3], v[3:]], [3, 6], 0.25)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


# -- the chip's checks ---------------------------------------------------------------------------

def test_query_tokens_must_equal_the_last_cumulative_length():  # F3
    case = Case([3, 2], [3, 2])
    with pytest.raises(AscendOpError, match=r"error code is 561002(.|\n)*When layout is TND, "
                       r"queryT\(8\) must be equal to the last element of "
                       r"actualSequenceLengthQ\(5\)"):
        case.run(query=torch.cat([case.q, case.q[:3]]))


def test_lengths_are_host_lists_not_tensors():  # F2
    case = Case([1, 1], [4, 4])
    with pytest.raises(TypeError, match="'actual_seq_lengths' must be tuple of ints, not Tensor"):
        case.run(actual_seq_lengths=torch.tensor(case.cu))
    with pytest.raises(TypeError, match="'actual_seq_lengths_kv' must be tuple of ints"):
        case.run(actual_seq_lengths_kv=torch.tensor([4, 4]))


def test_lengths_are_required_non_decreasing_and_at_most_4096():  # F2
    case = Case([2, 1, 2], [2, 3, 4])
    with pytest.raises(AscendOpError, match="actualSequenceLengthQ is required"):
        case.run(actual_seq_lengths=[])
    with pytest.raises(AscendOpError, match="non-decreasing"):
        case.run(actual_seq_lengths=[2, 1, 5])
    n = 4097
    big = Case([1] * 2, [1] * 2)
    with pytest.raises(AscendOpError, match="at most 4096"):
        big.run(query=torch.zeros(n, 8, 32, dtype=BF16), actual_seq_lengths=list(range(1, n + 1)),
                actual_seq_lengths_kv=[1] * n, block_table=torch.zeros(n, 1, dtype=torch.int32))


def test_kv_lengths_match_the_batch_and_the_block_table():  # F5
    case = Case([1, 1, 1], [4, 4, 20])
    with pytest.raises(AscendOpError, match=r"The size\(2\) of actualSeqLengthsKv is not equal "
                                            r"to the batchSize\(3\)"):
        case.run(actual_seq_lengths_kv=[4, 4])
    with pytest.raises(AscendOpError, match=r"block table shape should be \[3, >=2\], now is "
                                            r"\[2, 2\]"):
        case.run(block_table=case.table[:2].contiguous())
    with pytest.raises(AscendOpError, match=r"block table shape should be \[3, >=3\]"):
        case.run(actual_seq_lengths_kv=[4, 4, 40])
    with pytest.raises(AscendOpError, match="less than the query length"):
        Case([4], [4]).run(actual_seq_lengths_kv=[3])


def test_block_table_is_2d_int32():  # F5
    case = Case([1], [4])
    with pytest.raises(AscendOpError, match="error code is 161002(.|\n)*2-D int32"):
        case.run(block_table=case.table.long())


def test_paged_caches_are_3d_bnbsh_with_the_block_size():  # F6
    case = Case([1], [4])
    with pytest.raises(AscendOpError, match="the cache shape must be BnBsH"):
        case.run(key=case.k4, value=case.v4)
    with pytest.raises(AscendOpError, match="consistent with input blockSize"):
        case.run(block_size=32)
    for bad in (8, 100, 512):
        with pytest.raises(AscendOpError, match=rf"blockSize\({bad}\) must be a multiple of 16"):
            case.run(block_size=bad)


def test_dtypes_fp16_or_bf16_and_equal():  # F8
    case = Case([1], [4])
    with pytest.raises(AscendOpError, match="161002(.|\n)*Input dtype of Q, K, and V must be "
                                            "consitent"):
        case.run(query=case.q.float())
    f32 = Case([1], [4], dtype=torch.float32)
    with pytest.raises(AscendOpError, match="float16 or bfloat16"):
        f32.run()


def test_head_dim_and_head_counts():  # F8-F10
    with pytest.raises(AscendOpError, match="headDim shall not exceed 256"):
        Case([1], [4], n_heads=2, n_kv=1, d=272).run()
    with pytest.raises(AscendOpError, match="D should be 16 elements aligned"):
        Case([1], [4], n_heads=2, n_kv=1, d=24).run()
    with pytest.raises(AscendOpError, match=r"numHeads\(6\) and numKeyValueHeads\(4\)"):
        Case([1], [4], n_heads=6, n_kv=4, d=16).run()
    with pytest.raises(AscendOpError, match="must be equal to numHeads"):
        Case([1], [4]).run(num_heads=4)


def test_mask_and_sparse_mode():  # F11-F13
    case = Case([2], [4])
    with pytest.raises(AscendOpError, match="sparse_mode 7 is not supported"):
        case.run(sparse_mode=7)
    with pytest.raises(AscendOpError, match="When attnMask is provided, sparseMode must be 3 or 4"):
        case.run(sparse_mode=0)
    with pytest.raises(AscendOpError, match="maskDim 1024 shall be 2048"):
        case.run(atten_mask=MASK[:1024, :1024].contiguous())
    with pytest.raises(AscendOpError, match="attnMask dtype must be bool, int8 or uint8"):
        case.run(atten_mask=MASK.float())
    with pytest.raises(AscendOpError, match="not causal"):
        case.run(sparse_mode=0, atten_mask=None)
    # Mode 3 reads the mask as the causal pattern: other values are refused, not misread.
    for wrong in (1 - MASK, MASK.t().contiguous(), torch.zeros_like(MASK)):
        with pytest.raises(AscendOpError, match="attnMask must be the 2048x2048 causal mask"):
            case.run(atten_mask=wrong)
    mask = MASK.bool()
    case.run(atten_mask=mask)  # bool, int8 or uint8 with the same values
    mask[0, 1] = False  # the same tensor, changed: checked again
    with pytest.raises(AscendOpError, match="attnMask must be the 2048x2048 causal mask"):
        case.run(atten_mask=mask)


def test_inputs_must_be_contiguous():  # F14
    case = Case([2], [4])
    strided = torch.zeros(2, 8, 64, dtype=BF16)[:, :, :32]  # a head-dim slice
    with pytest.raises(AscendOpError, match="query must be contiguous"):
        case.run(query=strided)


def test_unsupported_keywords_are_refused_not_ignored():
    case = Case([1], [4])
    with pytest.raises(NotImplementedError, match="pse_shift is not simulated"):
        case.run(pse_shift=torch.zeros(1))
    with pytest.raises(TypeError, match="unexpected keyword argument 'actual_seq_qlen'"):
        case.run(actual_seq_qlen=[1])


def v2_kwargs(case, sinks, **overrides):
    """The dense FIA v2 call upstream's attention_v1.py makes for a layer with sinks."""
    args = case.kwargs()
    for v1, v2 in (("actual_seq_lengths", "actual_seq_qlen"),
                   ("actual_seq_lengths_kv", "actual_seq_kvlen"), ("num_heads", "num_query_heads"),
                   ("scale", "softmax_scale")):
        args[v2] = args.pop(v1)
    args.update(learnable_sink=sinks, **overrides)
    return args


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("q_lens,kv_lens", [
    ([5, 7, 1, 1], [5, 40, 33, 16]),  # prefill, chunked prefill, decodes
    ([1, 1, 1], [33, 16, 1]),  # decodes only
], ids=["mixed", "decode"])
def test_v2_with_learnable_sinks_matches_reference(q_lens, kv_lens, window):
    """GPT-OSS's attention sinks on FIA v2's dense TND path, causal and banded: against HF's
    sink reading, and measurably not the attention without them."""
    case = Case(q_lens, kv_lens)
    sinks = torch.linspace(-1.0, 2.0, case.q.shape[1]).to(BF16)
    band = {} if window is None else dict(sparse_mode=4, pre_tokens=window - 1, next_tokens=0)
    out, _ = torch_npu.npu_fused_infer_attention_score_v2(**v2_kwargs(case, sinks, **band))
    k, v = case.per_request(case.k4), case.per_request(case.v4)
    torch.testing.assert_close(out.float(), reference(case.q, k, v, q_lens, 0.125, window, sinks),
                               atol=2e-2, rtol=2e-2)
    without = reference(case.q, k, v, q_lens, 0.125, window)
    assert (out.float() - without).abs().max() > 0.1
    # The .out overload with a max workspace: the same bits.
    kwargs = v2_kwargs(case, sinks, **band)
    workspace = torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace(**kwargs)
    o = torch.empty_like(case.q)
    torch_npu.npu_fused_infer_attention_score_v2.out(
        **kwargs, workspace=workspace, out=[o, torch.empty(1, dtype=BF16)])
    assert torch.equal(o, out)


def test_v2_sinks_checks():
    """learnable_sink: bfloat16 (Nq,) with a bfloat16 query, a value head dim of at most 128
    (TORCH_NPU_CONTRACTS.md 1.6); v2's dense path makes v1's checks under v2's name."""
    case = Case([2, 1], [4, 9])
    sinks = torch.zeros(8, dtype=BF16)
    with pytest.raises(AscendOpError, match="learnable_sink takes bfloat16"):
        torch_npu.npu_fused_infer_attention_score_v2(**v2_kwargs(case, sinks.float()))
    fp16 = Case([2, 1], [4, 9], dtype=torch.float16)
    with pytest.raises(AscendOpError, match="learnable_sink takes bfloat16"):
        torch_npu.npu_fused_infer_attention_score_v2(**v2_kwargs(fp16, sinks))
    with pytest.raises(AscendOpError, match="1-D of numHeads"):
        torch_npu.npu_fused_infer_attention_score_v2(**v2_kwargs(case, sinks[:4]))
    wide = Case([1], [4], n_heads=2, n_kv=1, d=144)
    with pytest.raises(AscendOpError, match="value head dim of at most 128"):
        torch_npu.npu_fused_infer_attention_score_v2(**v2_kwargs(wide, sinks[:2]))
    with pytest.raises(AscendOpError, match="(?s)npu_fused_infer_attention_score_v2.*queryT"):
        torch_npu.npu_fused_infer_attention_score_v2(**v2_kwargs(case, sinks,
                                                                 actual_seq_qlen=[2, 4]))


@pytest.mark.parametrize("q_lens,kv_lens", [([1, 1, 1], [37, 20, 5]), ([3, 1], [40, 17])],
                         ids=["decode", "prefill"])
def test_what_the_products_cpu_library_keeps_is_host_memory(q_lens, kv_lens, monkeypatch):
    """FIA's float32 products run on MKL, whose memory manager keeps its work buffers after a
    call (on an AMX Xeon several MB more at each capture size's first warm-up: counted as the
    device's, they grew the default FULL engine's graph estimate from 50 to 504 MB). What a
    batch size's first call leaves on the heap beyond its output is the simulator's host
    memory (library_caches.first_calls_measured), whichever CPU runs it: a library that keeps
    4 MB a call is emulated here. A later call of the same batch size is not measured (a heap
    reading costs more than the products): what it keeps stays the device's, the stricter
    reading."""
    from vllm_ascend.device.sim import library_caches, memory

    kept = []

    def keeping(real):
        def call(*args, **kwargs):
            kept.append(torch.empty(4 << 20, dtype=torch.uint8))
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(torch, "bmm", keeping(torch.bmm))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        keeping(torch.nn.functional.scaled_dot_product_attention))
    monkeypatch.setattr(memory._ACCOUNT, "simulator", memory._ACCOUNT.simulator)
    monkeypatch.setattr(library_caches, "_MEASURED", set())
    device = lambda: memory.heap() - memory._ACCOUNT.simulator  # noqa: E731  (the heap is)
    case = Case(q_lens, kv_lens)
    held, before = memory._ACCOUNT.simulator, device()
    out, _ = case.run()
    assert kept and memory._ACCOUNT.simulator - held >= len(kept) * (4 << 20)
    assert device() - before < 1 << 20  # the device holds the output only
    assert torch.equal(out, Case(q_lens, kv_lens).run()[0])
    kept.clear()
    other = Case(q_lens, [kv + 3 for kv in kv_lens], seed=1)
    held, before = memory._ACCOUNT.simulator, device()
    other.run()  # the same batch size: measured no more
    assert kept and memory._ACCOUNT.simulator == held
    assert device() - before >= len(kept) * (4 << 20)
