"""The runner's padding decision (worker/padding.py): what FIA sees in each kind of step."""

import pytest
from vllm.config import CUDAGraphMode as M

from vllm_ascend.worker.padding import decide_padding

CAP = 512  # one request's block-table row, in tokens


def fia_view(p, real_q):
    """(query lengths FIA sees, their sum) for a step whose scheduled requests have ``real_q``."""
    q = list(real_q) + list(p.padding_query_lens)
    return q, sum(q)


# mode, scheduled query lengths, graph (tokens, requests, uniform), q, expected padding requests
CASES = {
    "eager: nothing padded": (M.NONE, [7, 1], (8, None, False), 1, ()),
    "piecewise: attention eager on the real tokens": (M.PIECEWISE, [5, 1], (8, None, False), 1,
                                                      ()),
    "uniform decode q=1, 3 in the 8-graph": (M.FULL, [1, 1, 1], (8, 8, True), 1,
                                             (1, 1, 1, 1, 1)),
    "uniform decode q=1, at the size": (M.FULL, [1] * 4, (4, 4, True), 1, ()),
    "uniform decode q=K+1=3, 2 in the 12-graph": (M.FULL, [3, 3], (12, 4, True), 3, (3, 3)),
    "uniform decode q=K+1=4, full graph": (M.FULL, [4] * 4, (16, 4, True), 4, ()),
    "mixed: prefill + decodes, dummy takes the rest": (M.FULL, [5, 1, 1], (16, 8, False), 1,
                                                       (1, 1, 1, 1, 1, 4)),
    "mixed: padding runs out before the requests": (M.FULL, [5, 1, 1], (12, 12, False), 1,
                                                    (1,) * 5 + (0,) * 4 + (0,)),
    "mixed: at the size, an empty dummy": (M.FULL, [2, 2], (4, 4, False), 1, (0, 0, 0)),
    "mixed: full batch (max_num_seqs 4), dummy only": (M.FULL, [2, 1, 3, 1], (16, 4, False), 1,
                                                       (9,)),
    "DP-padded: 1 token, ranks agreed on 8": (M.FULL, [1], (8, 8, True), 1, (1,) * 7),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_padding_table(case):
    mode, real_q, (tokens, reqs, uniform), q, expected = CASES[case]
    p = decide_padding(mode, sum(real_q), len(real_q), tokens, reqs, uniform, q, CAP)
    assert p.padding_query_lens == expected
    assert p.pads_attention == (mode == M.FULL)
    if p.pads_attention:
        lens, total = fia_view(p, real_q)
        assert total == tokens  # FIA's TND check: query tokens == last cumulative length
        # The batch FIA sees is the graph's: its request count (+ the dummy of a mixed graph).
        assert len(lens) == reqs + (0 if uniform else 1)
        if uniform:
            assert set(lens) == {q}  # whole q-token fake requests
    else:
        assert p.num_reqs_padded == len(real_q)


def test_above_the_largest_size_runs_eagerly_unpadded():
    # The dispatcher gives NONE and the unpadded size for a step above every capture size.
    p = decide_padding(M.NONE, 40, 6, 40, None, False, 1, CAP)
    assert p.num_tokens_padded == 40 and p.num_reqs_padded == 6 and not p.pads_attention


def test_padding_beyond_one_request_spreads_over_the_padding_requests():
    p = decide_padding(M.FULL, 1, 1, 300, 3, False, 1, 128)
    assert p.padding_query_lens == (128, 43, 128)  # the dummy first, then the others
    with pytest.raises(ValueError, match="raise max_model_len or lower the capture sizes"):
        decide_padding(M.FULL, 1, 1, 300, 1, False, 1, 128)


def test_a_uniform_graph_that_cannot_hold_the_step_is_an_error():
    with pytest.raises(ValueError, match="whole 2-token requests"):
        decide_padding(M.FULL, 3, 3, 8, 4, True, 2, CAP)
    with pytest.raises(ValueError, match="do not fit"):
        decide_padding(M.FULL, 9, 9, 8, 8, True, 1, CAP)


def test_v2_request_rows_give_a_batch_the_dummy_request_beyond_vllms_buffers():
    """Model Runner V2: a mixed FULL graph of as many requests as vLLM's buffers hold still gets
    FIA's dummy request, in the row the runner keeps behind them (worker/v2/model_runner.py)."""
    import torch
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    from vllm_ascend.worker.v2.model_runner import RequestRows

    buffers = InputBuffers(max_num_reqs=4, max_num_tokens=16, device=torch.device("cpu"))
    rows = RequestRows(torch.full((6,), 9, dtype=torch.int32),
                       torch.full((5,), 9, dtype=torch.int32))
    buffers.query_start_loc, buffers.seq_lens = rows.query_start_loc[:-1], rows.seq_lens[:-1]
    batch = InputBatch.make_dummy(4, 8, buffers)  # vLLM's capture batch: 4 requests of 2
    captured = rows.padded(batch, 5, scheduled=True)
    assert captured.num_reqs == captured.num_reqs_after_padding == 5
    assert captured.query_start_loc.tolist() == captured.query_start_loc_np.tolist() == [
        0, 2, 4, 6, 8, 8]
    assert captured.seq_lens.tolist() == captured.seq_lens_cpu_upper_bound.tolist() == [
        2, 2, 2, 2, 0]
    assert captured.num_scheduled_tokens.tolist() == [2, 2, 2, 2, 0]
    padding = rows.padded(batch, 5)  # a step's: the scheduled requests stay vLLM's
    assert (padding.num_reqs, padding.num_reqs_after_padding) == (4, 5)
    assert padding.num_scheduled_tokens.tolist() == [2, 2, 2, 2]
