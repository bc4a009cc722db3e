"""The simulator's MLA operators (device/sim/mla.py): numerics against plain references written
from the operators' documented formulas, the host-side checks of each contract
(docs/torch_npu_calls.md), and FIA v2 captured in a graph and re-issued by a task update, as the
MLA backend drives it."""

import pytest
import torch

from vllm_ascend.device import sim as torch_npu
from vllm_ascend.device.sim import npu
from vllm_ascend.device.sim.errors import AscendOpError

BF16 = torch.bfloat16
MASK = torch.triu(torch.ones(2048, 2048), diagonal=1).to(torch.int8)
BS = 16  # block size of these small caches


def interleaved_rope_reference(x, pos, base=10000.0):
    """GPT-J RoPE (pairs 2i, 2i+1 rotated by pos * base^(-2i/D)), then de-interleaved (evens,
    then odds): the order the chip's interleave-rope kernels return. x [T, ..., D], pos [T]."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2).float() / d)
    ang = pos.float()[:, None] * inv  # [T, D/2]
    shape = (-1,) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    x1, x2 = x.float()[..., ::2], x.float()[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def half_cos_sin(pos, d=64, base=10000.0, dtype=BF16):
    """cos/sin in the half layout the operators take, [T, 1, 1, D]."""
    inv = base ** (-torch.arange(0, d, 2).float() / d)
    ang = pos.float()[:, None] * inv
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    return cos.view(-1, 1, 1, d).to(dtype), sin.view(-1, 1, 1, d).to(dtype)


def test_interleave_rope_is_gptj_rope_in_half_order():
    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([0, 3, 17, 200])
    x = torch.randn(4, 2, 1, 64, generator=g).to(BF16)
    cos, sin = half_cos_sin(pos)
    out = torch_npu.npu_interleave_rope(x, cos, sin)
    torch.testing.assert_close(out.float(), interleaved_rope_reference(x, pos), atol=0.03,
                               rtol=0.02)


@pytest.mark.parametrize("bad,message", [
    (lambda x, c, s: (x[..., :32].contiguous(), c[..., :32].contiguous(),
                      s[..., :32].contiguous()), "D dim of x, cos and sin must be 64"),
    (lambda x, c, s: (x, c.expand(-1, 2, -1, -1).contiguous(), s.expand(-1, 2, -1, -1)
                      .contiguous()), r"cos/sin must be \(B, 1, 1 or S, D\)"),
    (lambda x, c, s: (x.transpose(0, 1).contiguous().transpose(0, 1), c, s),
     "must be contiguous"),
    (lambda x, c, s: (x, c.float(), s.float()), "share one dtype"),
])
def test_interleave_rope_contract(bad, message):
    pos = torch.tensor([1, 2, 3])
    x = torch.randn(3, 2, 1, 64).to(BF16)
    with pytest.raises(AscendOpError, match=message):
        torch_npu.npu_interleave_rope(*bad(x, *half_cos_sin(pos)))


def caches(num_blocks=4, dtype=BF16):
    return (torch.zeros(num_blocks, BS, 1, 64, dtype=dtype),
            torch.zeros(num_blocks, BS, 1, 512, dtype=dtype))


def test_kv_rmsnorm_rope_cache_norms_ropes_and_scatters_skipping_padding():
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(3, 1, 1, 576, generator=g).to(BF16)
    gamma = (torch.rand(512, generator=g) + 0.5).to(BF16)
    pos = torch.tensor([5, 9, 0])
    cos, sin = half_cos_sin(pos)
    k_cache, ckv_cache = caches()
    slots = torch.tensor([20, 3, -1])  # the third token is padding: it writes nothing
    k_out, ckv_out, k_rope, c_kv = torch_npu.npu_kv_rmsnorm_rope_cache(
        kv, gamma, cos, sin, slots, k_cache, ckv_cache, epsilon=1e-6, cache_mode="PA",
        is_output_kv=True)
    assert k_out is k_cache and ckv_out is ckv_cache  # the caches, updated in place
    latent = kv.float()[:, 0, 0, :512]
    normed = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma.float()
    roped = interleaved_rope_reference(kv.float()[:, 0, 0, 512:], pos)
    torch.testing.assert_close(c_kv.float().view(3, 512), normed, atol=0.05, rtol=0.02)
    torch.testing.assert_close(k_rope.float().view(3, 64), roped, atol=0.03, rtol=0.02)
    flat_c, flat_k = ckv_cache.view(-1, 512), k_cache.view(-1, 64)
    torch.testing.assert_close(flat_c[[20, 3]], c_kv.view(3, 512)[:2])
    torch.testing.assert_close(flat_k[[20, 3]], k_rope.view(3, 64)[:2])
    written = torch.zeros(flat_c.shape[0], dtype=torch.bool)
    written[[20, 3]] = True
    assert not flat_c[~written].any() and not flat_k[~written].any()


@pytest.mark.parametrize("change,message", [
    (dict(kv=torch.zeros(2, 1, 1, 640)), r"hidden_size 512 \+ 64 only"),
    (dict(index=torch.tensor([0, 1], dtype=torch.int32)), "int64 tensor"),
    (dict(cache_mode="Norm"), "cache_mode 'Norm' is not simulated"),
    (dict(index=torch.tensor([0, 64])), r"index 64 is out of range \[0, 63\]"),
    (dict(gamma=torch.ones(512)), "share one dtype"),
])
def test_kv_rmsnorm_rope_cache_contract(change, message):
    k_cache, ckv_cache = caches()
    cos, sin = half_cos_sin(torch.tensor([0, 1]))
    args = dict(kv=torch.zeros(2, 1, 1, 576), gamma=torch.ones(512), cos=cos, sin=sin,
                index=torch.tensor([0, 1]), k_cache=k_cache, ckv_cache=ckv_cache,
                cache_mode="PA")
    args["kv"], args["gamma"] = args["kv"].to(BF16), args["gamma"].to(BF16)
    args.update({k: (v.to(BF16) if k == "kv" else v) for k, v in change.items()})
    with pytest.raises(AscendOpError, match=message):
        torch_npu.npu_kv_rmsnorm_rope_cache(**args)


def test_transpose_batchmatmul_is_a_batched_matmul_returned_batch_second():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 3, 512, generator=g).to(BF16), torch.randn(4, 512, 16, generator=g)
    out = torch_npu.npu_transpose_batchmatmul(x, w.to(BF16), perm_y=(1, 0, 2))
    assert out.shape == (3, 4, 16)
    torch.testing.assert_close(out.float(), torch.bmm(x.float(), w.to(BF16).float())
                               .transpose(0, 1), atol=0.3, rtol=0.02)
    with pytest.raises(AscendOpError, match=r"perm_y \[1, 0, 2\]"):
        torch_npu.npu_transpose_batchmatmul(x, w.to(BF16), perm_y=(0, 1, 2))


class Latent:
    """A paged latent cache and a batch of MLA queries, as the MLA backend passes them."""

    def __init__(self, kv_lens, q_lens=None, heads=4, seed=3):
        g = torch.Generator().manual_seed(seed)
        self.kv_lens, self.heads = kv_lens, heads
        self.q_lens = q_lens or [1] * len(kv_lens)
        per_req = max(-(-kv // BS) for kv in kv_lens)
        num_blocks = len(kv_lens) * per_req + 1
        self.nope = torch.randn(num_blocks, 1, BS, 512, generator=g).to(BF16)
        self.rope = torch.randn(num_blocks, 1, BS, 64, generator=g).to(BF16)
        # request r holds blocks 1 + r * per_req ... (block 0 unused, as vLLM's null block)
        self.table = (1 + torch.arange(len(kv_lens))[:, None] * per_req
                      + torch.arange(per_req)).to(torch.int32)
        t = sum(self.q_lens)
        self.q = torch.randn(t, heads, 512, generator=g).to(BF16) / 8
        self.q_rope = torch.randn(t, heads, 64, generator=g).to(BF16) / 8

    def args(self, kv_lens=None, tnd=False):
        kv_lens = kv_lens or self.kv_lens
        if tnd:
            q, qr = self.q, self.q_rope
            cu = torch.tensor(self.q_lens).cumsum(0).tolist()
            extra = dict(input_layout="TND_NTD", sparse_mode=3, atten_mask=MASK,
                         actual_seq_qlen=cu)
        else:
            q, qr = self.q.unsqueeze(2), self.q_rope.unsqueeze(2)
            extra = dict(input_layout="BNSD_NBSD", sparse_mode=0)
        return (q, self.nope, self.nope), dict(
            query_rope=qr, key_rope=self.rope, num_query_heads=self.heads,
            num_key_value_heads=1, softmax_scale=0.1, block_table=self.table, block_size=BS,
            actual_seq_kvlen=list(kv_lens), **extra)

    def reference(self, kv_lens=None):
        """[N, T, 512]: each query token over its request's latent tokens (causal)."""
        kv_lens = kv_lens or self.kv_lens
        outs, start = [], 0
        for r, (ql, kl) in enumerate(zip(self.q_lens, kv_lens)):
            blocks = self.table[r].long()
            c = self.nope[blocks].reshape(-1, 512)[:kl].float()
            p = self.rope[blocks].reshape(-1, 64)[:kl].float()
            q, qr = self.q[start:start + ql].float(), self.q_rope[start:start + ql].float()
            s = (torch.einsum("tnd,sd->nts", q, c) + torch.einsum("tnd,sd->nts", qr, p)) * 0.1
            allowed = torch.arange(kl)[None, :] <= (kl - ql + torch.arange(ql))[:, None]
            s = s.masked_fill(~allowed[None], float("-inf"))
            outs.append(torch.einsum("nts,sd->ntd", s.softmax(-1), c))
            start += ql
        return torch.cat(outs, 1)


