"""The simulated device's matrix multiplications in bfloat16 and float16 (aten's mm and addmm).

The chip's cube unit multiplies bf16/fp16 matrices with float32 accumulation and rounds each
result once. torch's CPU kernels for those dtypes do the same arithmetic, at about a sixth of
the float32 speed on a CPU without bf16 instructions (measured on this project's machine, a
2-core AVX2 EPYC: 10 GFLOP/s for a [512, 576] x [576, 3072] bf16 product, 65 in float32), which
made vLLM's default start-up (a profile run of 8192 tokens, then 86 graph captures) take 18
minutes on SmolLM2-135M. From ``FP32_FROM_ROWS`` rows on, the simulator computes such products in
float32 and rounds once, as the chip does, reading a model's weight through a float32 copy made
once (``_Copies``; converting it at every call cost more than the product); fewer rows keep
torch's own kernel, which is faster there (1 row: 0.37 ms vs 1.40 ms for the same product with
the weight converted).

Batch invariance is kept, so a graph's padded batch computes each real row exactly as the eager
step does. torch's bf16 kernel does not give a row the same bits whatever the other rows on
every CPU: on an AVX-512-BF16 EPYC, one row of a [1, 1536] x [1536, 576] product differs from
the same row among eight (a vector kernel for one row), while 2 to 8 rows give each row the
same bits (tests/ut/test_sim_matmul.py checks every row count from 1 to 8). So a product of one
row runs as two, the row repeated, which costs what one row costs: the weights are read once
either way (padding every small product to 8 rows cost a batch-1 SmolLM2 step 1.8 ms). Nor
does MKL's float32 kernel keep a row's bits: on an AVX-512 Xeon with 2 threads, a row of a
[m, 1536] x [1536, 576] product has other bits for m <= 192 than for m >= 208
(it splits the sum differently by row count). What every CPU measured keeps is one call's shape:
a row's bits depend on neither the other rows' values nor its place among them
(tests/ut/test_sim_matmul.py). So the float32 product runs in row blocks whose bounds are fixed
by the row index alone (16, 16, 32, 64, ..., 512 rows, then 512 at a time), the last one padded
with zero rows: row r is computed by the same call shape however many rows follow it. The switch
point is 9 rows: a step of 8 or fewer rows is padded to a capture size of at most 8 with vLLM's
default sizes (1, 2, 4, 8, 16, ...), and one of more rows to 16 or more, so eager and graph
steps take the same kernel.

Batch invariance also lets a product whose rows are all the same, bit for bit, compute one row
and repeat it: the same bits as computing every row. vLLM's dummy batches are such products (the
profile run's 8192 tokens and the warm-up run before each capture size are token 0 at position
0, attention skipped or alike in every request), and they were most of an engine's start here.
The check costs one comparison of the rows, against a product that costs a row's comparison
times the output's width.

A model's bfloat16 weight (an nn.Parameter) is read by its products of 1 to 8 rows, eager and
replayed, through oneDNN's packed copy of it (``_Copies``): torch's kernel reorders the weight at
every call, which made the products of a SmolLM2 decode step cost about twice their reads. The
bits are those of torch's kernel (tests/ut/test_sim_matmul.py); the copy is made again when the
weight may have been written. oneDNN packs bf16 weights only on a CPU with AVX-512 (BW, VL, DQ)
or AVX-NE-CONVERT (``cpu_packs_bf16``, asked once at ``install()``); elsewhere (an AVX2 CPU)
every product keeps torch's kernel.

On a CPU with bf16 instructions (AVX512_BF16 or AMX-BF16: ``cpu_has_bf16``, read once from the
CPU's flags, not timed, so every process of a machine takes the same kernel), a weight's
products of 9 rows or more read the same packed copy with oneDNN's bf16 kernel (float32 sums,
rounded once), in the float32 product's fixed row blocks: there float32 was the slower choice
(a 2-core AMX Xeon, 16 rows: SmolLM2's LM head 1.8 ms in bf16 against 5.0 from the float32
copy, a [16, 576] x [576, 1536] projection 0.07 against 0.15 ms; 128 rows: 5.2 against 22.7
ms), and one pack replaces the float32 copy. Within one call shape oneDNN's bf16 kernel gives a
row the same bits whatever the other rows and its place (tests/ut/test_sim_matmul.py), as
MKL's float32 kernel does, so the blocks keep batch invariance; the bits are the chip's
arithmetic either way, but not the same bits as the float32 path's.

Installed once, by ``install()``, in a process that opens a simulated device (its CPU is the
device from then on): aten's CPU kernels for mm and addmm (functional and ``.out``) are replaced
in that process, and call the originals for every other dtype.
"""

