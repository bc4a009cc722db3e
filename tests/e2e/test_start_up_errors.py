"""Bad configuration fails at start-up with a message that names the problem and the fix (the
dtype: test_dtypes.py; speculative decoding: test_spec_decode.py; MoE and PP with speculation:
test_parallel.py)."""

import pytest

from tests.e2e.conftest import engine, model_path, platform_log


def test_no_memory_left_for_the_kv_cache_names_the_settings_that_fix_it():
    # 1% of the simulated device's 2 GiB is less than the tiny model's weights and activations.
    with pytest.raises(Exception) as failure:
        with engine(model_path("llama"), enforce_eager=True, gpu_memory_utilization=0.01):
            pass
    message = str(failure.value)
    # The start-up plan refuses it before the weights load.
    assert "this engine cannot start on sim device 0 (rank 0)" in message
    assert "the KV cache would get 0.00 GiB of the 0.02 GiB budget" in message
    assert ("Fix: raise --gpu-memory-utilization, or lower --max-model-len, or lower "
            "--max-num-batched-tokens, or set VLLM_ASCEND_SIM_MEMORY_GB higher") in message


# Checkpoints with only a config (no weights): the refusal must come from the config, before
# any weight is read, within seconds of the command.
LIMITS = [
    pytest.param("llama", {"head_dim": 40}, {}, "head size 40", id="fia-head-size"),
    pytest.param("llama", {"num_attention_heads": 128, "num_key_value_heads": 1,
                           "head_dim": 16}, {},
                 "--tensor-parallel-size 2", id="fia-heads-per-kv-head"),
    # MiniCPM3's latent attention shapes on the DeepSeek-V2 architecture.
    pytest.param("deepseek_v2", {"kv_lora_rank": 256, "qk_rope_head_dim": 32,
                                 "qk_nope_head_dim": 64, "v_head_dim": 64}, {},
                 "kv_lora_rank=256, qk_rope_head_dim=32", id="mla-shapes"),
    pytest.param("llama", {}, {"block_size": 512}, "block_size 512", id="block-size"),
    # Qwen3-Next with attention heads of 96: a recurrent state (131072 bytes) is not a whole
    # number of tokens' K (384 bytes), so no block is both (attention/hybrid.py).
    pytest.param("qwen3_next", {"head_dim": 96}, {},
                 "is not a whole number of attention tokens of 384 bytes",
                 id="gated-deltanet-layout"),
    # Models with state-space layers: no Ascend path for them yet.
    pytest.param("mamba2", {}, {}, "Mamba2ForCausalLM's Mamba-2 layers", id="mamba2"),
    pytest.param("llama", {}, {"max_num_seqs": 4096, "max_num_batched_tokens": 4096},
                 "--max-num-seqs 4095", id="fia-batch"),
]


@pytest.mark.parametrize("family,config,settings,fix", LIMITS)
def test_a_shape_the_operators_refuse_fails_at_once_before_weights_load(family, config,
                                                                      settings, fix):
    import time

    from scripts.models import config_only_dir

    path = config_only_dir(family, **config)
    start = time.monotonic()
    # (vLLM reports its config's errors as pydantic's ValidationError, a ValueError)
    with pytest.raises(ValueError, match="exceeds what Ascend's attention operators "
                                         "accept") as failure:
        with engine(path, **settings):
            pass
    assert time.monotonic() - start < 30
    assert fix in str(failure.value)


def test_the_model_runner_is_v1_whether_or_not_triton_imports(monkeypatch):
    """vLLM 0.32 picks Model Runner V2 where Triton imports (a chip with triton-ascend); the
    plugin names V1, its default, and says so; V2 asked for with a feature it does not run yet
    is refused (the rest of V2: test_model_runner_v2.py)."""
    import vllm.config.vllm as vllm_config_module
    from vllm.engine.arg_utils import EngineArgs

    import vllm_ascend
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)  # a stand-in for triton
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    vllm_ascend.register()  # the platform plugin's load, as in every vLLM process
    args = EngineArgs(model=model_path("llama"), max_model_len=512)
    with platform_log() as lines:
        config = args.create_engine_config()
    assert config.use_v2_model_runner is False
    assert "vllm-ascend: model runner V1 (NPUModelRunner; VLLM_USE_V2_MODEL_RUNNER=0): the " \
        "default" in lines, lines
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    assert config.use_v2_model_runner  # what vLLM alone would build here
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    args = EngineArgs(model=model_path("llama"), max_model_len=512, enable_lora=True)
    with pytest.raises(ValueError, match="Model Runner V2 was asked for \\(VLLM_USE_V2_MODEL_"
                                         "RUNNER=1\\), but vllm-ascend's V2 runner does not "
                                         "support LoRA yet"):
        args.create_engine_config()
