"""The simulated device's bf16/fp16 matrix products (vllm_ascend/device/sim/matmul.py): float32
arithmetic rounded once, fast from 9 rows on, and batch-invariant, so that a graph's padded batch
computes each real row exactly as the eager step. Both paths of a weight's products of 9 rows or
more run on any CPU that packs (the bf16 kernel is emulated where the CPU has no bf16
instructions): the tests choose the path (``matmul._CPU_BF16``), the CPU's flags choose it in an
engine."""

import gc

import pytest
import torch

from vllm_ascend.device.sim import library_caches, matmul, memory, npu
from vllm_ascend.device_allocator.vmm import NPUMemAllocator

BF16 = torch.bfloat16

# (in, out) features of the tiny test models' and SmolLM2's projections, and SmolLM2's LM head.
SHAPES = [(64, 192), (64, 256), (128, 64), (576, 3072), (1536, 576), (576, 192), (576, 49152),
          (2048, 1024), (7168, 512)]


@pytest.fixture(scope="module", autouse=True)
def installed():
    matmul.install()  # (the device fixture opens a simulated device, which installs it too)


# oneDNN packs bf16 weights on an AVX-512 (or AVX-NE-CONVERT) CPU only; elsewhere every product
# keeps torch's kernel, and the tests of packs have nothing to test.
PACKS = matmul.cpu_packs_bf16()
needs_packs = pytest.mark.skipif(not PACKS, reason="this CPU's oneDNN does not pack bf16 "
                                 "weights (no AVX-512): every product keeps torch's kernel")
