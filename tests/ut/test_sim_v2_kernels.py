"""The simulator's torch versions of Model Runner V2's Triton kernels (device/sim/v2_kernels.py),
called through vLLM's own V2 wrappers after the platform registers them, against what the
kernels' code does (vllm/v1/worker/gpu/): Gumbel-max sampling (its murmur3 noise against a
per-value transcription of the kernel's hash; argmax at temperature 0; seeded, so a draft and its
verification agree; the softmax distribution at temperature 1), block tables and slot mappings
(staged writes, padding rows zeroed, dummy requests and graph padding writing nothing), and the
ledger counting each kernel as one launch; the sampling parameters' kernels (min_p, penalties
with their bit mask and counts, allowed tokens, logit bias, min_tokens, bad words) against their
formulas."""

import math

import pytest
import torch

from vllm_ascend.device.sim import ledger, v2_kernels, v2_sampling

M32 = 0xFFFFFFFF


@pytest.fixture(scope="module", autouse=True)
def registered():
    from vllm_ascend import patch
    from vllm_ascend.platform import NPUPlatform

    patch.apply()  # (as in every vLLM process: triton.next_power_of_2 for the wrappers)
    NPUPlatform.register_triton_kernel_overrides()


def rotl(x, s):
    return ((x << s) | (x >> (32 - s))) & M32


def mix(h, key):
    key = rotl((key * 0xCC9E2D51) & M32, 15) * 0x1B873593 & M32
    h = rotl(h ^ key, 13)
    return (h * 5 + 0xE6546B64) & M32


def murmur3_reference(seed: int, pos: int, offset: int, domain: int = 0) -> int:
    """vLLM's murmur3_hash32 (sample/gumbel.py), one value at a time in Python's integers."""
    h = domain
    for key in (seed & M32, (seed >> 32) & M32, pos & M32, offset & M32):
        h = mix(h, key)
    h ^= 16
    h ^= h >> 16
    h = h * 0x85EBCA6B & M32
    h ^= h >> 13
    h = h * 0xC2B2AE35 & M32
    return h ^ (h >> 16)


def test_the_hash_is_the_kernels_bit_for_bit():
    seeds = [0, 1, 12345, 2**40 + 7, 2**63 - 1]
    positions = [0, 3, 511, (1 << 30) + 5]
    offsets = [0, 1, 1023, 49151]
    rows = [(s, p, o) for s in seeds for p in positions for o in offsets]
    seed, pos, off = (torch.tensor(col, dtype=torch.int64) for col in zip(*rows))
    for domain in (0, 0x9E3779B9):
        made = v2_sampling.murmur3_hash32(seed, pos, off, domain).tolist()
        assert made == [murmur3_reference(*row, domain) for row in rows]


def sample(logits, temperature, seed, pos):
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    n = logits.shape[0]
    return gumbel_sample(logits, torch.arange(n), torch.tensor(temperature),
                         torch.tensor(seed, dtype=torch.int64), torch.tensor(pos),
                         apply_temperature=True, is_drafting=False)


def test_temperature_zero_is_argmax_across_the_vocabulary_blocks():
    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(0))
    logits[2, 2999] = 50.0  # in the last, partial block of 1024
    assert sample(logits, [0.0] * 5, [7] * 5, [0] * 5).tolist() == logits.argmax(-1).tolist()


def test_a_draw_is_a_function_of_seed_position_and_token_only():
    logits = torch.zeros(4, 64)
    first = sample(logits, [1.0] * 4, [3, 3, 4, 4], [9, 9, 9, 10])
    assert first.tolist() == sample(logits, [1.0] * 4, [3, 3, 4, 4], [9, 9, 9, 10]).tolist()
    assert first[0] == first[1]  # same seed and position: same noise
    many = sample(torch.zeros(64, 64), [1.0] * 64, list(range(64)), [0] * 64)
    assert len(set(many.tolist())) > 32  # other seeds: other draws


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draws_follow_the_softmax_of_the_tempered_logits(temperature):
    """Gumbel-max: argmax(l / T + G) is distributed as softmax(l / T)."""
    vocab, draws = 6, 12000
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    picks = sample(row.expand(draws, vocab).contiguous(), [temperature] * draws, [42] * draws,
                   list(range(draws)))
    freq = torch.bincount(picks, minlength=vocab).double() / draws
    expected = torch.softmax(row.double() / temperature, 0)
    # 4 standard errors of a binomial proportion
    tolerance = 4 * torch.sqrt(expected * (1 - expected) / draws)
    assert ((freq - expected).abs() < tolerance).all(), (freq, expected)


