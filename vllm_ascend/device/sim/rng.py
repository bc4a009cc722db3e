"""The simulated device's exponential random numbers (aten's ``exponential_``).

vLLM's sampler draws one exponential number per vocabulary entry and request at every step of
random sampling (``random_sample``: the probabilities over exponential noise, then argmax): a
[16, 49152] draw for SmolLM2 at 16 requests. torch's CPU kernel draws them one at a time: 12.8
ms for that draw on a 2-core AMX Xeon, about a quarter of a served SmolLM2 decode step there
(2.1 ms for as many uniform numbers; a chip draws them in a vector kernel).
The simulator's kernel takes a uniform draw from the same generator and maps it as
``-log(u) / lambd``, with u in [tiny, 1): every value finite and above zero, as vLLM's
division by the noise needs. The numbers differ from torch's CPU kernel for the same generator
state, as a chip's do; a seeded generator gives the same numbers every time.

Installed once, by ``install()``, in a process that opens a simulated device (with the
matrix products: sim/npu.py); other dtypes keep torch's kernel.
"""

import warnings

import torch

_FLOATS = (torch.float32, torch.float64)
_ORIGINAL: list = []
_LIB: list = []


def _exponential_(keyset, self, lambd=1.0, *, generator=None):
    if self.dtype not in _FLOATS:
        return _ORIGINAL[0].call_boxed(keyset, self, lambd, generator=generator)
    torch._check(lambd > 0, lambda: f"exponential_ expects lambda > 0.0, but found "
                                    f"lambda={lambd}")
    self.uniform_(generator=generator).clamp_min_(torch.finfo(self.dtype).tiny).log_().neg_()
    return self if lambd == 1 else self.div_(lambd)


def install() -> None:
    """Replace aten's CPU ``exponential_`` in this process (once)."""
    if _LIB:
        return
    _ORIGINAL.append(torch.library.get_kernel("aten::exponential_", "CPU"))
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": on purpose
        warnings.simplefilter("ignore", UserWarning)
        lib.impl("exponential_", _exponential_, "CPU", with_keyset=True)
    _LIB.append(lib)
