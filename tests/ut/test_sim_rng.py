"""The simulated device's exponential random numbers (vllm_ascend/device/sim/rng.py): the noise
vLLM's random sampling divides the probabilities by, drawn from the request's generator."""

import pytest
import torch
from vllm.v1.sample.ops.topk_topp_sampler import random_sample


def test_the_device_draws_them_with_the_simulators_kernel():
    """Installed with the device (the test's fixture opened it), as the matrix products are."""
    kernel = torch.library.get_kernel("aten::exponential_", "CPU")
    assert "sim/rng.py" in repr(kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lambd", [1.0, 2.5])
def test_values_are_exponential_finite_and_above_zero(dtype, lambd):
    torch.manual_seed(0)
    q = torch.empty(400_000, dtype=dtype).exponential_(lambd)
    assert bool(torch.isfinite(q).all()) and float(q.min()) > 0
    # Exp(lambd): mean and deviation 1/lambd, median ln 2/lambd (400k draws: within 1 %)
    for got, want in ((q.mean(), 1 / lambd), (q.std(), 1 / lambd),
                      (q.median(), 0.6931 / lambd)):
        assert abs(float(got) - want) < 0.01 * want


def test_a_seeded_generator_gives_the_same_numbers():
    def draw(seed):
        return torch.empty(1000).exponential_(generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(7), draw(8))


def test_vllms_random_sampling_draws_by_the_probabilities():
    """vLLM's random_sample (probabilities over the noise, then argmax) picks each token as
    often as its probability says, with and without a request's own generator."""
    torch.manual_seed(1)
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05, 0.0]).expand(20_000, -1).contiguous()
    for generators in ({}, {i: torch.Generator().manual_seed(i) for i in range(0, 20_000, 2)}):
        tokens = random_sample(probs.clone(), generators)
        freq = torch.bincount(tokens, minlength=5).double() / len(tokens)
        assert freq[4] == 0
        assert torch.allclose(freq, probs[0].double(), atol=0.015), freq


def test_other_dtypes_and_a_bad_lambda_as_torch():
    q = torch.empty(64, dtype=torch.bfloat16).exponential_()
    assert float(q.min()) >= 0 and q.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="expects lambda > 0.0"):
        torch.empty(3).exponential_(-1.0)