def test_logprobs_and_ranks_of_the_chosen_tokens():
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

    logits = torch.randn(3, 2500, generator=torch.Generator().manual_seed(1))
    chosen = torch.tensor([5, 2400, 17])
    scores = compute_topk_scores(logits, 2, chosen)
    log_softmax = torch.log_softmax(logits, -1)
    assert torch.allclose(scores.logprobs[:, 0], log_softmax[torch.arange(3), chosen])
    top = logits.topk(2).indices
    assert scores.logprob_token_ids[:, 1:].tolist() == top.tolist()
    ranks = [(logits[i] >= logits[i, chosen[i]]).sum().item() for i in range(3)]
    assert scores.selected_token_ranks.tolist() == ranks


def block_tables(groups=1, block_size=4):
    from vllm.v1.worker.gpu.block_table import BlockTables

    tables = BlockTables([block_size] * groups, max_num_reqs=4, max_num_batched_tokens=16,
                         max_num_blocks_per_group=[6] * groups, device=torch.device("cpu"))
    tables.slot_mappings = torch.zeros_like(tables.slot_mappings, dtype=torch.int32)
    return tables


@pytest.mark.parametrize("groups", [1, 2])  # 2: the fused writer's pointer table
def test_staged_block_ids_land_in_their_rows_and_gather_zeroes_the_rest(groups):
    tables = block_tables(groups)
    tables.append_block_ids(2, tuple([7, 8] for _ in range(groups)), overwrite=True)
    tables.append_block_ids(0, tuple([3] for _ in range(groups)), overwrite=True)
    tables.apply_staged_writes()
    tables.append_block_ids(2, tuple([9] for _ in range(groups)), overwrite=False)
    tables.apply_staged_writes()
    for g in range(groups):
        assert tables.block_tables[g].gpu[2, :3].tolist() == [7, 8, 9]
        tables.input_block_tables[g].fill_(-5)  # stale rows of an earlier step
    gathered = tables.gather_block_tables(torch.tensor([2, 0]), num_reqs_padded=3)
    for g in range(groups):
        # a request's own blocks (the kernel copies num_blocks of them and leaves the rest)
        assert gathered[g][0, :4].tolist() == [7, 8, 9, -5]
        assert gathered[g][1, :2].tolist() == [3, -5]
        assert (tables.input_block_tables[g][2:] == 0).all()  # padding rows read block 0


def test_slot_mappings_of_real_dummy_and_padding_tokens():
    tables = block_tables()
    tables.append_block_ids(1, ([5, 6],), overwrite=True)
    tables.apply_staged_writes()
    # request state 1 (3 tokens at positions 2..4), then a dummy request (-1) of 2 tokens
    slots = tables.compute_slot_mappings(torch.tensor([1, -1]), torch.tensor([0, 3, 5]),
                                         torch.tensor([2, 3, 4, 0, 1]), num_tokens_padded=8)
    assert slots.tolist() == [[5 * 4 + 2, 5 * 4 + 3, 6 * 4 + 0, -1, -1, -1, -1, -1]]
    assert (tables.slot_mappings[0, 5:] == -1).all()  # up to the largest batch: graph padding


def test_each_kernel_is_one_launch_in_the_chip_cost_ledger():
    tables = block_tables()
    with ledger.Ledger() as counted:
        tables.compute_slot_mappings(torch.tensor([0]), torch.tensor([0, 2]),
                                     torch.tensor([0, 1]), num_tokens_padded=4)
    assert counted.counts[ledger.LAUNCHES] == 1 and counted.counts[ledger.SYNCS] == 0


def test_every_kernel_registered_is_one_of_vllms():
    import importlib

    for name in v2_kernels.KERNELS:
        module, attr = name.rsplit(".", 1)
        assert hasattr(importlib.import_module(module), attr), name
    assert len(v2_kernels.KERNELS) == 21


def test_min_p_masks_below_the_rows_max_times_min_p():
    from vllm.v1.worker.gpu.sample.min_p import apply_min_p

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    apply_min_p(logits, torch.tensor([0, 1]), torch.tensor([0.25, 0.0]))
    # kept: probabilities of at least 0.25 x the top one's 0.5
    assert torch.isinf(logits[0]).tolist() == [False, False, False, True]
    assert not torch.isinf(logits[1]).any()  # min_p 0: untouched