import weakref

import torch

from vllm_ascend.device.sim import acl as _acl
from vllm_ascend.device.sim import library_caches as _caches
from vllm_ascend.device.sim import memory as _memory

FP32_FROM_ROWS = 9
ONE_ROW_PADDED_TO = 2  # a one-row product runs torch's kernel on this many rows
FIRST_BLOCK, LAST_BLOCK = 16, 512  # the float32 product's row blocks: 16, 16, 32, ..., 512
_LOW = (torch.bfloat16, torch.float16)
_ORIGINAL: dict = {}
_LIB = None


def _fast(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype in _LOW and a.dtype == b.dtype and a.dim() == 2 and b.dim() == 2
            and a.shape[0] >= FP32_FROM_ROWS)


def _product_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in float32: one row's product repeated if every row is the same, bit for bit. A
    model's weight is read through its float32 copy (``_Copies.wide``)."""
    n, b32 = a.shape[0], _wide(b)
    if rows_alike(a):
        return _padded_product(a[:1], b32).expand(n, -1).contiguous()
    return _padded_product(a, b32)


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def rows_alike(x: torch.Tensor) -> bool:
    """Whether x has more than one row (first dimension) and every row is the first, bit for
    bit (-0.0 and +0.0 differ, NaNs compare as bits)."""
    if x.dim() == 0 or x.shape[0] < 2:
        return False
    bits = x.view(_BITS[x.element_size()])
    return torch.equal(bits[-1], bits[0]) and bool((bits == bits[:1]).all())


def _row_blocks(n: int):
    """(start, rows) of the fixed blocks that cover n rows: 16, 16, 32, 64, ..., 512, 512, ..."""
    start, rows = 0, FIRST_BLOCK
    while start < n:
        yield start, rows
        start += rows
        rows = min(start, LAST_BLOCK)


def _padded_product(a: torch.Tensor, b32: torch.Tensor) -> torch.Tensor:
    """a @ b32 in float32, block by fixed row block, the last padded (batch-invariant)."""
    n = a.shape[0]
    out = torch.empty(n, b32.shape[1], dtype=torch.float32)
    for start, rows in _row_blocks(n):
        block = torch.zeros(rows, a.shape[1], dtype=torch.float32)
        real = min(rows, n - start)
        block[:real].copy_(a[start:start + real])
        out[start:start + real] = _ORIGINAL["mm"](block, b32)[:real]
    return out


def _one_row(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype in _LOW and a.dtype == b.dtype and a.dim() == 2 and b.dim() == 2
            and a.shape[0] == 1)


def _padded_rows(a: torch.Tensor) -> torch.Tensor:
    """The rows torch's kernel is given: one row repeated to ONE_ROW_PADDED_TO rows (a view),
    torch's kernel for several rows, which gives row 0 the same bits whatever the others hold;
    more rows as they are."""
    return a.expand(ONE_ROW_PADDED_TO, -1) if a.shape[0] == 1 else a


def _mm(keyset, a, b):
    weight = _weight_of(a, b)
    if weight is not None:
        return _read_packed(a, weight, None)
    if _one_row(a, b):
        return _ORIGINAL["mm"].call_boxed(keyset, _padded_rows(a), b)[: a.shape[0]]
    if not _fast(a, b):
        return _ORIGINAL["mm"].call_boxed(keyset, a, b)
    return _product_fp32(a, b).to(a.dtype)


def _mm_out(keyset, a, b, *, out):
    weight = _weight_of(a, b)
    if weight is not None:
        return out.copy_(_read_packed(a, weight, None))
    if _one_row(a, b):
        return out.copy_(_mm(keyset, a, b))
    if not _fast(a, b):
        return _ORIGINAL["mm.out"].call_boxed(keyset, a, b, out=out)
    return out.copy_(_product_fp32(a, b))


def _addmm_fp32(bias, a, b, beta, alpha) -> torch.Tensor:
    product = _product_fp32(a, b)
    if alpha != 1:
        product.mul_(alpha)
    if beta != 0:
        product.add_(bias.to(torch.float32), alpha=beta)
    return product