def test_fia_v2_decodes_on_the_latent_cache_in_bnsd():
    case = Latent([5, 33, 16])
    inputs, kwargs = case.args()
    out, _ = torch_npu.npu_fused_infer_attention_score_v2(*inputs, **kwargs)
    assert out.shape == (4, 3, 1, 512)  # NBSD
    torch.testing.assert_close(out.float().view(4, 3, 512), case.reference(), atol=0.03,
                               rtol=0.03)


def test_fia_v2_verifies_several_tokens_per_request_causally_in_tnd():
    case = Latent([7, 20], q_lens=[3, 3])
    inputs, kwargs = case.args(tnd=True)
    out, _ = torch_npu.npu_fused_infer_attention_score_v2(*inputs, **kwargs)
    assert out.shape == (4, 6, 512)  # NTD
    torch.testing.assert_close(out.float(), case.reference(), atol=0.03, rtol=0.03)


@pytest.mark.parametrize("change,message", [
    (dict(num_query_heads=3), r"must equal query's N\(4\) and be one of"),
    (dict(num_key_value_heads=4), r"numKeyValueHeads\(4\) must be 1"),
    (dict(actual_seq_kvlen=[5, 33]), r"size\(2\) of actualSeqLengthsKv is not equal to the "
     r"batchSize\(3\)"),
    (dict(query_rope=None), "query_rope and key_rope are given together"),
    (dict(learnable_sink=torch.zeros(4, dtype=torch.bfloat16)), "not simulated on the MLA path"),
    (dict(pre_tokens=5, next_tokens=0), "not simulated on the MLA path"),
    (dict(sparse_mode=3), "sparse_mode 0"),
    (dict(actual_seq_kvlen=[5, 33, 64]), r"block table shape should be \[3, >=4\]"),
])
def test_fia_v2_contract(change, message):
    case = Latent([5, 33, 16])
    inputs, kwargs = case.args()
    kwargs.update(change)
    with pytest.raises(AscendOpError, match=message):
        torch_npu.npu_fused_infer_attention_score_v2(*inputs, **kwargs)


