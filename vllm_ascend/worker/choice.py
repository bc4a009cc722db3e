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
_GPU = "vllm.v1.worker.gpu."
# What a configuration or a request asks of Model Runner V2 that needs a kernel the device may
# not supply (the simulator's torch versions cover the paths vllm-ascend runs: device/sim/
# v2_kernels.py; on a chip triton-ascend runs them all): (what, attribute, kernel).
V2_CONFIG_KERNELS = [("prompt embeddings (enable_prompt_embeds)", "enable_prompt_embeds",
                      _GPU + "model_states.prompt_embeds._apply_prompt_embeds_kernel")]
V2_REQUEST_KERNELS = [("logprob_token_ids", "logprob_token_ids",
                       _GPU + "sample.logprob._fill_logprob_token_ids_kernel"),
                      ("thinking_token_budget", "thinking_token_budget",
                       _GPU + "sample.thinking_budget._thinking_budget_kernel")]


def _missing_kernels(owner, table) -> list[str]:
    """What ``owner`` asks for, of ``table``, whose kernel the device does not supply."""
    from vllm_ascend import device

    kernels = device.current.v2_runner_kernels()
    if not kernels:  # a device that runs vLLM's own kernels (triton-ascend)
        return []
    return [what for what, attribute, kernel in table
            if getattr(owner, attribute, None) not in (None, False) and kernel not in kernels]


def name_v1_runner() -> None:
    """Set vLLM's switch to V1 unless the user set it (the platform plugin's load)."""
    os.environ.setdefault(ENV_VAR, "0")


def v2_unsupported(vllm_config) -> list[str]:
    """What of this configuration vllm-ascend's Model Runner V2 does not run yet."""
    unsupported = _v2_speculation_unsupported(vllm_config)
    if vllm_config.lora_config is not None:
        unsupported.append("LoRA")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        unsupported.append("pipeline parallelism")
    if vllm_config.model_config is not None and vllm_config.model_config.enable_sleep_mode:
        unsupported.append("sleep mode")
    if vllm_config.model_config is not None:
        unsupported += _missing_kernels(vllm_config.model_config, V2_CONFIG_KERNELS)
    return unsupported


V2_DRAFT_METHODS = ("eagle", "eagle3")  # V2's drafters the plugin runs (worker/v2/drafter.py)


def _v2_speculation_unsupported(vllm_config) -> list[str]:
    """What of the speculative decoding asked for vllm-ascend's V2 runner does not run yet."""
    from vllm.config import CUDAGraphMode

    from vllm_ascend import device

    spec = vllm_config.speculative_config
    if spec is None:
        return []
    if spec.method not in V2_DRAFT_METHODS:
        return [f"speculative decoding by {spec.method} (it runs EAGLE and EAGLE-3 heads)"]
    unsupported = []
    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is not None and mode.mixed_mode() == CUDAGraphMode.FULL:
        unsupported.append("speculative decoding in cudagraph_mode FULL (mixed FULL graphs for "
                           "the drafter's prefill; FULL_AND_PIECEWISE and FULL_DECODE_ONLY run)")
    if vllm_config.parallel_config.data_parallel_size > 1:
        unsupported.append("speculative decoding with data parallelism")
    # The simulator's Gumbel kernel (device/sim/v2_kernels.py) reads the host, which the
    # drafter's FULL graphs cannot hold; on a chip triton-ascend's kernel has no such read.
    torch_sampler = bool(device.current.v2_runner_kernels())
    for what, given in (
            ("draft_sample_method 'probabilistic' in a mode with FULL graphs on this device",
             spec.draft_sample_method == "probabilistic" and torch_sampler and mode is not None
             and mode.decode_mode() == CUDAGraphMode.FULL),
            ("block verification (rejection_sample_method 'block')",
             spec.rejection_sample_method == "block"),
            ("adaptive verification", spec.enable_adaptive_verification),
            ("watermarking", getattr(vllm_config, "watermark_config", None) is not None)):
        if given:
            unsupported.append(f"speculative decoding with {what}")
    return unsupported


def check_v2_request(params) -> None:
    """Refuse a request whose parameters need a V2 kernel the device does not supply (the
    platform's validate_request, before the request reaches the engine)."""
    if os.environ.get(ENV_VAR) != "1":
        return
    missing = _missing_kernels(params, V2_REQUEST_KERNELS)
    if missing:
        raise ValueError(
            f"{', '.join(missing)} is not supported by vllm-ascend's Model Runner V2 on this "
            f"device yet: drop it from the request, or serve with {ENV_VAR}=0 (vLLM's V1 "
            "model runner).")


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
