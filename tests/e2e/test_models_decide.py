"""The tiny test models' logits decide: over every generated position of the test prompts, the
median gap between HF's top two tokens is at least MIN_MEDIAN_GAP nats, so that a comparison
with them compares something (the few near ties left are where check_logprobs_close lets two
sequences part). `python -m tests.e2e.test_models_decide` prints the figures docs/testing.md
records."""

import statistics

import pytest

from scripts.models import TINY_FAMILIES, logit_gaps, tiny_model_dir
from tests.e2e.conftest import MAX_TOKENS, PROMPTS

MIN_MEDIAN_GAP = 0.5


def gaps_of(family: str) -> list[float]:
    """Every generated position's top-two gap."""
    return [g for row in logit_gaps(tiny_model_dir(family), PROMPTS, MAX_TOKENS) for g in row]


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_the_top_token_leads_clearly(family):
    gaps = gaps_of(family)
    assert statistics.median(gaps) >= MIN_MEDIAN_GAP, sorted(round(g, 3) for g in gaps)


if __name__ == "__main__":
    print(f"top-two gaps in nats, {len(PROMPTS)} prompts x {MAX_TOKENS} positions (HF fp32)")
    for family in TINY_FAMILIES:
        gaps = sorted(gaps_of(family))
        print(f"{family:16s} median {statistics.median(gaps):.2f}, smallest {gaps[0]:.3f}, "
              f"under 0.1: {sum(g < 0.1 for g in gaps)}, under 0.3: {sum(g < 0.3 for g in gaps)} "
              f"of {len(gaps)}")
