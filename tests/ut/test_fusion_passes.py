"""The Ascend FX passes on graphs as Dynamo traces them (vllm_ascend/compilation/passes.py): each
fuses what its pattern says, leaves near misses alone, and keeps the values."""

import pytest
import torch

from vllm_ascend.compilation.passes import AscendPassManager, NormQuantFusion, QKRopeMerge
from vllm_ascend.device import torch_npu
from vllm_ascend.quantization import w8a8  # noqa: F401  (registers vllm_ascend.quantize)

T, Q, KV, HEAD = 5, 128, 64, 32


def traced(fn, *inputs):
    """fn's Dynamo graph, as vLLM's compiled pieces get it."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return graphs[0]


def apis(gm) -> list[str]:
    from vllm_ascend.compilation.passes import api

    return [a for a in map(api, gm.graph.nodes) if a]


def run_pass(pass_, fn, *inputs):
    """(what ``pass_`` fused, the API names left, fn's output before the pass, after it)."""
    gm = traced(fn, *inputs)
    expected = gm(*inputs)
    fused = pass_(gm.graph)
    gm.recompile()
    return fused, apis(gm), expected, gm(*inputs)


def same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def rope_step(qkv, cos, sin):
    """vLLM's Llama attention: split, then the RotaryEmbedding CustomOp's step path."""
    q, k, v = qkv.split([Q, KV, KV], dim=-1)
    q = torch_npu.npu_rotary_mul(q.view(1, T, -1, HEAD).contiguous(), cos, sin,
                                 rotary_mode="half")
    k = torch_npu.npu_rotary_mul(k.view(1, T, -1, HEAD).contiguous(), cos, sin,
                                 rotary_mode="half")
    return q.view(T, Q), k.view(T, KV), v


def test_q_and_k_of_one_split_rotate_in_one_call():
    qkv = torch.randn(T, Q + 2 * KV, dtype=torch.float16)
    cos, sin = torch.randn(2, 1, T, 1, HEAD, dtype=torch.float16)
    fused, calls, expected, got = run_pass(QKRopeMerge(), rope_step, qkv, cos, sin)
    assert fused == 1 and calls.count("npu_rotary_mul") == 1
    same(expected, got)


def test_rotations_with_other_tables_stay_apart():
    def two_tables(qkv, cos, sin):
        q, k, _ = qkv.split([Q, KV, KV], dim=-1)
        return (torch_npu.npu_rotary_mul(q.view(1, T, -1, HEAD).contiguous(), cos, sin),
                torch_npu.npu_rotary_mul(k.view(1, T, -1, HEAD).contiguous(), sin, cos))

    qkv = torch.randn(T, Q + 2 * KV, dtype=torch.float16)
    cos, sin = torch.randn(2, 1, T, 1, HEAD, dtype=torch.float16)
    fused, calls, _, _ = run_pass(QKRopeMerge(), two_tables, qkv, cos, sin)
    assert fused == 0 and calls.count("npu_rotary_mul") == 2


def norm_then_dynamic_quant(x, residual, gamma):
    y, _, added = torch_npu.npu_add_rms_norm(x, residual, gamma, 1e-6)
    q, scale = torch_npu.npu_dynamic_quant(y, dst_type=torch.int8)
    return q, scale, added


def norm_then_static_quant(x, residual, gamma, scale, offset):
    y, _, added = torch_npu.npu_add_rms_norm(x, residual, gamma, 1e-6)
    return torch.ops.vllm_ascend.quantize.default(y, scale, 1 / scale, offset), added


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_norm_read_only_by_the_quantization_fuses_with_it(dtype):
    x, residual = torch.randn(2, T, 64, dtype=dtype)
    gamma = torch.randn(64, dtype=dtype)
    fused, calls, expected, got = run_pass(NormQuantFusion(), norm_then_dynamic_quant, x,
                                           residual, gamma)
    assert fused == 1 and calls == ["npu_add_rms_norm_dynamic_quant"]
    # The fused kernel quantizes the float32 norm, the unfused one its rounding to ``dtype``:
    # an int8 step at most, the scale within that rounding, the sum exact.
    assert (got[0].int() - expected[0].int()).abs().max() <= 1
    torch.testing.assert_close(got[1], expected[1], rtol=1e-2, atol=0)
    assert torch.equal(got[2], expected[2])
    scale, offset = torch.rand(64, dtype=dtype) + 0.5, torch.zeros(64, dtype=dtype)
    fused, calls, expected, got = run_pass(NormQuantFusion(), norm_then_static_quant, x,
                                           residual, gamma, scale, offset)
    assert fused == 1 and calls == ["npu_add_rms_norm_quant"]
    assert (got[0].int() - expected[0].int()).abs().max() <= 1 and torch.equal(got[1],
                                                                                expected[1])


def test_a_norm_someone_else_reads_stays_unfused():
    def also_read(x, residual, gamma):
        y, _, added = torch_npu.npu_add_rms_norm(x, residual, gamma, 1e-6)
        q, scale = torch_npu.npu_dynamic_quant(y, dst_type=torch.int8)
        return q, scale, added, y * 2  # the normed output has a second reader

    x, residual = torch.randn(2, T, 64, dtype=torch.float16)
    fused, calls, _, _ = run_pass(NormQuantFusion(), also_read, x, residual,
                                  torch.randn(64, dtype=torch.float16))
    assert fused == 0 and calls == ["npu_add_rms_norm", "npu_dynamic_quant"]


def test_the_pass_manager_runs_every_pass_and_counts():
    manager = AscendPassManager()
    manager.configure(None)
    qkv = torch.randn(T, Q + 2 * KV, dtype=torch.float16)
    cos, sin = torch.randn(2, 1, T, 1, HEAD, dtype=torch.float16)
    gm = traced(rope_step, qkv, cos, sin)
    manager(gm)
    assert manager.counts == {"norm_quant_fusion": 0, "qk_rope_merge": 1}
    assert apis(gm).count("npu_rotary_mul") == 1
