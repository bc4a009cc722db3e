"""Which of vLLM's model runners the plugin's worker builds, decided before vLLM asks.

vLLM 0.32 reads ``VllmConfig.use_v2_model_runner`` while it builds the config (async scheduling,
speculative decoding and the graph mode depend on it) and picks Model Runner V2 by default
wherever Triton imports, as it does on a chip with triton-ascend installed. The plugin's worker
builds the V1 runner (``NPUModelRunner``) and has no V2 runner yet, so it names V1 for vLLM
through vLLM's own switch, ``VLLM_USE_V2_MODEL_RUNNER=0``, when the platform plugin loads (the
first thing vLLM does in every process, and spawned processes inherit it): config and worker
then agree whether or not Triton imports. A user's ``VLLM_USE_V2_MODEL_RUNNER=1`` is refused at
start-up (``check``), as is a feature that needs V2.
"""

import os

ENV_VAR = "VLLM_USE_V2_MODEL_RUNNER"


def name_v1_runner() -> None:
    """Set vLLM's switch to V1 unless the user set it (the platform plugin's load)."""
    os.environ.setdefault(ENV_VAR, "0")


def describe(vllm_config) -> str:
    """The runner the worker builds for ``vllm_config``, and why; raises if it cannot build
    the one vLLM's config names."""
    if vllm_config.use_v2_model_runner:
        asked = os.environ.get(ENV_VAR)
        why = (f"{ENV_VAR}={asked}" if asked not in (None, "0") else
               "vLLM's default where Triton imports" if asked is None else
               "a feature of this configuration that only Model Runner V2 supports")
        raise ValueError(
            f"vLLM's Model Runner V2 was asked for ({why}), but vllm-ascend runs vLLM's V1 "
            f"model runner only (NPUModelRunner). Unset {ENV_VAR} (or set it to 0), or turn the "
            "feature off.")
    return (f"V1 (NPUModelRunner; {ENV_VAR}={os.environ.get(ENV_VAR)}): vllm-ascend has no "
            "runner for vLLM's Model Runner V2 yet")
