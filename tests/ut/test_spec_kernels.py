"""The torch versions of vLLM's speculative-decoding Triton kernels against per-request loops
written from the kernels' own code (vllm/v1/sample/rejection_sampler.py, spec_decode/utils.py)."""

import pytest
import torch

from vllm_ascend.worker import spec_kernels as k

VOCAB = 11


def batch(seed, max_spec=4, num_reqs=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_spec + 1, (num_reqs,), generator=g)
    cu = torch.cumsum(lengths, 0).to(torch.int32)
    n = int(cu[-1])
    draft = torch.randint(0, 4, (n,), generator=g).to(torch.int32)  # small range: many matches
    if n:
        draft[torch.randint(0, n, (1,), generator=g)] = -1  # a padded draft position
    return g, lengths.tolist(), cu, draft


def loop_write(out, lengths, starts, row_ok, accept, token, bonus):
    for r, n in enumerate(lengths):
        if not row_ok(r):
            continue
        rejected = False
        for p in range(n):
            if rejected:
                break
            t = starts[r] + p
            ok = accept(t, p)
            out[r, p] = token(t, ok)
            rejected = not ok
        if not rejected:
            out[r, n] = bonus[r]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("all_greedy", [True, False])
def test_rejection_greedy(seed, all_greedy):
    g, lengths, cu, draft = batch(seed)
    target = torch.randint(0, 4, draft.shape, generator=g)
    bonus = torch.randint(0, VOCAB, (len(lengths), 1), generator=g)
    is_greedy = None if all_greedy else torch.rand(len(lengths), generator=g) < 0.5
    out = torch.full((len(lengths), 5), -1, dtype=torch.int32)
    ref = out.clone()
    k.rejection_greedy_sample(out, cu, draft, target, bonus, is_greedy, 4, None, None, False)
    starts = [int(c) - n for c, n in zip(cu, lengths)]
    loop_write(ref, lengths, starts, lambda r: is_greedy is None or bool(is_greedy[r]),
               lambda t, p: int(draft[t]) == int(target[t]), lambda t, ok: int(target[t]),
               bonus.view(-1).tolist())
    assert torch.equal(out, ref)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_rejection_random(seed, with_draft_probs):
    g, lengths, cu, draft = batch(seed)
    n = draft.shape[0]
    target_probs = torch.rand(n, VOCAB, generator=g).softmax(-1)
    draft_probs = torch.rand(n, VOCAB, generator=g).softmax(-1) if with_draft_probs else None
    uniform = torch.rand(n, generator=g, dtype=torch.float64) * 0.2
    recovered = torch.randint(0, VOCAB, (n,), generator=g).to(torch.int32)
    bonus = torch.randint(0, VOCAB, (len(lengths), 1), generator=g)
    is_greedy = torch.rand(len(lengths), generator=g) < 0.3
    out = torch.full((len(lengths), 5), -1, dtype=torch.int32)
    ref = out.clone()
    k.rejection_random_sample(out, cu, draft, draft_probs, target_probs, bonus, recovered,
                              uniform, is_greedy, 4, VOCAB, None, draft_probs is None, False)

    def accept(t, p):
        d = int(draft[t])
        if d < 0:
            return False
        dp = 1.0 if draft_probs is None else float(draft_probs[t, d])
        return dp > 0 and float(target_probs[t, d]) / dp >= float(uniform[t])

    starts = [int(c) - m for c, m in zip(cu, lengths)]
    loop_write(ref, lengths, starts, lambda r: not bool(is_greedy[r]), accept,
               lambda t, ok: int(draft[t]) if ok else int(recovered[t]), bonus.view(-1).tolist())
    assert torch.equal(out, ref)


def test_expand():
    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)
    x = torch.tensor([0.5, 0.0, 0.75, 0.0])
    out = torch.full((6,), -9.0)
    k.expand(out, x, cu, 0, 1, 32)
    assert out.tolist() == [0.5, 0.5, 0.75, 0.75, 0.75, 1.0]  # 0 -> 1, the empty row skipped


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_sample_recovered_tokens(with_draft_probs):
    g, lengths, cu, draft = batch(3)
    draft = draft.clamp_min(0)
    n = draft.shape[0]
    target = torch.rand(n, VOCAB, generator=g).softmax(-1)
    dprobs = torch.rand(n, VOCAB, generator=g).softmax(-1) if with_draft_probs else None
    inv_q = torch.rand(len(lengths), VOCAB, generator=g) + 0.1
    out = torch.empty_like(draft)
    k.sample_recovered_tokens(out, cu, draft, dprobs, target, inv_q, VOCAB, 8, dprobs is None, False)
    req = [r for r, m in enumerate(lengths) for _ in range(m)]
    for t in range(n):
        prob = target[t].clone()
        if dprobs is None:
            prob[int(draft[t])] = 0
        else:
            prob = (prob - dprobs[t]).clamp_min(0)
        assert int(out[t]) == int((prob * inv_q[req[t]]).argmax())


