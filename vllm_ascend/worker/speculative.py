"""Speculative decoding's settings on Ascend, checked at start-up."""

from vllm_ascend.logger import get_logger

logger = get_logger(__name__)


def check_speculative_config(spec, parallel) -> None:
    if spec is not None and parallel.pipeline_parallel_size > 1:
        # vLLM 0.32 makes the drafter on the last stage only, yet every stage's attention
        # metadata reads it (GPUModelRunner._build_attention_metadata): the first stage
        # fails in its first forward with an AttributeError, on any device.
        raise ValueError(
            f"Speculative decoding ({spec.method}) does not run with "
            f"pipeline_parallel_size={parallel.pipeline_parallel_size} in vLLM 0.32: the "
            "drafter exists on the last pipeline stage only, and the other stages fail in "
            "their first step. Split the model with tensor_parallel_size instead, or turn "
            "speculative decoding off.")


def keep_host_lengths_exact(vllm_config) -> None:
    """Under async speculative decoding the host's KV lengths are only an upper bound (vLLM
    corrects them on the device); FIA takes them as host lists and needs them exact."""
    scheduler_config = vllm_config.scheduler_config
    if vllm_config.speculative_config is not None and scheduler_config.async_scheduling:
        logger.info("vllm-ascend: async scheduling turned off: speculative decoding needs "
                    "exact host KV lengths for the fused infer attention operator")
        scheduler_config.async_scheduling = False