def _addmm(keyset, bias, a, b, *, beta=1, alpha=1):
    weight = _weight_of(a, b, bias, beta, alpha)
    if weight is not None:
        return _read_packed(a, weight, bias)
    if _one_row(a, b) and (bias.dim() < 2 or bias.shape[0] == 1):  # a bias row, broadcast
        return _ORIGINAL["addmm"].call_boxed(keyset, bias, _padded_rows(a), b, beta=beta,
                                             alpha=alpha)[: a.shape[0]]
    if not _fast(a, b) or bias.dtype != a.dtype:
        return _ORIGINAL["addmm"].call_boxed(keyset, bias, a, b, beta=beta, alpha=alpha)
    return _addmm_fp32(bias, a, b, beta, alpha).to(a.dtype)


def _addmm_out(keyset, bias, a, b, *, beta=1, alpha=1, out):
    weight = _weight_of(a, b, bias, beta, alpha)
    if weight is not None:
        return out.copy_(_read_packed(a, weight, bias))
    if _one_row(a, b) and (bias.dim() < 2 or bias.shape[0] == 1):
        return out.copy_(_addmm(keyset, bias, a, b, beta=beta, alpha=alpha))
    if not _fast(a, b) or bias.dtype != a.dtype:
        return _ORIGINAL["addmm.out"].call_boxed(keyset, bias, a, b, beta=beta, alpha=alpha,
                                                 out=out)
    return out.copy_(_addmm_fp32(bias, a, b, beta, alpha))


_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_KERNELS = {"mm": _mm, "mm.out": _mm_out, "addmm": _addmm, "addmm.out": _addmm_out}


def prepare_linear(targets, x, weight, bias=None):
    """aten.linear as a graph replay writes it into its output (sim/replay.py), prepared once for
    these captured tensors, which every replay reads again: the views a product reads are made
    now. A bfloat16 product of at most 8 rows reads its weight packed (``_Copies``); other small
    products call torch's kernel directly, as ``_mm`` does for the rows fixed at capture (a
    batch-1 SmolLM2 replay's 120 products took 1 ms more through linear's decomposition and the
    boxed call into Python)."""
    out = targets[0]
    if x.dim() != 2 or _LIB is None:
        return lambda *_, **__: torch._C._nn.linear(x, weight, bias, out=out)
    owner = _parameter_of(weight)  # a capture passes a parameter's plain alias
    if owner is not None and _packable(x, owner, bias):
        copies, rows, n = _copies_of(owner), _padded_rows(x), x.shape[0]
        return lambda *_, **__: out.copy_(copies.product(rows, owner, bias)[:n])
    if bias is not None:  # linear's addmm
        return lambda *_, **__: torch._C._nn.linear(x, weight, bias, out=out)
    transposed = weight.t()
    if _one_row(x, transposed):
        kernel, rows = _ORIGINAL["mm"].kernel.call_boxed, _padded_rows(x)
        return lambda *_, **__: out.copy_(kernel(_CPU_KEYS, rows, transposed)[:1])
    if not _fast(x, transposed):  # as _mm_out: torch's kernel, for the rows fixed at capture
        kernel = _ORIGINAL["mm.out"].kernel.call_boxed
        return lambda *_, **__: kernel(_CPU_KEYS, x, transposed, out=out)
    return lambda *_, **__: _mm_out(_CPU_KEYS, x, transposed, out=out)


# -- a weight's copies ---------------------------------------------------------------------------
PACKED_FOR_ROWS = 8  # oneDNN packs for this many rows; the bits are the same for 1 to 8
_COPIES: dict = {}  # (storage address, offset, shape) -> _Copies
_DATA_TAKEN = [0]  # `.data` taken of any tensor in this process
_BF16 = torch.bfloat16
_LINEAR = torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() \
    else None
_CPU_PACKS = [False]  # set by install(): whether this CPU's oneDNN packs bf16 weights
_CPU_BF16 = [False]  # set by install(): whether products of 9+ rows read the pack (bf16 CPUs)
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # the CPU flags (Linux's names) of bf16 dot products


def cpu_packs_bf16() -> bool:
    """Whether oneDNN packs a bf16 weight on this CPU: it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and refuses elsewhere ("bf16 path needs the cpu support ..."); an AVX2 CPU
    keeps torch's kernel for every product. Asked once, by packing a small weight."""
    if _LINEAR is None:
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=_BF16),
                                                PACKED_FOR_ROWS)
    except RuntimeError:
        return False
    return True


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512_BF16 or AMX-BF16), by its
    flags: a CPU without them, or a system that does not say, keeps the float32 path."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        return False
    return any(flag in flags for flag in BF16_FLAGS)


def _packable(x, weight, bias) -> bool:
    return (_CPU_PACKS[0] and x.dtype is _BF16 and weight.dtype is _BF16
            and (x.shape[0] < FP32_FROM_ROWS or _CPU_BF16[0])
            and x.is_contiguous() and weight.dim() == 2
            and weight.is_contiguous() and x.shape[1] == weight.shape[1]
            and not weight.is_inference()
            and (bias is None or (bias.dtype is _BF16 and bias.dim() == 1)))


