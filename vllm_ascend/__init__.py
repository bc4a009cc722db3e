"""vllm-ascend: the Ascend NPU platform plugin for vLLM."""


def register() -> str:
    """vLLM's `vllm.platform_plugins` entry point: the platform class to load."""
    return "vllm_ascend.platform.NPUPlatform"
