"""The logprob-closeness rule every e2e comparison uses: tokens may part only where each is in
the other's top-k, and before that the chosen tokens' logprobs must agree within the dtype's
tolerance (a uniform drift keeps the argmax, and must still fail)."""

import pytest

from tests.e2e.conftest import LOGPROB_TOLERANCE, check_logprobs_close

REFERENCE = ([5, 7, 9], [{5: -0.1, 6: -2.5}, {7: -0.4, 8: -1.2}, {9: -0.05, 1: -3.0}])


def shifted(by: float, tokens=(5, 7, 9)):
    return (list(tokens), [{t: lp + by for t, lp in step.items()} for step in REFERENCE[1]])


def test_same_tokens_within_the_tolerance_pass():
    check_logprobs_close(REFERENCE, shifted(0.9 * LOGPROB_TOLERANCE["bfloat16"]))
    check_logprobs_close(REFERENCE, shifted(-0.9 * LOGPROB_TOLERANCE["float16"]), dtype="float16")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_drift_that_keeps_every_token_fails(dtype):
    with pytest.raises(AssertionError, match=r"token 0 \(5\) has logprob -0.6000, reference "
                                             r"-0.1000: 0.5000 apart"):
        check_logprobs_close(REFERENCE, shifted(-0.5), dtype=dtype)
    with pytest.raises(AssertionError, match="apart, more than"):
        check_logprobs_close(REFERENCE, shifted(-1.1 * LOGPROB_TOLERANCE[dtype]), dtype=dtype)


def test_parting_where_both_tokens_are_in_each_others_top_k_passes_and_stops_there():
    got = ([5, 8, 1], [{5: -0.1, 6: -2.4}, {8: -0.5, 7: -0.6}, {1: -9.0}])
    check_logprobs_close(REFERENCE, got)  # parts at 1 (8 vs 7); position 2 is not compared


def test_parting_outside_the_top_k_fails():
    got = ([5, 3, 9], [{5: -0.1}, {3: -0.2, 4: -0.9}, {9: -0.05}])
    with pytest.raises(AssertionError, match="not in each other's top"):
        check_logprobs_close(REFERENCE, got)


def test_a_different_length_fails():
    with pytest.raises(AssertionError, match="2 tokens, expected 3"):
        check_logprobs_close(REFERENCE, ([5, 7], REFERENCE[1][:2]))
