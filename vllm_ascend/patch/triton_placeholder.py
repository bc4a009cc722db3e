"""Patch of vLLM's Triton placeholder: ``triton.next_power_of_2`` for Model Runner V2's hosts.

Upstream limitation (vLLM 0.32): where Triton does not import, ``vllm.triton_utils.triton`` is a
``TritonPlaceholder`` with ``cdiv`` but not ``next_power_of_2``, which Model Runner V2's kernel
wrappers call on the host to size a launch (input_batch.py) even when the platform overrides
the kernel (``vllm.triton_utils.dispatcher``). Added here, with Triton's meaning, only to the
placeholder. Remove when the placeholder carries it.
"""

import vllm.triton_utils as triton_utils
from vllm.triton_utils.importing import TritonPlaceholder


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (Triton's, for n >= 0)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def apply() -> None:
    if isinstance(triton_utils.triton, TritonPlaceholder):
        triton_utils.triton.next_power_of_2 = next_power_of_2
