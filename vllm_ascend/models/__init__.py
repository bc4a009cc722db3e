"""Per-family model files: upstream vLLM classes with hand-encoded fusions.

``register()`` (the ``ascend_models`` general plugin) points vLLM's ModelRegistry at them under
the upstream architecture names, so they load by default; vLLM's own ``VLLM_PLUGINS=ascend``
(the platform plugin only) loads upstream's classes instead. A family is added by writing its
file and one line here (see docs/adding_a_model.md).
"""

from vllm import ModelRegistry

FAMILIES = {
    "LlamaForCausalLM": "vllm_ascend.models.llama:AscendLlamaForCausalLM",
    "Qwen2ForCausalLM": "vllm_ascend.models.qwen2:AscendQwen2ForCausalLM",
    "Qwen3ForCausalLM": "vllm_ascend.models.qwen3:AscendQwen3ForCausalLM",
    "Qwen2MoeForCausalLM": "vllm_ascend.models.qwen2_moe:AscendQwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "vllm_ascend.models.qwen3_moe:AscendQwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM": "vllm_ascend.models.deepseek_v2:AscendDeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "vllm_ascend.models.deepseek_v2:AscendDeepseekV3ForCausalLM",
    "DeepSeekMTPModel": "vllm_ascend.models.deepseek_mtp:AscendDeepSeekMTP",
}


def register() -> None:
    for arch, path in FAMILIES.items():
        ModelRegistry.register_model(arch, path)
