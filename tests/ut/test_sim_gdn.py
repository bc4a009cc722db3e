"""The simulator's Gated DeltaNet operators (torch_npu.npu_chunk_gated_delta_rule and
npu_recurrent_gated_delta_rule): by value against transformers' reference implementations of
Qwen3-Next's delta rule (its chunked and its token-by-token forms, in float32), their state
indexing (a pool of slots, per-token writes, speculative starts), their graph behaviour, and each
documented limit refused with the chip's code."""

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from tests.ut.conftest import capture
from vllm_ascend.device import sim as torch_npu
from vllm_ascend.device.sim.errors import PARAM_INVALID, TILING_ERROR, AscendOpError

BF16 = torch.bfloat16
NK, NV, D = 2, 4, 32  # key heads, value heads (two per key head), head dim
# Worst |sim - HF fp32| over the outputs and final states of the chunk test, seeds 0-4: 0.0037
# (the states' bfloat16 rounding; outputs of at most 0.27); the bound leaves twice that.
TOL = 8e-3


def inputs(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(t, NK, D, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, NK, D, generator=g), dim=-1)
    v = torch.randn(t, NV, D, generator=g)
    beta = torch.rand(t, NV, generator=g)
    decay = -torch.rand(t, NV, generator=g) * 0.5
    return q.to(BF16), k.to(BF16), v.to(BF16), beta.to(BF16), decay


def hf_rule(q, k, v, beta, decay, state, chunked):
    """transformers' Qwen3-Next delta rule on one sequence: its state is [Nv, Dk, Dv], ours
    [Nv, Dv, Dk]; it takes the key heads repeated per value head, as its layer does."""
    fn = hf.torch_chunk_gated_delta_rule if chunked else hf.torch_recurrent_gated_delta_rule
    rep = NV // NK
    out, final = fn(q.float().repeat_interleave(rep, 1)[None], k.float().repeat_interleave(
        rep, 1)[None], v.float()[None], decay[None], beta.float()[None],
                    initial_state=state.float().transpose(-1, -2)[None], output_final_state=True)
    return out[0], final[0].transpose(-1, -2)


@pytest.mark.parametrize("seed", range(3))
def test_chunk_matches_transformers_chunked_and_recurrent_forms(seed):
    lens = [70, 5, 1]  # across a chunk of 64, short, one token
    q, k, v, beta, decay = inputs(sum(lens), seed)
    state = (torch.randn(len(lens), NV, D, D, generator=torch.Generator().manual_seed(seed))
             * 0.1).to(BF16)
    out, final = torch_npu.npu_chunk_gated_delta_rule(
        q, k, v, beta=beta, initial_state=state, scale=D ** -0.5, g=decay,
        actual_seq_lengths=torch.tensor(lens, dtype=torch.int32))
    assert out.dtype == BF16 and final.dtype == BF16 and final.shape == state.shape
    start = 0
    for i, n in enumerate(lens):
        part = slice(start, start + n)
        for chunked in (True, False):
            ref_out, ref_state = hf_rule(q[part], k[part], v[part], beta[part], decay[part],
                                         state[i], chunked)
            torch.testing.assert_close(out[part].float(), ref_out, atol=TOL, rtol=0)
            torch.testing.assert_close(final[i].float(), ref_state, atol=TOL, rtol=0)
        start += n


def test_a_sequences_result_does_not_depend_on_its_batch():
    q, k, v, beta, decay = inputs(12)
    state = torch.zeros(2, NV, D, D, dtype=BF16)
    both, _ = torch_npu.npu_chunk_gated_delta_rule(
        q, k, v, beta=beta, initial_state=state, scale=0.2, g=decay,
        actual_seq_lengths=torch.tensor([7, 5], dtype=torch.int32))
    alone, _ = torch_npu.npu_chunk_gated_delta_rule(
        q[7:], k[7:], v[7:], beta=beta[7:], initial_state=state[1:], scale=0.2, g=decay[7:],
        actual_seq_lengths=torch.tensor([5], dtype=torch.int32))
    assert torch.equal(both[7:], alone)


def decode(q, k, v, beta, decay, pool, slots, lens=None, accepted=None):
    as_i32 = (lambda x: None if x is None else torch.tensor(x, dtype=torch.int32))
    return torch_npu.npu_recurrent_gated_delta_rule(
        q, k, v, pool, beta=beta, scale=D ** -0.5, g=decay, actual_seq_lengths=as_i32(lens),
        ssm_state_indices=as_i32(slots), num_accepted_tokens=as_i32(accepted))


def test_recurrent_steps_each_sequence_in_its_slot_and_leaves_the_others():
    q, k, v, beta, decay = inputs(3, seed=7)
    pool = (torch.randn(6, NV, D, D) * 0.1).to(BF16)
    before = pool.clone()
    slots = [4, 1, 2]
    out = decode(q, k, v, beta, decay, pool, slots, lens=[1, 1, 1])
    for j, slot in enumerate(slots):
        ref_out, ref_state = hf_rule(q[j:j + 1], k[j:j + 1], v[j:j + 1], beta[j:j + 1],
                                     decay[j:j + 1], before[slot], chunked=False)
        torch.testing.assert_close(out[j:j + 1].float(), ref_out, atol=TOL, rtol=0)
        torch.testing.assert_close(pool[slot].float(), ref_state, atol=TOL, rtol=0)
    for untouched in (0, 3, 5):
        assert torch.equal(pool[untouched], before[untouched])


