"""What the CPU libraries under the simulator's kernels keep for themselves: oneDNN's primitive
per product shape, MKL's work buffers. Host memory a chip would not hold, so the simulator's,
not the device's (sim/memory.py counts the C heap as the device's memory): measured at a
kernel's first call for a key and subtracted, so that what a capture holds, and whether it fits
the estimate, does not depend on the host's CPU."""

import functools

import torch

from vllm_ascend.device.sim import memory as _memory

_MEASURED: set = set()  # the kernels and shapes whose first call was measured
ALLOCATOR_SLACK = 64 << 10  # heap growth below this is the allocator's rounding, not a cache


def measured_once(key, call):
    """``call()``, the first call of a kernel for ``key`` (its shapes): what it leaves on the
    heap beyond its results (a tensor, several, or None for a kernel that writes into its
    outputs) is the CPU library's cache for those shapes, host memory of the simulator's
    kernels, not the device's (sim/memory.py). oneDNN keeps a primitive per shape and row
    count, some MB for a bf16 product on an AVX-512 CPU (an AVX2 CPU's kernel keeps nothing);
    MKL's memory manager keeps the work buffers of float32 products, more for each larger one.
    Counted as the device's, they grew a capture's memory past the estimate on CPUs whose
    kernels cache. (oneDNN's cache holds 1024 primitives and evicts the oldest: the count would
    then keep memory the cache gave back, a laxer reading no engine here reaches: a SmolLM2
    engine's products have a few dozen shapes.)"""
    _MEASURED.add(key)
    before = _memory.heap()
    out = call()
    results = out if isinstance(out, (tuple, list)) else (out,)
    made = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in results
            if isinstance(t, torch.Tensor)}
    left = _memory.heap() - before - sum(made.values())
    if left > ALLOCATOR_SLACK:
        _memory.simulator_holds(left)
    return out


def first_calls_measured(key_of):
    """A simulated kernel whose first call for each ``key_of(*args, **kwargs)`` is measured
    (``measured_once``): the float32 products of FIA, MLA, MoE and GDN run on MKL, whose kept
    buffers grew by several MB with each capture size's first warm-up on an AMX Xeon (vLLM's
    default FULL engine's graph estimate: 50 -> 504 MB, counted as the device's). Keyed by what
    a capture size changes (the batch), not every call: a heap reading costs about 1.4 ms in an
    engine's process (mallinfo2 walks the free lists), 80 ms a decode step at two a layer. What
    a later call of a known key leaves stays the device's, the stricter reading."""
    def wrap(kernel):
        name = kernel.__name__

        @functools.wraps(kernel)
        def counted(*args, **kwargs):
            key = (name, key_of(*args, **kwargs))
            if key in _MEASURED:
                return kernel(*args, **kwargs)
            return measured_once(key, lambda: kernel(*args, **kwargs))
        return counted
    return wrap