def _copies_of(weight) -> "_Copies":
    """The copies of ``weight``'s memory, shared by every product that reads it."""
    storage = weight.untyped_storage()
    key = (storage.data_ptr(), weight.storage_offset(), tuple(weight.shape))
    copies = _COPIES.get(key)
    if copies is None or copies.storage() is not storage:
        copies = _COPIES[key] = _Copies(storage)
        weakref.finalize(storage, _COPIES.pop, key, None)
    return copies


def release_copies() -> None:
    """The device's last worker shut down: every copy of a weight goes (a later product makes
    its weight's again). vLLM's compiled code keeps a model's parameters alive after its engine
    in the same process, and would keep their copies (270 MB packed and 540 MB in float32 an
    engine of SmolLM2)."""
    for copies in _COPIES.values():
        copies.stamp = copies.packed = copies.wide = None


class _Copies:
    """A model's weight (an nn.Parameter [n, k], bfloat16 or float16) as the simulator's
    products read it, made once and again only when the weight may have been written:

    - ``packed``: oneDNN's blocked copy of a bfloat16 weight, which its products of 1 to 8 rows
      read, eager or replayed (and those of 9 or more on a CPU with bf16 instructions).
      torch's bf16 kernel hands oneDNN the plain weight, which it reorders into such a layout
      at every call (a SmolLM2 step's 121 products of one row: 6.1 ms packed, 12-15 ms through
      torch's kernel, 13.7 through oneDNN's given the plain weight). The bits are those
      torch's kernel gives 1 to 8 rows (one padded to two) on this project's CPU, which
      tests/ut/test_sim_matmul.py checks: a CPU where they differ fails it. (Checking at run
      time made two oneDNN primitives, kept in its cache, for each row count and shape: 63 MB
      more in a SmolLM2 capture, which the simulator counts as the device's.)
    - ``wide``: the weight in float32, which its products of 9 rows or more read (a CPU
      without bf16 instructions, or a float16 weight). Converting the weight at every call
      cost more than the product (SmolLM2's LM head at 16 rows on an AVX2 CPU: 75.2 ms
      converted, 24.6 from the copy); the same bits: a conversion is exact.

    The copies are the simulator's host memory, not the device's (sim/memory.py does not count
    them). They are made again before a product when the weight may have been written since:
    its version counter moved (an in-place op on it or on a view of it), its memory moved, a
    ``.data`` of any tensor was taken (vLLM's weight loaders write through ``param.data``,
    which has a counter of its own), or ACL mapped or copied into device memory (sleep mode:
    acl.raw_writes). A write none of these sees, a collective or a NumPy array writing into the
    weight's memory, is missed: the product then reads the weight as it was copied."""

    def __init__(self, storage):
        self.storage = weakref.ref(storage)
        self.stamp, self.packed, self.wide = None, None, None

    def _fresh(self, weight) -> None:
        stamp = (weight._version, _DATA_TAKEN[0], _acl.raw_writes(), weight.data_ptr())
        if stamp != self.stamp:
            self.stamp, self.packed, self.wide = stamp, None, None

    def product(self, rows, weight, bias):
        """rows @ weight.T (+ bias), rows as ``_mm`` gives them to torch's kernel; 9 rows or
        more (a CPU with bf16 instructions) in the fixed row blocks."""
        self._fresh(weight)
        if self.packed is None:
            self.packed = _packed(weight)
        if rows.shape[0] >= FP32_FROM_ROWS:
            return _packed_blocks(rows, self.packed, weight.shape, bias)
        return _linear_packed(rows, self.packed, weight.shape, bias)

    def float32(self, weight) -> torch.Tensor:
        """``weight`` in float32."""
        self._fresh(weight)
        if self.wide is None:
            self.wide = _held(weight.to(torch.float32))
        return self.wide


@_caches.first_calls_measured(lambda rows, packed, shape, bias: (rows.shape, shape, bias is None))
def _linear_packed(rows, packed, shape, bias):
    """oneDNN's bf16 product of rows with a packed weight of ``shape`` (+ bias)."""
    return _LINEAR(rows, packed, bias, "none", [], "")


