"""Per-family model files: upstream vLLM classes with hand-encoded fusions.

``register()`` points vLLM's ModelRegistry at them under the upstream architecture names, so
they load by default. A family is added by writing its file and one line here (see
docs/adding_a_model.md).
"""

import os

from vllm import ModelRegistry

# Set to 1 to load upstream vLLM's classes instead (to compare; see benchmarks/).
UPSTREAM_ENV = "VLLM_ASCEND_UPSTREAM_MODELS"

FAMILIES = {
    "LlamaForCausalLM": "vllm_ascend.models.llama:AscendLlamaForCausalLM",
    "Qwen2ForCausalLM": "vllm_ascend.models.qwen2:AscendQwen2ForCausalLM",
    "Qwen3ForCausalLM": "vllm_ascend.models.qwen3:AscendQwen3ForCausalLM",
}


def register() -> None:
    if os.environ.get(UPSTREAM_ENV) == "1":
        return
    for arch, path in FAMILIES.items():
        ModelRegistry.register_model(arch, path)
