"""Patches of vLLM where it has no hook, one module per target, each naming the upstream
limitation it works around and when to remove it. ``apply()`` is idempotent."""


def apply() -> None:
    from vllm_ascend.patch import engine_core_client, torch_accelerator

    engine_core_client.apply()
    torch_accelerator.apply()