def _packed_blocks(rows, packed, shape, bias):
    """rows @ weight.T (+ bias) through the packed weight, in the float32 product's row blocks
    (``_row_blocks``), the last padded with zero rows; one row's if every row is alike."""
    n = rows.shape[0]
    if rows_alike(rows):
        return _packed_blocks(rows[:1], packed, shape, bias).expand(n, -1).contiguous()
    if n == FIRST_BLOCK:  # a decode step of 16: one block, nothing to pad or gather
        return _linear_packed(rows, packed, shape, bias)
    out = torch.empty(n, shape[0], dtype=rows.dtype)
    for start, size in _row_blocks(n):
        real = min(size, n - start)
        block = rows[start:start + size]
        if real < size:
            block = rows.new_zeros(size, rows.shape[1])
            block[:real].copy_(rows[start:start + real])
        out[start:start + real] = _linear_packed(block, packed, shape, bias)[:real]
    return out


def _wide(b: torch.Tensor) -> torch.Tensor:
    """b in float32: a model's weight seen transposed (aten.linear's view) through its copy."""
    weight = _parameter_of(b.t()) if b._base is not None else None
    if weight is None or weight.is_inference():
        return b.to(torch.float32)
    return _copies_of(weight).float32(weight).t()


def _read_packed(a, weight, bias):
    rows = _padded_rows(a)
    return _copies_of(weight).product(rows, weight, bias)[: a.shape[0]]


def _parameter_of(t):
    """The model's weight (an nn.Parameter) t is, itself or its alias. Other tensors change
    from call to call (activations, LoRA's stacked weights) and are not packed."""
    if isinstance(t, torch.nn.Parameter):
        return t
    base = t._base
    if (isinstance(base, torch.nn.Parameter) and t.data_ptr() == base.data_ptr()
            and t.shape == base.shape and t.stride() == base.stride()):
        return base
    return None


def _weight_of(a, b, bias=None, beta=1, alpha=1):
    """The weight whose pack an eager product a @ b (+ bias) reads: a model's parameter
    [n, k] seen transposed (aten.linear's view), with 1 to 8 rows of a."""
    if beta != 1 or alpha != 1 or b.dim() != 2 or b._base is None:
        return None
    weight = _parameter_of(b.t())
    if weight is None or not _packable(a, weight, bias):
        return None
    return weight


def _packed(weight):
    heap = _memory.heap()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)
    nbytes = _memory.heap() - heap  # the simulator's host memory, not the device's
    _memory.simulator_holds(nbytes)
    weakref.finalize(packed, _memory.simulator_holds, -nbytes)
    return packed


def _held(copy: torch.Tensor) -> torch.Tensor:
    """A copy the simulator holds for itself: host memory, not the device's."""
    size = copy.untyped_storage().nbytes()
    _memory.simulator_holds(size)
    weakref.finalize(copy, _memory.simulator_holds, -size)
    return copy


_DATA = torch._C.TensorBase.data


def _data_get(tensor):
    _DATA_TAKEN[0] += 1
    return _DATA.__get__(tensor)


class _Original:
    """torch's own CPU kernel of an op, callable with or without a dispatch key set. Its first
    call for a bf16/fp16 shape is measured (``measured_once``)."""

    def __init__(self, name: str):
        self.name = name
        self.kernel = torch.library.get_kernel(f"aten::{name}", "CPU")

    def call_boxed(self, keyset, *args, **kwargs):
        a, b = args[-2], args[-1]  # mm(a, b), addmm(bias, a, b)
        if a.dtype in _LOW and "out" not in kwargs:
            key = (self.name, a.shape, b.shape, a.dtype, b.stride())
            if key not in _caches._MEASURED:  # (measured_once marks it, then calls back)
                return _caches.measured_once(
                    key, lambda: self.call_boxed(keyset, *args, **kwargs))
        return self.kernel.call_boxed(keyset, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.kernel.call_boxed(_CPU_KEYS, *args, **kwargs)


def install() -> None:
    """Replace aten's CPU mm/addmm kernels in this process (once)."""
    global _LIB
    if _LIB is not None:
        return
    import warnings

    for name in _KERNELS:
        _ORIGINAL[name] = _Original(name)
    _CPU_PACKS[0] = cpu_packs_bf16()
    _CPU_BF16[0] = _CPU_PACKS[0] and cpu_has_bf16()
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": on purpose
        warnings.simplefilter("ignore", UserWarning)
        for name, kernel in _KERNELS.items():
            lib.impl(name, kernel, "CPU", with_keyset=True)
    # `.data` is a tensor with a version counter of its own: a write through it (vLLM's weight
    # loaders) moves no counter a packed weight can check, so taking it is counted instead.
    torch.Tensor.data = property(_data_get, _DATA.__set__, doc=_DATA.__doc__)
    _LIB = lib