def test_fia_v2_takes_at_most_16_query_tokens_per_request_in_tnd():
    case = Latent([40], q_lens=[17])
    inputs, kwargs = case.args(tnd=True)
    with pytest.raises(AscendOpError, match="at most 16"):
        torch_npu.npu_fused_infer_attention_score_v2(*inputs, **kwargs)


def test_fia_v1_takes_mla_prefill_heads_192_and_128_in_bfloat16_only():
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(5, 2, 192, generator=g), torch.randn(5, 2, 192, generator=g)
    v = torch.randn(5, 2, 128, generator=g)
    kwargs = dict(num_heads=2, num_key_value_heads=2, input_layout="TND", atten_mask=MASK,
                  sparse_mode=3, scale=0.1, actual_seq_lengths=[2, 5],
                  actual_seq_lengths_kv=[2, 5])
    out, _ = torch_npu.npu_fused_infer_attention_score(q.to(BF16), k.to(BF16), v.to(BF16),
                                                       **kwargs)
    assert out.shape == (5, 2, 128)
    with pytest.raises(AscendOpError, match="bfloat16 only"):
        torch_npu.npu_fused_infer_attention_score(q.half(), k.half(), v.half(), **kwargs)
    with pytest.raises(AscendOpError, match="valueD"):
        torch_npu.npu_fused_infer_attention_score(q.to(BF16), k.to(BF16),
                                                  v[..., :64].contiguous().to(BF16), **kwargs)


