"""Patches of vLLM where it has no hook, one module per target, each naming the upstream
limitation it works around and when to remove it. ``apply()`` is idempotent; it runs in every
vLLM process: the ``ascend_patches`` general plugin (the engine core has no platform hook before
its executor starts), the platform's config hook and the worker's device set-up."""


def apply() -> None:
    from vllm_ascend.patch import (engine_core_client, qwen2_vl_image_processor, ray_placement,
                                   torch_accelerator, triton_placeholder, v2_triton_check)

    engine_core_client.apply()
    qwen2_vl_image_processor.apply()
    ray_placement.apply()
    torch_accelerator.apply()
    triton_placeholder.apply()
    v2_triton_check.apply()
