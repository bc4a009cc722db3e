"""The comparison rules every e2e test uses. Against HF (check_logprobs_close): the chosen
token's logprob at every position within the tolerance; sequences part only at a near tie, and
are compared after it against HF's scoring of the actual sequence. Eager against graph mode
(check_identical): the same tokens and logprobs within 1e-6."""

import pytest

from tests.e2e.conftest import (EXACT, LOGPROB_TOLERANCE, Reference, check_identical,
                                check_logprobs_close)

TOL = LOGPROB_TOLERANCE["tiny", "bfloat16"]
STEPS = [{5: -0.1, 6: -2.5}, {7: -0.4, 8: -0.4 - TOL / 2, 2: -3.0}, {9: -0.05, 1: -3.0}]


class Scored(Reference):
    """A reference whose scoring of another continuation is given (HF's, in the e2e tests), and
    its least lead when perturbed (by default its plain lead: no cliff)."""

    def __new__(cls, tokens, steps, along=None, perturbed=None):
        self = super().__new__(cls, tokens, steps, "tiny-model", ())
        self.along, self.perturbed = along, perturbed or {}
        return self

    def rescore(self, tokens):
        return self.along[tuple(tokens)]

    def perturbed_gap(self, prefix, token):
        return self.perturbed.get(("gap", tuple(prefix), token), float("inf"))

    def perturbed_drift(self, prefix, token, logprob):
        return self.perturbed.get(("drift", tuple(prefix), token), float("inf"))


REFERENCE = Scored([5, 7, 9], STEPS)


def shifted(by: float, tokens=(5, 7, 9), steps=STEPS):
    return (list(tokens), [{t: lp + by for t, lp in step.items()} for step in steps])


def test_same_tokens_within_the_tolerance_pass_and_every_position_is_compared():
    assert check_logprobs_close(REFERENCE, shifted(0.9 * TOL)) == 3
    f16 = LOGPROB_TOLERANCE["tiny", "float16"]
    assert check_logprobs_close(REFERENCE, shifted(-0.9 * f16), dtype="float16") == 3


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_drift_that_keeps_every_token_fails(dtype):
    with pytest.raises(AssertionError, match=r"token 0 \(5\) has logprob -0.6000, reference "
                                             r"-0.1000: 0.5000 apart"):
        check_logprobs_close(REFERENCE, shifted(-0.5), dtype=dtype)
    with pytest.raises(AssertionError, match="apart, more than"):
        check_logprobs_close(REFERENCE, shifted(-1.1 * LOGPROB_TOLERANCE["tiny", dtype]),
                             dtype=dtype)


def along(last: dict) -> dict:
    """HF's scoring of the sequence that took token 8 at position 1 (a near tie there)."""
    return {(5, 8, 1): STEPS[:1] + [STEPS[1], last]}


def test_parting_at_a_near_tie_passes_and_the_positions_after_it_are_still_compared():
    got = ([5, 8, 1], [STEPS[0], {8: STEPS[1][8], 7: STEPS[1][7]}, {1: -0.2, 4: -2.0}])
    scored = Scored([5, 7, 9], STEPS, along({1: -0.2 + TOL / 2, 4: -2.5}))
    assert check_logprobs_close(scored, got) == 3
    # The same parting, and HF's logprob of the token after it far from the engine's: fails.
    scored = Scored([5, 7, 9], STEPS, along({1: -1.5, 4: -0.5}))
    with pytest.raises(AssertionError, match=r"token 2 is 1, the reference's choice 4 leads it "
                                             r"by 1.0000: not a near tie"):
        check_logprobs_close(scored, got)


def test_parting_at_a_cliff_of_the_reference_passes():
    """Where the reference's own lead over the engine's token falls below the tolerance when its
    activations are perturbed below bfloat16's rounding (hf_perturbed_gap), a lead above it is
    no measure of a tie: the parting passes, and every position is still compared."""
    first = {5: -0.1, 6: -0.1 - 1.5 * TOL}  # a lead of 0.6: no near tie, unperturbed
    got = ([6, 7, 9], [{6: -0.4, 5: -0.5}, STEPS[1], STEPS[2]])  # 6: 0.3 from the reference's
    after = {(6, 7, 9): [first, STEPS[1], STEPS[2]]}
    cliff = Scored([5, 7, 9], [first, *STEPS[1:]], after, perturbed={("gap", (), 6): TOL / 2})
    assert check_logprobs_close(cliff, got) == 3
    steep = Scored([5, 7, 9], [first, *STEPS[1:]], after, perturbed={("gap", (), 6): 2 * TOL})
    with pytest.raises(AssertionError, match=r"leads it by 0.6000: not a near tie \(under "
                                             r"0.4; by 0.8000 at least with its activations "
                                             r"perturbed"):
        check_logprobs_close(steep, got)


def test_a_drift_within_the_tolerance_of_a_perturbed_reference_run_passes():
    """A drift over the tolerance from the plain reference passes where one of the reference's
    runs perturbed below bfloat16's rounding is within it (a cliff), and fails otherwise."""
    got = shifted(-1.5 * TOL)
    cliff = Scored([5, 7, 9], STEPS, perturbed={("drift", (), 5): TOL / 2,
                                                ("drift", (5,), 7): TOL / 2,
                                                ("drift", (5, 7), 9): TOL})
    assert check_logprobs_close(cliff, got) == 3
    steep = Scored([5, 7, 9], STEPS, perturbed={("drift", (), 5): 1.2 * TOL})
    with pytest.raises(AssertionError, match=r"token 0 \(5\) has logprob -0.7000, reference "
                                             r"-0.1000: 0.6000 apart, more than the 0.4 tiny bfloat16 allows "
                                             r"\(and 0.4800 from the nearest"):
        check_logprobs_close(steep, got)


def test_parting_at_the_first_token_on_the_references_second_choice_fails():
    # The old rule passed this with no position compared: 6 is in the reference's top-k.
    got = ([6, 7, 9], [{6: -0.1, 5: -2.5}, STEPS[1], STEPS[2]])
    with pytest.raises(AssertionError, match=r"token 0 is 6, the reference's choice 5 leads it "
                                             r"by 2.4000: not a near tie"):
        check_logprobs_close(REFERENCE, got)


def test_parting_outside_the_top_k_fails():
    got = ([5, 3, 9], [{5: -0.1}, {3: -0.2, 4: -0.9}, {9: -0.05}])
    with pytest.raises(AssertionError, match="leads it by inf: not a near tie"):
        check_logprobs_close(REFERENCE, got)


def test_a_different_length_fails():
    with pytest.raises(AssertionError, match="2 tokens, expected 3"):
        check_logprobs_close(REFERENCE, ([5, 7], STEPS[:2]))


def test_graph_and_eager_must_agree_to_the_bit():
    check_identical(shifted(0.0), shifted(EXACT / 2))
    with pytest.raises(AssertionError, match="position 0's logprobs differ"):
        check_identical(shifted(0.0), shifted(1e-5))
    with pytest.raises(AssertionError, match="tokens differ"):
        check_identical(shifted(0.0), shifted(0.0, tokens=(5, 8, 9)))
