"""The capture-size budget: kept sizes fit, keep the ends, spread evenly, fall back when needed."""

import pytest
from vllm.config import CUDAGraphMode as M

from vllm_ascend.compilation.capture_sizes import evenly_spread, plan_capture_sizes

UPSTREAM_SIZES = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))  # 51 sizes


@pytest.mark.parametrize("layers", [2, 30, 61, 94])
@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (8, 1), (1, 2), (8, 2)])
@pytest.mark.parametrize("mode", [M.PIECEWISE, M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE])
@pytest.mark.parametrize("draft", [0, 1])
@pytest.mark.parametrize("total,reserve", [(2048, 248), (1024, 248), (300, 0)])
def test_kept_sizes_fit_keep_the_ends_and_are_spread(layers, tp, dp, mode, draft, total, reserve):
    plan = plan_capture_sizes(UPSTREAM_SIZES, mode, layers, tensor_parallel=tp, data_parallel=dp,
                              draft_layers=draft, stream_total=total, stream_reserve=reserve)
    assert plan.streams_needed <= total - reserve
    if plan.mode == M.NONE:
        assert plan.kept == [] and "not one size fits" in plan.reason
        assert plan.narrowed.startswith(f"not one {mode.name} capture size fits")
        return
    assert plan.kept == sorted(plan.kept) and set(plan.kept) | set(plan.dropped) == set(
        UPSTREAM_SIZES)
    if len(plan.kept) >= 2:
        assert plan.kept[0] == 1 and plan.kept[-1] == 512
    # as many as fit: one more size would not
    if plan.dropped:
        assert (len(plan.kept) + 1) * plan.streams_per_size > total - reserve
    # evenly spread: index gaps differ by at most one
    idx = [UPSTREAM_SIZES.index(s) for s in plan.kept]
    gaps = [b - a for a, b in zip(idx, idx[1:])]
    assert not gaps or max(gaps) - min(gaps) <= 1


# (layers, mode, TP, DP, draft layers) -> streams one capture size costs, counted by hand: graphs
# per size (PIECEWISE: layers + 1 pieces, plus draft layers + 1; FULL: 1) x streams per graph
# (1, plus 1 per communication group: TP > 1, DP > 1).
STREAMS_PER_SIZE = [
    ((30, M.PIECEWISE, 2, 1, 0), 62),  # 31 pieces x 2
    ((60, M.PIECEWISE, 1, 1, 0), 61),
    ((2, M.FULL_AND_PIECEWISE, 1, 1, 0), 4),  # 3 pieces + 1 FULL
    ((2, M.FULL_AND_PIECEWISE, 1, 1, 1), 6),  # 3 + 2 drafter pieces + 1 FULL (none drafter)
    ((2, M.PIECEWISE, 2, 1, 1), 10),  # (3 + 2) x 2
    ((30, M.FULL_DECODE_ONLY, 1, 1, 0), 1),
    ((94, M.FULL, 8, 2, 0), 3),  # 1 graph x (own + TP + DP)
    ((30, M.FULL_AND_PIECEWISE, 2, 2, 0), 96),  # (31 + 1) x 3
]


@pytest.mark.parametrize("case,streams", STREAMS_PER_SIZE, ids=lambda c: str(c))
def test_streams_per_size_of_known_layouts(case, streams):
    layers, mode, tp, dp, draft = case
    plan = plan_capture_sizes(UPSTREAM_SIZES, mode, layers, tensor_parallel=tp,
                              data_parallel=dp, draft_layers=draft)
    assert plan.streams_per_size == streams
    assert len(plan.kept) == min(len(UPSTREAM_SIZES), 1800 // streams)  # 2048 - 248 usable


def test_lora_captures_each_size_once_without_and_once_with_adapters():
    """vLLM's dispatcher with LoRA on (cudagraph_specialize_lora, its default): 2 cases."""
    plan = plan_capture_sizes(UPSTREAM_SIZES, M.FULL_AND_PIECEWISE, 30, lora_cases=2)
    assert plan.streams_per_size == 2 * (31 + 1)
    assert len(plan.kept) == 1800 // 64


def test_30_layers_piecewise_at_tp2_keeps_29_sizes():
    plan = plan_capture_sizes(UPSTREAM_SIZES, M.PIECEWISE, 30, tensor_parallel=2)
    assert (plan.streams_per_size, len(plan.kept), plan.streams_needed) == (62, 29, 1798)


def test_60_layer_piecewise_with_upstream_sizes_is_cut_to_fit():
    plan = plan_capture_sizes(UPSTREAM_SIZES, M.PIECEWISE, 60)
    assert len(UPSTREAM_SIZES) * 61 > 2048  # upstream would need ~3100 streams
    assert plan.streams_per_size == 61 and len(plan.kept) == 1800 // 61 == 29
    assert plan.mode == M.PIECEWISE and plan.kept[0] == 1 and plan.kept[-1] == 512


def test_small_models_keep_every_size():
    plan = plan_capture_sizes(UPSTREAM_SIZES, M.FULL_AND_PIECEWISE, 2)
    assert plan.kept == UPSTREAM_SIZES and plan.dropped == []


@pytest.mark.parametrize("mode,expected,per_size", [(M.FULL_AND_PIECEWISE, M.FULL, 288),
                                                    (M.PIECEWISE, M.NONE, 285),
                                                    (M.FULL, M.FULL, None)])
def test_fallback_when_not_one_size_fits(mode, expected, per_size):
    plan = plan_capture_sizes(UPSTREAM_SIZES, mode, 94, tensor_parallel=8, data_parallel=2,
                              stream_total=200, stream_reserve=0)
    assert plan.mode == expected
    # (94 layers + 1 pieces [+ 1 FULL]) x 3 streams (the graph's own, TP's, DP's)
    assert plan.narrowed == ("" if per_size is None else
                             f"not one {mode.name} capture size fits the stream budget "
                             f"({per_size} streams per size, 200 usable): {expected.name} instead")
    if expected == M.FULL:  # FULL graphs cost 3 streams each here: 66 sizes would fit
        assert plan.kept == UPSTREAM_SIZES
    else:
        assert plan.kept == []


def test_sizes_stay_multiples_of_the_speculative_step():
    plan = plan_capture_sizes([1, 2, 3, 4, 6, 8, 9, 12], M.FULL_DECODE_ONLY, 4, multiple_of=3)
    assert plan.kept == [3, 6, 9, 12] and "multiples of 3" in plan.reason


def test_evenly_spread_keeps_both_ends():
    assert evenly_spread([1, 2, 3, 4, 5], 2) == [1, 5]
    assert evenly_spread([1, 2, 3, 4, 5], 3) == [1, 3, 5]
    assert evenly_spread([1, 2, 3], 1) == [1]