def _prefill_inputs(seed, q_lens, kv_lens, heads=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), heads, 192, generator=g).to(BF16)
    k = torch.randn(sum(kv_lens), heads, 192, generator=g).to(BF16)
    v = torch.randn(sum(kv_lens), heads, 128, generator=g).to(BF16)
    return q, k, v


def _cu(lens):
    return torch.tensor(lens).cumsum(0).tolist()


def test_fia_v1_softmax_lse_is_each_rows_log_sum_exp_in_tnd():
    """softmax_lse_flag: float32 [T, N, 1], the log-sum-exp of the row's scaled scores over the
    keys it attends to (causal from the bottom right in mode 3, all of them in mode 0); the
    output is the same with the flag on or off."""
    q_lens, kv_lens, scale = [3, 2], [5, 2], 0.07
    q, k, v = _prefill_inputs(5, q_lens, kv_lens)
    for mode, mask in ((3, MASK), (0, None)):
        if mode == 0:
            kv_lens = [4, 6]
            q, k, v = _prefill_inputs(6, q_lens, kv_lens)
        kwargs = dict(num_heads=2, num_key_value_heads=2, input_layout="TND", atten_mask=mask,
                      sparse_mode=mode, scale=scale, actual_seq_lengths=_cu(q_lens),
                      actual_seq_lengths_kv=_cu(kv_lens))
        out, lse = torch_npu.npu_fused_infer_attention_score(q, k, v, softmax_lse_flag=True,
                                                             **kwargs)
        plain, _ = torch_npu.npu_fused_infer_attention_score(q, k, v, **kwargs)
        assert lse.shape == (5, 2, 1) and lse.dtype == torch.float32
        assert torch.equal(out, plain)
        q0 = k0 = 0
        for ql, kl in zip(q_lens, kv_lens):
            scores = torch.einsum("qnd,knd->nqk", q[q0:q0 + ql].float(),
                                  k[k0:k0 + kl].float()) * scale
            if mode == 3:
                scores += torch.full((ql, kl), float("-inf")).triu(kl - ql + 1)
            expected = torch.logsumexp(scores, -1).t()
            torch.testing.assert_close(lse[q0:q0 + ql, :, 0], expected, rtol=1e-5, atol=1e-5)
            q0, k0 = q0 + ql, k0 + kl


def test_fia_v1_softmax_lse_contract():
    q, k, v = _prefill_inputs(7, [2, 2], [2, 2])
    kwargs = dict(num_heads=2, num_key_value_heads=2, input_layout="TND", atten_mask=None,
                  sparse_mode=0, scale=0.1, actual_seq_lengths=[2, 4], softmax_lse_flag=True)
    with pytest.raises(AscendOpError, match="actualSeqLengthsKv 0: its LSE is not defined"):
        torch_npu.npu_fused_infer_attention_score(q, k[:2], v[:2], actual_seq_lengths_kv=[2, 2],
                                                  **kwargs)
    with pytest.raises(AscendOpError, match="without paging and in sparse_mode 0 or 3 only"):
        torch_npu.npu_fused_infer_attention_score(
            q, k, v, actual_seq_lengths_kv=[2, 4], **dict(kwargs, sparse_mode=4,
                                                          atten_mask=MASK))


