"""vLLM CustomOps routed to the device's fused kernels (``forward_oot``).

Registering replaces the upstream class everywhere vLLM instantiates it. Each op keeps upstream's
``forward_native`` as the unfused reference the tests compare against.
"""

from vllm_ascend.ops import activation, layernorm, rotary_embedding  # noqa: F401
