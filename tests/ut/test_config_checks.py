"""The config checks NPUPlatform.check_and_update_config hands to their areas (platform.py is a
switchboard): each a function of the config, tested by a table. (The graph mode's:
test_graph_modes.py; the capture sizes': test_capture_sizes.py; the operators' limits:
test_operator_limits.py; the start-up plan's: test_startup_plan.py.)"""

from types import SimpleNamespace as NS

import pytest

from vllm_ascend.device_allocator import sleep
from vllm_ascend.lora.config import check_lora_config
from vllm_ascend.worker.speculative import check_speculative_config, keep_host_lengths_exact

LORA = NS(max_loras=1)
DENSE, MLA, MOE = (NS(use_mla=False, is_moe=False), NS(use_mla=True, is_moe=False),
                   NS(use_mla=False, is_moe=True))
SPEC = NS(method="ngram", num_speculative_tokens=2)


@pytest.mark.parametrize("lora,model,spec,refused", [
    (None, MLA, SPEC, None),  # no LoRA: nothing to check
    (LORA, DENSE, None, None),
    (LORA, MLA, None, "absorbs kv_b_proj's weights"),
    (LORA, MOE, None, "no fused-MoE LoRA"),
    (LORA, DENSE, SPEC, "Turn speculative decoding off, or serve without --enable-lora"),
])
def test_lora_is_refused_where_the_punica_wrapper_has_no_path(lora, model, spec, refused):
    config = NS(lora_config=lora, model_config=model, speculative_config=spec)
    if refused is None:
        check_lora_config(config)
    else:
        with pytest.raises(ValueError, match=refused):
            check_lora_config(config)


@pytest.mark.parametrize("spec,pp,refused", [
    (None, 2, False), (SPEC, 1, False), (SPEC, 2, True)])
def test_speculative_decoding_with_pipeline_parallelism_is_refused(spec, pp, refused):
    parallel = NS(pipeline_parallel_size=pp)
    if refused:
        with pytest.raises(ValueError, match="drafter exists on the last pipeline stage only"):
            check_speculative_config(spec, parallel)
    else:
        check_speculative_config(spec, parallel)


@pytest.mark.parametrize("spec,async_before,async_after", [
    (None, True, True), (SPEC, True, False), (SPEC, False, False)])
def test_speculative_decoding_turns_async_scheduling_off(spec, async_before, async_after):
    """FIA takes the KV lengths as host lists, exact; async speculation knows only a bound."""
    config = NS(speculative_config=spec, scheduler_config=NS(async_scheduling=async_before))
    keep_host_lengths_exact(config)
    assert config.scheduler_config.async_scheduling is async_after


@pytest.mark.parametrize("asked,kept", [("cumem", sleep.NAME), (sleep.NAME, sleep.NAME),
                                        ("torch_memory_saver", None)])
def test_sleep_mode_takes_the_ascend_backend(asked, kept):
    model = NS(sleep_mode_backend=asked)
    if kept is None:
        with pytest.raises(ValueError, match="is not available on Ascend; leave it unset"):
            sleep.select_backend(model)
    else:
        sleep.select_backend(model)
        assert model.sleep_mode_backend == kept