def test_attention_update_merges_partial_results_by_their_lse():
    """aclnnAttentionUpdate's formula: O = sum_i O_i exp(lse_i - lse_m), lse_m = log sum_i
    exp(lse_i); update_type 1 returns lse_m. Merging a causal attention over the new tokens with
    mode-0 attention over the context, chunk by chunk, gives the attention over the whole
    sequence (the Ascend MLA prefill)."""
    ctx, new, scale = 7, 4, 0.08
    q, k, v = _prefill_inputs(8, [new], [ctx + new])
    common = dict(num_heads=2, num_key_value_heads=2, input_layout="TND", scale=scale)
    whole, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, v, atten_mask=MASK, sparse_mode=3, actual_seq_lengths=[new],
        actual_seq_lengths_kv=[ctx + new], **common)
    out, lse = torch_npu.npu_fused_infer_attention_score(
        q, k[ctx:], v[ctx:], atten_mask=MASK, sparse_mode=3, actual_seq_lengths=[new],
        actual_seq_lengths_kv=[new], softmax_lse_flag=True, **common)
    out, lse = out.float().view(-1, 128), lse.view(-1)
    for lo, hi in ((0, 4), (4, 7)):
        part, part_lse = torch_npu.npu_fused_infer_attention_score(
            q, k[lo:hi], v[lo:hi], atten_mask=None, sparse_mode=0, actual_seq_lengths=[new],
            actual_seq_lengths_kv=[hi - lo], softmax_lse_flag=True, **common)
        out, lse = torch_npu.npu_attention_update((lse, part_lse.view(-1)),
                                                  (out, part.float().view(-1, 128)), 1)
    torch.testing.assert_close(out.view(new, 2, 128).to(BF16), whole, rtol=0.02, atol=0.02)
    merged, none = torch_npu.npu_attention_update((lse, lse), (out, out), 0)
    assert none.numel() == 0
    torch.testing.assert_close(merged, out)  # two equal halves: the same result


@pytest.mark.parametrize("change, message", [
    (lambda l, o: ([x.double() for x in l], o), r"lse\[0\] must be float32"),
    (lambda l, o: (l, [x[:, :6].contiguous() for x in o]), "multiple of 8"),
    (lambda l, o: (l, [x.t().contiguous().t() for x in o]), "must be contiguous"),
    (lambda l, o: (l * 9, o * 9), r"sp in \[1, 16\]"),
    (lambda l, o: (l, [o[0], o[1].half()]), "float32, float16 or bfloat16"),
    (lambda l, o: (l, [o[0], o[1][:5]]), r"localOut\[1\] must be \[6, 16\]"),
])
def test_attention_update_contract(change, message):
    lse, out = change([torch.zeros(6)] * 2, [torch.zeros(6, 16)] * 2)
    with pytest.raises(AscendOpError, match=message):
        torch_npu.npu_attention_update(lse, out, 1)
    with pytest.raises(AscendOpError, match="updateType must be 0 or 1"):
        torch_npu.npu_attention_update([torch.zeros(6)] * 2, [torch.zeros(6, 16)] * 2, 2)


def test_fia_v2_in_a_graph_replays_each_steps_lengths_after_its_task_update():
    """The MLA backend's FULL-graph protocol (attention/mla.py): the .out call in a task group
    after an ExternalEvent wait; each step re-issues the KV lengths on the update stream."""
    case = Latent([5, 9])
    inputs, kwargs = case.args()
    with torch.inference_mode():
        graph, update_stream = npu.NPUGraph(), npu.Stream()
        with npu.graph(graph):
            ws = torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace(*inputs,
                                                                                **kwargs)
            out, lse = torch.empty(4, 2, 1, 512, dtype=BF16), torch.empty(1, dtype=BF16)
            stream = npu.current_stream()
            event = npu.ExternalEvent()
            event.wait(stream)
            event.reset(stream)
            npu.graph_task_group_begin(stream)
            torch_npu.npu_fused_infer_attention_score_v2.out(*inputs, **kwargs, workspace=ws,
                                                             out=[out, lse])
            handle = npu.graph_task_group_end(stream)
        for kv_lens in ([6, 10], [16, 3]):
            graph.replay()
            with npu.stream(update_stream):
                npu.graph_task_update_begin(update_stream, handle)
                torch_npu.npu_fused_infer_attention_score_v2.out(
                    *inputs, **dict(kwargs, actual_seq_kvlen=kv_lens), workspace=ws,
                    out=[out, lse])
                npu.graph_task_update_end(update_stream)
                event.record(update_stream)
            npu.synchronize()
            torch.testing.assert_close(out.float().view(4, 2, 512), case.reference(kv_lens),
                                       atol=0.03, rtol=0.03)
