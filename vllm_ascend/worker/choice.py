"""Which of vLLM's model runners the plugin's worker builds, decided before vLLM asks.

vLLM 0.32 reads ``VllmConfig.use_v2_model_runner`` while it builds the config (async scheduling,
speculative decoding and the graph mode depend on it) and picks Model Runner V2 by default
wherever Triton imports, as it does on a chip with triton-ascend installed. The plugin's default
is V1 (``NPUModelRunner``): V2's runner (``NPUModelRunnerV2``) does not yet cover all V1 does, so
the plugin names V1 for vLLM through vLLM's own switch, ``VLLM_USE_V2_MODEL_RUNNER=0``, when the
platform plugin loads (the first thing vLLM does in every process, and spawned processes inherit
it): config and worker then agree whether or not Triton imports. ``VLLM_USE_V2_MODEL_RUNNER=1``
asks for V2; what it does not support yet is refused at start-up (``describe``).
"""

import os

ENV_VAR = "VLLM_USE_V2_MODEL_RUNNER"


def name_v1_runner() -> None:
    """Set vLLM's switch to V1 unless the user set it (the platform plugin's load)."""
    os.environ.setdefault(ENV_VAR, "0")


def v2_unsupported(vllm_config) -> list[str]:
    """What of this configuration vllm-ascend's Model Runner V2 does not run yet."""
    from vllm.config import CUDAGraphMode  # (not at import: the plugin's load imports this)

    unsupported = []
    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is not None and mode.mixed_mode() == CUDAGraphMode.FULL:
        unsupported.append(f"cudagraph_mode {mode.name} (FULL graphs of mixed batches; "
                           "FULL_AND_PIECEWISE and FULL_DECODE_ONLY run)")
    if vllm_config.speculative_config is not None:
        unsupported.append("speculative decoding")
    if vllm_config.lora_config is not None:
        unsupported.append("LoRA")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        unsupported.append("pipeline parallelism")
    if vllm_config.model_config is not None and vllm_config.model_config.enable_sleep_mode:
        unsupported.append("sleep mode")
    return unsupported


def describe(vllm_config) -> str:
    """The runner the worker builds for ``vllm_config``, and why; raises if it cannot run the
    configuration with the runner vLLM's config names."""
    asked = os.environ.get(ENV_VAR)
    if not vllm_config.use_v2_model_runner:
        return f"V1 (NPUModelRunner; {ENV_VAR}={asked}): the default"
    why = (f"{ENV_VAR}={asked}" if asked not in (None, "0") else
           "vLLM's default where Triton imports" if asked is None else
           "a feature of this configuration that only Model Runner V2 supports")
    unsupported = v2_unsupported(vllm_config)
    if unsupported:
        raise ValueError(
            f"vLLM's Model Runner V2 was asked for ({why}), but vllm-ascend's V2 runner does not "
            f"support {', '.join(unsupported)} yet. Unset {ENV_VAR} (or set it to 0) to run "
            "vLLM's V1 model runner, which does.")
    return f"V2 (NPUModelRunnerV2; {why})"