# A weight's products of 9 rows or more: float32 from its float32 copy (any CPU), or oneDNN's
# bf16 kernel on its pack (where it packs; what a CPU with bf16 instructions takes).
WIDE_PATHS = [pytest.param(False, id="float32"),
              pytest.param(True, id="bf16-pack", marks=needs_packs)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n", SHAPES)
def test_each_row_is_computed_alike_whatever_the_other_rows(dtype, k, n):
    """Within each kernel (torch's below 9 rows, float32 from 9 on): a step padded to a capture
    size takes the same kernel as unpadded when the padding does not cross 9 rows, which vLLM's
    default capture sizes (..., 8, 16, ...) never make it do. (MKL's own float32 kernel fails this
    at k=1536 on AVX-512: a 192-row product differs from its rows among 1100.)"""
    torch.manual_seed(0)
    w, bias = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
    x = torch.randn(1100, k).to(dtype)
    rows_fp32 = (9, 15, 16, 17, 24, 100, 200, 256, 512, 520, 1024, 1100)
    for rows, last in ((range(1, 9), 8), (rows_fp32, 1100)):
        full = torch.nn.functional.linear(x[:last], w)
        full_bias = torch.nn.functional.linear(x[:last], w, bias)
        for r in rows:
            assert torch.equal(torch.nn.functional.linear(x[:r], w), full[:r]), r
            assert torch.equal(torch.nn.functional.linear(x[:r], w, bias), full_bias[:r]), r


def test_float32_products_run_in_blocks_fixed_by_the_row_index(monkeypatch):
    """The test above shows batch invariance only where MKL's own kernel breaks it (an AVX-512
    Xeon); on a CPU where it does not, the blocks themselves are checked: every call MKL gets
    has the row count of a fixed block (16, 16, 32, ..., 512, 512), the last padded."""
    calls = []
    original = matmul._ORIGINAL["mm"]
    monkeypatch.setitem(matmul._ORIGINAL, "mm",
                        lambda a, b: calls.append(a.shape[0]) or original(a, b))
    w, x = torch.randn(64, 32).bfloat16(), torch.randn(1100, 32).bfloat16()
    x @ w.t()
    assert calls == [16, 16, 32, 64, 128, 256, 512, 512]
    calls.clear()
    x[:9] @ w.t()
    assert calls == [16]


@pytest.mark.parametrize("rows", [4, 9, 64])
def test_products_are_float32_sums_rounded_once(rows):
    torch.manual_seed(1)
    w, x = torch.randn(3072, 576).bfloat16(), torch.randn(rows, 576).bfloat16()
    exact = (x.double() @ w.double().t()).bfloat16()
    got = x @ w.t()
    # float32 accumulation differs from the exact sum in the last bits of a few elements
    assert (got != exact).float().mean() < 1e-3
    assert (got.float() - exact.float()).abs().max() <= exact.float().abs().max() * 2 ** -7


def test_out_variants_addmm_scalars_and_other_dtypes():
    torch.manual_seed(2)
    a, b, c = torch.randn(32, 64).bfloat16(), torch.randn(64, 48).bfloat16(), torch.randn(48)
    out = torch.empty(32, 48, dtype=torch.bfloat16)
    torch.mm(a, b, out=out)
    assert torch.equal(out, a @ b)
    bias = c.bfloat16()
    got = torch.addmm(bias, a, b, beta=0.5, alpha=2.0)
    ref = (0.5 * bias.float() + 2.0 * (a.float() @ b.float())).bfloat16()
    assert (got.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2 ** -7
    torch.addmm(bias, a, b, out=out)
    assert torch.equal(out, torch.addmm(bias, a, b))
    for dtype in (torch.float32, torch.float64):  # untouched: torch's own kernels
        x, y = torch.randn(20, 8, dtype=dtype), torch.randn(8, 4, dtype=dtype)
        assert torch.equal(x @ y, matmul._ORIGINAL["mm"](x, y))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [9, 16, 100, 512])
def test_rows_all_alike_take_one_rows_product_with_the_same_bits(dtype, rows, monkeypatch):
    """vLLM's dummy batches (every row token 0 at position 0): one row's product, repeated, gives
    what computing every row gives; a row that differs in one bit, or only in a zero's sign,
    takes the whole product."""
    torch.manual_seed(3)
    w, bias = torch.randn(3072, 576).to(dtype), torch.randn(3072).to(dtype)
    alike = torch.randn(1, 576).to(dtype).expand(rows, -1).contiguous()
    alike[:, 7] = 0.0
    whole = matmul._padded_product
    computed = []
    monkeypatch.setattr(matmul, "_padded_product",
                        lambda a, b: computed.append(a.shape[0]) or whole(a, b))
    got, got_bias = alike @ w.t(), torch.nn.functional.linear(alike, w, bias)
    assert computed == [1, 1]
    assert torch.equal(got, whole(alike, w.t().float()).to(dtype))
    assert torch.equal(got_bias, (whole(alike, w.t().float()) + bias.float()).to(dtype))
    for i, value in ((rows - 1, -0.0), (rows // 2, 1e-3)):
        differs = alike.clone()
        differs[i, 7] = value
        computed.clear()
        assert torch.equal(differs @ w.t(), whole(differs, w.t().float()).to(dtype))
        assert computed == [rows]


def parameter(*shape) -> torch.nn.Parameter:
    """A model's weight: a bf16 parameter, made outside inference mode."""
    return torch.nn.Parameter(torch.randn(*shape).to(BF16), requires_grad=False)


def twin(w: torch.nn.Parameter) -> torch.nn.Parameter:
    """A new parameter with w's values (made outside inference mode): its products make copies
    of their own, so they give what w's products must give on the path a test chose."""
    return torch.nn.Parameter(w.detach().clone(), requires_grad=False)


@pytest.mark.parametrize("bf16", WIDE_PATHS)
@pytest.mark.parametrize("k,n", SHAPES)
def test_a_parameters_rows_are_computed_alike_whatever_the_other_rows(bf16, k, n, monkeypatch):
    """The test above for a model's weight, on both of its paths from 9 rows on: oneDNN's bf16
    kernel keeps a row's bits within one call shape (checked on a 2-core AMX Xeon), and the
    fixed row blocks make every row's call shape independent of the rows after it."""
    monkeypatch.setattr(matmul, "_CPU_BF16", [bf16])
    torch.manual_seed(0)
    w, bias, x = parameter(n, k), torch.randn(n).to(BF16), torch.randn(1100, k).to(BF16)
    with torch.inference_mode():
        full = torch.nn.functional.linear(x, w)
        full_bias = torch.nn.functional.linear(x, w, bias)
        for r in (9, 15, 16, 17, 24, 100, 200, 256, 512, 520, 1024):
            assert torch.equal(torch.nn.functional.linear(x[:r], w), full[:r]), r
            assert torch.equal(torch.nn.functional.linear(x[:r], w, bias), full_bias[:r]), r
    assert (matmul._copies_of(w).wide is None) == bf16


@needs_packs
def test_a_bf16_cpu_reads_the_pack_in_fixed_row_blocks(monkeypatch):
    """On a CPU with bf16 instructions a weight's products of 9 rows or more read its pack (no
    float32 copy), packed once, in the row blocks 16, 16, 32, ..., 512, the last padded; rows
    all alike compute one row; each product is a float32 sum rounded once."""
    monkeypatch.setattr(matmul, "_CPU_BF16", [True])
    calls, packs, real_linear, real_pack = [], [], matmul._LINEAR, matmul._packed
    monkeypatch.setattr(matmul, "_LINEAR", lambda a, *r: calls.append(a.shape[0])
                        or real_linear(a, *r))
    monkeypatch.setattr(matmul, "_packed", lambda w: packs.append(w.shape) or real_pack(w))
    torch.manual_seed(1)
    w, x = parameter(3072, 576), torch.randn(1100, 576).to(BF16)
    with torch.inference_mode():
        got = torch.nn.functional.linear(x, w)
        assert calls == [16, 16, 32, 64, 128, 256, 512, 512]
        calls.clear()
        torch.nn.functional.linear(x[:9], w)
        torch.nn.functional.linear(x[:16], w)
        assert calls == [16, 16]
        calls.clear()
        alike = x[:1].expand(100, -1).contiguous()  # row 0 of a 16-row call, as in `got`
        assert torch.equal(torch.nn.functional.linear(alike, w), got[:1].expand(100, -1))
        assert calls == [16]
    assert packs == [(3072, 576)] and matmul._copies_of(w).wide is None
    exact = (x.double() @ w.detach().double().t()).bfloat16()
    assert (got != exact).float().mean() < 1e-3
    assert (got.float() - exact.float()).abs().max() <= exact.float().abs().max() * 2 ** -7


def test_the_cpus_flags_choose_the_path_of_9_rows_or_more(tmp_path):
    """bf16 dot-product instructions (AVX512_BF16, AMX-BF16) in the CPU's flags take the pack;
    none, or no flags to read, keep the float32 copy."""
    cpuinfo = tmp_path / "cpuinfo"
    for flags, has in (("fpu avx2 avx512f avx512_bf16", True), ("fpu amx_bf16 amx_tile", True),
                       ("fpu avx2 avx512f avx512bw", False)):
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\nbugs\t\t: none\n")
        assert matmul.cpu_has_bf16(str(cpuinfo)) == has, flags
    assert not matmul.cpu_has_bf16(str(tmp_path / "missing"))
    assert matmul._CPU_BF16[0] == (PACKS and matmul.cpu_has_bf16())


@pytest.mark.parametrize("k,n", SHAPES + [(4096, 11008)])
def test_a_parameters_products_read_it_packed_with_the_plain_tensors_bits(k, n):
    """A model's bf16 weight is read through oneDNN's packed copy by its products of 1 to 8 rows
    (matmul._Copies): the bits of the same values in a plain tensor (torch's kernel), with and
    without a bias. (One row is padded to two there too: on this project's AVX-512-BF16 EPYC,
    a packed [1, 4096] x [4096, 11008] product has other bits than two rows' first.)"""
    torch.manual_seed(4)
    w, bias, x = parameter(n, k), torch.randn(n).to(BF16), torch.randn(8, k).to(BF16)
    with torch.inference_mode():
        for rows in range(1, 9):
            for b in (None, bias):
                got = torch.nn.functional.linear(x[:rows], w, b)
                assert torch.equal(got, torch.nn.functional.linear(x[:rows], w.detach(), b))
    pack = matmul._copies_of(w)
    # Read packed where the CPU packs; elsewhere never packed (nor refused: torch's kernel).
    assert (pack.stamp is not None and pack.packed is not None) == PACKS
    assert matmul._CPU_PACKS[0] == PACKS


def test_the_cpu_is_asked_once_whether_it_packs(monkeypatch):
    """Whether products read packed weights is the CPU's answer to one small pack at install:
    a CPU whose oneDNN refuses (AVX2: "bf16 path needs the cpu support ...") gets torch's
    kernel for every product, not an error at the first one."""
    def refuse(*args):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support "
                           "avx_ne_convert or avx512bw, avx512vl and avx512dq")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    assert not matmul.cpu_packs_bf16()
    monkeypatch.setattr(matmul, "_CPU_PACKS", [False])
    w, x = parameter(32, 16), torch.randn(2, 16).to(BF16)
    with torch.inference_mode():
        assert torch.equal(torch.nn.functional.linear(x, w),
                           torch.nn.functional.linear(x, w.detach()))
    assert matmul._copies_of(w).packed is None


# A weight's copies: packed for 2 rows (where the CPU packs), float32 for 16 rows (any CPU), the
# pack for 16 rows (a CPU with bf16 instructions; any CPU that packs, in the tests).
COPIES = [pytest.param(2, "packed", marks=needs_packs), (16, "wide"),
          pytest.param(16, "packed", marks=needs_packs, id="16-packed-bf16")]


@pytest.fixture
def path_of(monkeypatch):
    """Sets the path a test's products of ``rows`` rows read ``copy`` by."""
    def choose(rows, copy):
        monkeypatch.setattr(matmul, "_CPU_BF16", [rows >= 9 and copy == "packed"])
    return choose


@pytest.mark.parametrize("rows,copy", COPIES)
@pytest.mark.parametrize("write", ["in_place", "through_data", "device_memory"])
def test_a_copied_weight_is_read_as_last_written(write, rows, copy, path_of):
    """Eager and replayed products read a weight's copy (packed for 1 to 8 rows, float32 or
    packed from 9), which is made again after a write by any path the simulator sees: an
    in-place op (the version counter), ``.data`` (vLLM's weight loaders) and ACL's device
    memory (sleep mode's discard and wake-up, after which the contents are undefined: zeros
    here)."""
    path_of(rows, copy)
    allocator = NPUMemAllocator()
    with allocator.use_memory_pool("weights"):
        w = parameter(96, 64)
    x, before = torch.randn(rows, 64).to(BF16), twin(w)
    with torch.inference_mode():
        g = npu.NPUGraph()
        with npu.graph(g):
            out = torch.nn.functional.linear(x, w)
        g.replay()
        npu.synchronize()
        assert torch.equal(out, torch.nn.functional.linear(x, before))
        assert getattr(matmul._copies_of(w), copy) is not None
    new = torch.randn(96, 64).to(BF16)
    if write == "in_place":
        w.copy_(new)
    elif write == "through_data":
        w.data.copy_(new)
    else:
        allocator.sleep(offload_tags=())
        allocator.wake_up()
    after = twin(w)
    with torch.inference_mode():
        expected = torch.nn.functional.linear(x, after)  # copies made of the new values
        assert not torch.equal(out, expected)
        assert torch.equal(torch.nn.functional.linear(x, w), expected)
        g.replay()
        npu.synchronize()
        assert torch.equal(out, expected)


def test_a_weight_is_converted_once_for_its_products_of_9_rows_or_more(monkeypatch):
    """A model's weight is converted to float32 once, at its first product of 9 rows or more,
    not at every call (as 09e93d8 did: served SmolLM2 lost a third of its speed); a plain
    tensor (an activation, LoRA's stacked weights) is converted at each call."""
    monkeypatch.setattr(matmul, "_CPU_BF16", [False])  # (a bf16 CPU reads the pack instead)
    calls = []
    real = matmul._held
    monkeypatch.setattr(matmul, "_held", lambda copy: calls.append(copy.shape) or real(copy))
    w, x = parameter(96, 64), torch.randn(16, 64).to(BF16)
    with torch.inference_mode():
        for rows in (9, 16, 16, 100):
            got = torch.nn.functional.linear(x.repeat(7, 1)[:rows], w)
            assert torch.equal(got, torch.nn.functional.linear(x.repeat(7, 1)[:rows],
                                                               w.detach()))
    assert calls == [(96, 64)]


@pytest.mark.parametrize("rows,copy", COPIES)
def test_a_copy_lives_as_long_as_its_weights_memory_and_the_device(rows, copy, path_of):
    """A weight's copies go with its memory, and with the device's last worker (vLLM's compiled
    code keeps a model's parameters alive after its engine): a later product copies again."""
    path_of(rows, copy)
    w, x = parameter(32, 16), torch.randn(rows, 16).to(BF16)
    key = (w.untyped_storage().data_ptr(), 0, (32, 16))
    with torch.inference_mode():
        torch.nn.functional.linear(x, w)
        assert getattr(matmul._COPIES[key], copy) is not None
        npu.release_device()  # (the test's fixture opened the device)
        npu.set_device(0)
        assert getattr(matmul._COPIES[key], copy) is None
        torch.nn.functional.linear(x, w)
        assert getattr(matmul._COPIES[key], copy) is not None
    del w
    gc.collect()
    assert key not in matmul._COPIES


@pytest.mark.parametrize("rows,copy", COPIES)
def test_a_copy_is_the_simulators_memory_not_the_devices(rows, copy, path_of):
    """The simulator counts the C heap as the device's memory (sim/memory.py): a weight's
    copy is host memory a chip would not hold, so it is not counted, while it lives or after."""
    path_of(rows, copy)
    held = memory._ACCOUNT.simulator
    w, x = parameter(8192, 1024), torch.randn(rows, 1024).to(BF16)  # a 16 MB weight
    before = memory.allocated()
    with torch.inference_mode():
        torch.nn.functional.linear(x, w)
    assert memory._ACCOUNT.simulator - held >= w.nbytes
    assert memory.allocated() - before < w.nbytes // 4  # oneDNN's primitive, the output
    nbytes = w.nbytes
    del w
    gc.collect()
    # The copy goes; what oneDNN keeps for the shape stays, host memory (an AMX Xeon: 0.6 MB
    # for this shape; an AVX2 CPU: nothing).
    assert memory._ACCOUNT.simulator - held < nbytes // 4


def test_what_a_kernel_keeps_for_a_shape_is_the_simulators_memory(monkeypatch):
    """A CPU library's cache for a product's shape (oneDNN's primitive per shape and row count
    on an AVX-512 CPU; nothing on an AVX2 one) is host memory of the simulator's kernels: what a
    kernel's first call for a shape leaves on the heap beyond its result is subtracted, so the
    device's memory, and whether a capture fits, does not depend on the host's CPU."""
    monkeypatch.setattr(memory._ACCOUNT, "simulator", memory._ACCOUNT.simulator)
    monkeypatch.setattr(library_caches, "_MEASURED", set())
    kept = []

    def caching_kernel():
        kept.append(torch.empty(4 << 20, dtype=torch.uint8))  # what the library keeps: 4 MB
        return torch.ones(64, 64)

    held, before = memory._ACCOUNT.simulator, memory.allocated()
    out = library_caches.measured_once(("a kernel", (64, 64)), caching_kernel)
    assert memory._ACCOUNT.simulator - held >= 4 << 20
    assert memory.allocated() - before < 1 << 20  # the device holds the result, not the cache
    assert out.shape == (64, 64) and ("a kernel", (64, 64)) in library_caches._MEASURED
    nothing_kept = memory._ACCOUNT.simulator
    library_caches.measured_once(("another", ()), lambda: torch.ones(1 << 20))  # a 4 MB result only
    assert memory._ACCOUNT.simulator == nothing_kept
    # torch's kernel is measured at a bf16 shape's first call (its rows, the weight's shape).
    a, b = torch.randn(3, 48).to(BF16), torch.randn(48, 80).to(BF16)
    with torch.inference_mode():
        torch.mm(a, b)
    assert ("mm", a.shape, b.shape, BF16, b.stride()) in library_caches._MEASURED
