"""The tiny test models' logits decide: over every generated position of the test prompts, the
median gap between HF's top two tokens is at least MIN_MEDIAN_GAP nats, so that a comparison
with them compares something (the few near ties left are where check_logprobs_close lets two
sequences part). `python -m tests.e2e.test_models_decide` prints the figures docs/testing.md
records. The models with DeepSeek-V3's router (sigmoid scores, a correction bias, expert
groups) route clearly too: no token's choice of experts is nearer a tie than MIN_ROUTING_GAP,
which bfloat16 rounding of the router's input could flip (and a flip moves a logprob by nats)."""

import statistics

import pytest

from scripts.models import logit_gaps, routing_gaps, TINY_FAMILIES, tiny_model_dir
from tests.e2e.conftest import MAX_TOKENS, PROMPTS

MIN_MEDIAN_GAP = 0.5
MIN_ROUTING_GAP = 0.01
SIGMOID_ROUTED = ["deepseek_v3", "glm4_moe"]


def gaps_of(family: str) -> list[float]:
    """Every generated position's top-two gap."""
    return [g for row in logit_gaps(tiny_model_dir(family), PROMPTS, MAX_TOKENS) for g in row]


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_the_top_token_leads_clearly(family):
    gaps = gaps_of(family)
    assert statistics.median(gaps) >= MIN_MEDIAN_GAP, sorted(round(g, 3) for g in gaps)


@pytest.mark.parametrize("family", SIGMOID_ROUTED)
def test_the_experts_are_chosen_clearly(family):
    gaps = routing_gaps(tiny_model_dir(family), PROMPTS, MAX_TOKENS)
    assert min(gaps) >= MIN_ROUTING_GAP, sorted(round(g, 4) for g in gaps)[:5]


if __name__ == "__main__":
    print(f"top-two gaps in nats, {len(PROMPTS)} prompts x {MAX_TOKENS} positions (HF fp32)")
    for family in TINY_FAMILIES:
        gaps = sorted(gaps_of(family))
        print(f"{family:16s} median {statistics.median(gaps):.2f}, smallest {gaps[0]:.3f}, "
              f"under 0.1: {sum(g < 0.1 for g in gaps)}, under 0.3: {sum(g < 0.3 for g in gaps)} "
              f"of {len(gaps)}")
    for family in SIGMOID_ROUTED:
        gaps = routing_gaps(tiny_model_dir(family), PROMPTS, MAX_TOKENS)
        print(f"{family:16s} routing: smallest margin {min(gaps):.4f} of {len(gaps)} choices")