def test_recurrent_speculative_tokens_start_from_the_last_accepted_and_write_every_slot():
    # One sequence of 3 tokens (a verified token and 2 drafts), 2 accepted last step: it starts
    # from the state its second token's slot holds, and writes each token's state to its slot.
    q, k, v, beta, decay = inputs(3, seed=3)
    pool = (torch.randn(5, NV, D, D) * 0.1).to(BF16)
    before = pool.clone()
    out = decode(q, k, v, beta, decay, pool, [0, 3, 1], lens=[3], accepted=[2])
    state = before[3]
    for j, slot in enumerate([0, 3, 1]):
        ref_out, state = hf_rule(q[j:j + 1], k[j:j + 1], v[j:j + 1], beta[j:j + 1],
                                 decay[j:j + 1], state, chunked=False)
        torch.testing.assert_close(out[j:j + 1].float(), ref_out, atol=TOL, rtol=0)
        torch.testing.assert_close(pool[slot].float(), state, atol=TOL, rtol=0)
        state = pool[slot]  # the kernel carries its float32 state; the reference, the written
    assert torch.equal(pool[2], before[2]) and torch.equal(pool[4], before[4])


def test_a_captured_step_runs_at_replay_with_the_indices_of_that_moment():
    q, k, v, beta, decay = inputs(2, seed=5)
    pool = (torch.randn(4, NV, D, D) * 0.1).to(BF16)
    slots = torch.tensor([1, 2], dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with torch.inference_mode():
        before = pool.clone()
        graph, out = capture(lambda: torch_npu.npu_recurrent_gated_delta_rule(
            q, k, v, pool, beta=beta, scale=D ** -0.5, g=decay, actual_seq_lengths=lens,
            ssm_state_indices=slots))
        assert torch.equal(pool, before)  # a capture runs nothing
        slots.copy_(torch.tensor([3, 0], dtype=torch.int32))  # the next step's requests
        graph.replay()
    expected = before.clone()
    eager = decode(q, k, v, beta, decay, expected, [3, 0], lens=[1, 1])
    assert torch.equal(out, eager) and torch.equal(pool, expected)


def refused(fn, code, words):
    with pytest.raises(AscendOpError, match=words) as info:
        fn()
    assert info.value.code == code


def test_the_documented_limits_are_refused_with_the_chips_codes():
    q, k, v, beta, decay = inputs(4)
    state = torch.zeros(1, NV, D, D, dtype=BF16)
    lens = torch.tensor([4], dtype=torch.int32)

    def chunk(**kw):
        args = dict(query=q, key=k, value=v, beta=beta, initial_state=state,
                    actual_seq_lengths=lens, scale=0.1, g=decay) | kw
        return lambda: torch_npu.npu_chunk_gated_delta_rule(
            args.pop("query"), args.pop("key"), args.pop("value"), **args)

    refused(chunk(scale=None), PARAM_INVALID, "scale cannot be empty")
    refused(chunk(initial_state=None), PARAM_INVALID, "initial_state cannot be empty")
    refused(chunk(initial_state=state.float()), PARAM_INVALID, "Ascend 950 only")
    refused(chunk(query=q.float(), key=k.float()), PARAM_INVALID, "query must be bfloat16")
    refused(chunk(g=decay.to(BF16)), PARAM_INVALID, "g must be float32")
    refused(chunk(actual_seq_lengths=torch.tensor([3], dtype=torch.int32)), TILING_ERROR,
            "sum to T")
    refused(chunk(query=(q.float() * 2).to(BF16)), TILING_ERROR, "L2-normalised")
    refused(chunk(g=-decay), TILING_ERROR, "g must be <= 0")
    wide = torch.zeros(4, NK, 256, dtype=BF16)
    refused(chunk(query=wide, key=wide), TILING_ERROR, "Dk, Dv <= 128")
    odd = torch.zeros(4, 3, D, dtype=BF16)
    refused(chunk(value=odd, beta=torch.zeros(4, 3, dtype=BF16), g=torch.zeros(4, 3),
                  initial_state=torch.zeros(1, 3, D, D, dtype=BF16)), TILING_ERROR, "Nv % Nk")

    pool = torch.zeros(8, NV, D, D, dtype=BF16)
    q9, k9, v9, beta9, decay9 = inputs(9)
    refused(lambda: decode(q9, k9, v9, beta9, decay9, pool, list(range(9)), lens=[9]),
            TILING_ERROR, r"BlockNum \(8\) must be at least T")
    pool = torch.zeros(10, NV, D, D, dtype=BF16)
    refused(lambda: decode(q9, k9, v9, beta9, decay9, pool, list(range(9)), lens=[9]),
            TILING_ERROR, r"\[1, 8\]")
    refused(lambda: decode(q, k, v, beta, decay, pool, [0, 1, 2, 10], lens=[1, 1, 1, 1]),
            TILING_ERROR, "ssm_state_indices")
    refused(lambda: decode(q, k, v, beta, decay, pool, [0, 1, 2, 3], lens=[2, 2],
                           accepted=[3, 1]), TILING_ERROR, "num_accepted_tokens")
    refused(lambda: decode(q, k, v, beta, decay, pool.float(), [0, 1, 2, 3]), PARAM_INVALID,
            "state must be bfloat16")
