"""Bad configuration fails at start-up with a message that names the problem and the fix (the
dtype: test_dtypes.py; speculative decoding: test_spec_decode.py; MoE and PP with speculation:
test_parallel.py)."""

import pytest

from tests.e2e.conftest import engine, model_path


def test_no_memory_left_for_the_kv_cache_names_the_settings_that_fix_it():
    # 1% of the simulated device's 2 GiB is less than the tiny model's weights and activations.
    with pytest.raises(Exception) as failure:
        with engine(model_path("llama"), enforce_eager=True, gpu_memory_utilization=0.01):
            pass
    message = str(failure.value)
    assert "No memory left for the KV cache on the sim device: 0.02 GiB budget" in message
    assert ("Raise gpu_memory_utilization, set VLLM_ASCEND_SIM_MEMORY_GB higher, or lower "
            "max_num_batched_tokens") in message
