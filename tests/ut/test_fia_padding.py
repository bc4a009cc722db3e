"""pad_for_graph: FIA lengths for a batch padded to a captured FULL graph."""

import pytest

from vllm_ascend.attention.graph_params import pad_for_graph


def q_of(cu):
    return [b - a for a, b in zip([0] + cu[:-1], cu)]


def test_batch_already_at_a_capture_size_gets_an_empty_dummy():
    cu, kv = pad_for_graph([1, 1, 1, 1], [5, 9, 3, 7], 4, 4, capacity=512)
    assert cu == [1, 2, 3, 4, 4] and kv == [5, 9, 3, 7, 0]


def test_uniform_decode_pads_with_whole_fake_decode_requests():
    # 3 real decodes in the size-8 graph captured for 8 requests (runner padded to 8 reqs)
    cu, kv = pad_for_graph([1, 1, 1, 0, 0, 0, 0, 0], [5, 9, 3, 0, 0, 0, 0, 0], 3, 8, 512)
    assert q_of(cu) == [1, 1, 1, 1, 1, 1, 1, 1, 0]
    assert kv == [5, 9, 3, 1, 1, 1, 1, 1, 0]  # fake requests attend to their one token
    assert cu[-1] == 8  # FIA's TND check: query tokens == last cumulative length


def test_full_batch_plus_dummy_has_one_more_entry_than_max_num_seqs():
    max_num_seqs = 4
    cu, kv = pad_for_graph([2, 1, 3, 1], [10, 4, 3, 8], max_num_seqs, 16, 512)
    assert len(cu) == max_num_seqs + 1 and q_of(cu) == [2, 1, 3, 1, 9]
    assert kv == [10, 4, 3, 8, 9]


def test_mixed_prefill_and_decode():
    cu, kv = pad_for_graph([5, 1, 1, 0, 0], [5, 20, 7, 0, 0], 3, 12, 512)
    assert q_of(cu) == [5, 1, 1, 1, 1, 3] and kv == [5, 20, 7, 1, 1, 3]


def test_padding_respects_the_block_table_capacity():
    cu, kv = pad_for_graph([1, 0, 0], [3, 0, 0], 1, 300, capacity=128)
    assert q_of(cu) == [1, 128, 43, 128] and max(kv[1:]) <= 128
    with pytest.raises(ValueError, match="cannot place"):
        pad_for_graph([1], [3], 1, 300, capacity=128)
