"""vllm-ascend: the Ascend NPU platform plugin for vLLM."""


def register() -> str:
    """vLLM's `vllm.platform_plugins` entry point: the platform class to load. The model
    runner is named here, before vLLM reads it (worker/choice.py)."""
    from vllm_ascend.worker import choice

    choice.name_v1_runner()
    return "vllm_ascend.platform.NPUPlatform"
