"""What the NPU punica wrapper (punica_npu.py) has no path for, refused at start-up with the fix."""


def check_lora_config(vllm_config) -> None:
    """LoRA where the NPU punica wrapper (vllm_ascend/lora) has no path: refused."""
    if vllm_config.lora_config is None or vllm_config.model_config is None:
        return
    fix = "Serve without --enable-lora, or merge the adapter into the weights first."
    if vllm_config.model_config.use_mla:
        raise ValueError("LoRA on an MLA model (DeepSeek) is not supported by vllm-ascend "
                         "yet: the Ascend MLA layer absorbs kv_b_proj's weights into its "
                         "attention (W_UK, W_UV), past vLLM's LoRA wrappers. " + fix)
    if vllm_config.model_config.is_moe:
        raise ValueError("LoRA on a mixture-of-experts model is not supported by "
                         "vllm-ascend yet: the NPU punica wrapper has no fused-MoE LoRA. "
                         + fix)
    if vllm_config.speculative_config is not None:
        raise ValueError("LoRA with speculative decoding is not supported by vllm-ascend "
                         "yet: the drafter's graphs with adapters are untested. Turn "
                         "speculative decoding off, or " + fix[0].lower() + fix[1:])