def test_penalties_from_the_prompt_the_output_and_the_steps_drafts():
    from vllm.v1.worker.gpu.sample.penalties import apply_penalties, bincount

    vocab = 40
    tokens = torch.zeros(2, 16, dtype=torch.int32)
    tokens[1, :6] = torch.tensor([3, 35, 3, 7, 7, 9])  # prompt 3, 35, 3; output 7, 7, 9
    mask = torch.zeros(2, -(-vocab // 32), dtype=torch.int32)
    counts = torch.zeros(2, vocab, dtype=torch.int32)
    bincount(torch.tensor([1]), tokens, torch.tensor([0, 3]), torch.tensor([0, 6]), mask,
             counts, 6)
    assert _bits(mask[1], vocab) == {3, 35}
    assert {i: int(c) for i, c in enumerate(counts[1]) if c} == {7: 2, 9: 1}
    logits = torch.linspace(-2, 2, vocab).repeat(2, 1)  # two rows of request 1: a draft step
    original = logits.clone()
    input_ids = torch.tensor([0, 11])  # row 1 sees the draft token 11 before it
    rep, freq, pres = 2.0, 0.5, 0.25
    apply_penalties(logits, torch.tensor([1, 1]), input_ids, torch.tensor([0, 1]),
                    torch.tensor([1.0, rep]), torch.tensor([0.0, freq]),
                    torch.tensor([0.0, pres]), mask, counts)
    for row, drafts in ((0, {}), (1, {11: 1})):
        seen = {7: 2, 9: 1, **drafts}
        for tok in range(vocab):
            x = float(original[row, tok])
            if tok in seen or tok in (3, 35):
                x = x / rep if x > 0 else x * rep
            x -= freq * seen.get(tok, 0) + pres * (tok in seen)
            assert math.isclose(float(logits[row, tok]), x, rel_tol=1e-6, abs_tol=1e-6), tok


def _bits(words, vocab):
    return {t for t in range(vocab) if (int(words[t // 32]) >> (t % 32)) & 1}


def test_allowed_tokens_logit_bias_and_min_tokens():
    from vllm.v1.worker.gpu.sample.logit_bias import apply_logit_bias

    logits = torch.arange(12, dtype=torch.float32).repeat(3, 1)
    ids = lambda *x: torch.tensor([list(x) + [0] * (3 - len(x))] * 3, dtype=torch.int32)  # noqa
    apply_logit_bias(
        logits, torch.tensor([0, 1, 2]), pos=torch.tensor([0, 0, 5]),
        num_allowed_token_ids=torch.tensor([2, 0, 0]), allowed_token_ids=ids(4, 9),
        num_logit_bias=torch.tensor([0, 1, 0]), logit_bias_token_ids=ids(2),
        logit_bias=torch.tensor([[0.0] * 3, [100.0, 0, 0], [0.0] * 3]),
        min_lens=torch.tensor([0, 3, 3]), num_stop_token_ids=torch.tensor([0, 1, 1]),
        restore_when_all_masked=torch.tensor([0, 0, 0]), stop_token_ids=ids(11))
    assert [i for i in range(12) if logits[0, i] > float("-inf")] == [4, 9]  # allowed only
    assert logits[1, 2] == 102.0 and logits[1, 11] == float("-inf")  # biased; before min_tokens
    assert logits[2, 11] == 11.0  # past min_tokens: the stop token is back


def test_a_bad_words_last_token_is_masked_after_its_prefix():
    from vllm.v1.worker.gpu.sample.bad_words import apply_bad_words

    all_ids = torch.zeros(1, 16, dtype=torch.int32)
    all_ids[0, :5] = torch.tensor([1, 2, 3, 4, 5])  # prompt 1, 2; output 3, 4, 5
    words = torch.tensor([[4, 5, 6, 9, 8]], dtype=torch.int32)  # "4 5 6", "9 8"
    offsets = torch.tensor([[0, 3, 5]], dtype=torch.int32)
    logits = torch.zeros(2, 10)
    apply_bad_words(logits, torch.tensor([0, 0]), words, offsets, torch.tensor([2]), all_ids,
                    torch.tensor([2]), torch.tensor([5]), torch.tensor([0, 9]),
                    torch.tensor([0, 1]), 2)
    assert logits[0].isinf().nonzero().flatten().tolist() == [6]  # output ends 4, 5
    assert logits[1].isinf().nonzero().flatten().tolist() == [8]  # the draft 9 ends it


def test_prompt_logprobs_read_each_positions_next_token():
    from vllm.v1.worker.gpu.sample.prompt_logprob import get_prompt_logprobs_token_ids

    all_ids = torch.arange(40, dtype=torch.int32).view(2, 20)
    ids = get_prompt_logprobs_token_ids(5, torch.tensor([0, 2, 5]), torch.tensor([1, 0]),
                                        torch.tensor([3, 10]), all_ids)
    # request state 1 (10 computed): tokens 11, 12; request state 0 (3 computed): 4, 5, 6
    assert ids.tolist() == [31, 32, 4, 5, 6]


def test_the_grammar_mask_keeps_the_allowed_tokens_of_each_masked_row():
    logits = torch.zeros(3, 40)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0], bitmask[1, 1] = 0b1010, 1  # row 0: tokens 1, 3; row 2: token 32
    stride = 4  # positions per request in the mapping
    v2_kernels.grammar_bitmask(logits, 40, torch.tensor([0 * stride, 1 * stride + 1]),
                               torch.tensor([0, 1, 3]), bitmask, 2, 40, stride, 8192)
    assert (logits[0] == 0).nonzero().flatten().tolist() == [1, 3]
    assert not logits[1].isinf().any()  # no mask for it
    assert (logits[2] == 0).nonzero().flatten().tolist() == [32]