def test_eagle_step_slot_mapping():
    block_table = torch.tensor([[3, 4], [7, 8]], dtype=torch.int32)
    positions = torch.tensor([5, 15], dtype=torch.int64)  # block size 8, max_model_len 16
    seq_lens = torch.tensor([6, 16], dtype=torch.int32)
    clamped = torch.empty(2, dtype=torch.int64)
    slots = torch.full((4,), 99, dtype=torch.int32)  # 2 requests padded to 4 for a graph
    k.eagle_step_slot_mapping_metadata(positions, block_table, 2, seq_lens, clamped, slots,
                                       8, 16, 2, -1, 2)
    assert clamped.tolist() == [6, 0]  # 16 is past max_model_len: position 0, no slot
    assert slots.tolist() == [3 * 8 + 6, -1, -1, -1]
    assert seq_lens.tolist() == [7, 1]


def test_eagle_prepare_inputs_padded():
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # drafts 2, 0, 3
    valid = torch.tensor([1, 1, 4], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    idx, rej = torch.empty(3, dtype=torch.int32), torch.empty(3, dtype=torch.int32)
    k.eagle_prepare_inputs_padded(cu, valid, qsl, idx, rej, 3)
    assert rej.tolist() == [2, 0, 0]
    assert idx.tolist() == [0, 3, 7]


def test_eagle_prepare_next_token_padded():
    sampled = torch.tensor([[5, -1, -1], [6, 7, 8], [-1, -1, -1], [1, 2, 3]], dtype=torch.int32)
    discard = torch.tensor([False, False, False, True])
    backup = torch.tensor([40, 41, 42, 43], dtype=torch.int32)
    nxt, count = torch.empty(4, dtype=torch.int32), torch.empty(4, dtype=torch.int32)
    k.eagle_prepare_next_token_padded(sampled, discard, backup, nxt, count, 100, 3, 4, 3, 4)
    assert nxt.tolist() == [5, 8, 42, 43]
    assert count.tolist() == [1, 3, 0, 0]


@pytest.mark.parametrize("shift", [False, True])
def test_copy_and_expand_eagle_inputs(shift):
    # Two requests: 3 input tokens (1 rejected) and 2 (none rejected); one extra slot each.
    target_ids = torch.tensor([10, 11, 12, 20, 21], dtype=torch.int32)
    target_pos = torch.tensor([4, 5, 6, 8, 9], dtype=torch.int64)
    nxt = torch.tensor([13, 22], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    qend = torch.tensor([1, 4], dtype=torch.int32)  # last valid input token per request
    total_out = 5 + 2 * (0 if shift else 1)
    ids = torch.full((8,), -7, dtype=torch.int32)
    pos = torch.full((8,), -7, dtype=torch.int64)
    rejected, masked = torch.zeros(8, dtype=torch.bool), torch.zeros(8, dtype=torch.bool)
    new_idx = torch.full((2,), -7, dtype=torch.int32)
    hmap = torch.full((5,), -7, dtype=torch.int32)
    k.copy_and_expand_eagle_inputs(target_ids, target_pos, nxt, ids, pos, rejected, masked,
                                   new_idx, hmap, qsl, qend, 0, 99, 5, 1, shift, 16)
    if not shift:  # request 0: 10 11 | 13 | rejected; request 1: 20 21 | 22
        assert ids[:total_out].tolist() == [10, 11, 13, 0, 20, 21, 22]
        assert pos[:total_out].tolist() == [4, 5, 6, 0, 8, 9, 10]
        assert rejected[:total_out].tolist() == [False, False, False, True, False, False, False]
        assert new_idx.tolist() == [2, 6]
    else:  # shifted by one: request 0: 11 | 13 | rejected; request 1: 21 | 22
        assert ids[:total_out].tolist() == [11, 13, 0, 21, 22]
        assert pos[:total_out].tolist() == [4, 5, 0, 8, 9]
        assert new_idx.tolist() == [1, 4]
        assert hmap.tolist() == [0, 1, 2, 3, 4]
    assert not masked.any()
