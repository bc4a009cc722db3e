"""Patch of ``torch.accelerator``: its synchronisation and memory functions reach torch_npu.

Upstream limitation (torch 2.13, vLLM 0.32): vLLM asks ``torch.accelerator`` to synchronise,
empty the cache and measure memory (``MemorySnapshot``, ``memory_profiling``, shutdown), and
torch routes those through c10's ``DeviceAllocator``, which torch_npu's caching allocator is not
("Allocator for npu is not a DeviceAllocator"; upstream vllm-ascend redirects them in
patch/platform/patch_torch_accelerator.py). Where torch has no accelerator at all (the simulator
on a CPU build) they raise or answer for the host. Redirected here to the ``torch_npu.npu``
functions of the same meaning, on the chip and on the simulator alike, so that the KV-cache
budget is profiled from the device's free memory as upstream does. Remove when torch_npu
registers a ``DeviceAllocator``.
"""

import torch

from vllm_ascend.device import torch_npu

_ROUTES = {  # torch.accelerator name -> torch.npu name
    "synchronize": "synchronize",
    "empty_cache": "empty_cache",
    "get_memory_info": "mem_get_info",
    "memory_stats": "memory_stats",
    "memory_allocated": "memory_allocated",
    "memory_reserved": "memory_reserved",
    "max_memory_allocated": "max_memory_allocated",
    "reset_peak_memory_stats": "reset_peak_memory_stats",
}


def _route(npu_name: str):
    # A function of its own: Dynamo registers a handler per function object, and torch.cuda's
    # names already point at the same torch.npu functions (model_runner.point_torch_cuda_at_npu).
    def routed(*args, **kwargs):
        return getattr(torch_npu.npu, npu_name)(*args, **kwargs)

    routed.__name__ = routed.__qualname__ = npu_name
    return routed


def apply() -> None:
    for name, npu_name in _ROUTES.items():
        if getattr(getattr(torch.accelerator, name), "__module__", None) != __name__:
            setattr(torch.accelerator, name, _route(npu_name))
