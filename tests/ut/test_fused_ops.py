"""Each fused op equals its unfused reference (upstream's forward_native sequence)."""

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config

from vllm_ascend.ops.qkv import StepRope, split_qkv_norm_rope, split_qkv_norm_rope_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def vllm_config():
    with set_current_vllm_config(VllmConfig()):
        yield


def close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_rms_norm_with_and_without_the_fused_residual_add(dtype, tokens):
    from vllm_ascend.ops.layernorm import AscendRMSNorm

    norm = AscendRMSNorm(96, eps=1e-5, dtype=dtype)
    norm.weight.data.normal_()
    x, res = torch.randn(tokens, 96, dtype=dtype), torch.randn(tokens, 96, dtype=dtype)
    close(norm.forward_oot(x), norm.forward_native(x.clone()), dtype)
    fused, fused_sum = norm.forward_oot(x.clone(), res.clone())
    ref, ref_sum = norm.forward_native(x.clone(), res.clone())
    close(fused, ref, dtype)
    close(fused_sum, ref_sum, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_swiglu(dtype, tokens):
    from vllm_ascend.ops.activation import AscendSiluAndMul

    x = torch.randn(tokens, 2 * 80, dtype=dtype)
    close(AscendSiluAndMul().forward_oot(x), AscendSiluAndMul.forward_native(x), dtype)


def make_rope(head_size, rotary_dim, neox, dtype):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    return get_rope(head_size, max_position=256, is_neox_style=neox, dtype=dtype,
                    rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                     "partial_rotary_factor": rotary_dim / head_size})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_embedding(dtype, neox, rotary_dim):
    rope = make_rope(64, rotary_dim, neox, dtype)
    pos = torch.randint(0, 256, (9,))
    q, k = torch.randn(9, 4 * 64, dtype=dtype), torch.randn(9, 2 * 64, dtype=dtype)
    fq, fk = rope.forward_oot(pos, q.clone(), k.clone())
    rq, rk = rope.forward_native(pos, q.clone(), k.clone())
    close(fq, rq, dtype)
    close(fk, rk, dtype)


@pytest.mark.parametrize("head_size,rotary_dim", [(32, 16), (48, 48)])
def test_rotary_sizes_npu_mrope_refuses_run_upstreams_unfused_version(head_size, rotary_dim):
    from vllm_ascend.device import torch_npu

    rope = make_rope(head_size, rotary_dim, True, torch.bfloat16)
    pos = torch.randint(0, 256, (5,))
    q = torch.randn(5, 4 * head_size, dtype=torch.bfloat16)
    k = torch.randn(5, 2 * head_size, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="(?s)561002.*multiples of 32"):
        torch_npu.npu_mrope(pos, q, k, rope.cos_sin_cache.bfloat16(), head_size,
                            mrope_section=[0, 0, 0], rotary_mode="half")
    fq, fk = rope.forward_oot(pos, q.clone(), k.clone())
    rq, rk = rope.forward_native(pos, q.clone(), k.clone())
    assert torch.equal(fq, rq) and torch.equal(fk, rk)


def close_to_truth(low, truth, dtype, units=2):
    """``low`` within ``units`` roundings of ``dtype`` of the fp32 ``truth``, relative to the
    largest operand: a rotation's cancellation leaves an error of the largest term's rounding on
    a small result. (Upstream's own unfused sequence in ``dtype`` stays within 0.8 of them over
    many random inputs; so does the fused op.)"""
    eps = torch.finfo(dtype).eps
    scale = max(1.0, truth.abs().max().item())
    torch.testing.assert_close(low.float(), truth, atol=units * eps * scale, rtol=units * eps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads,kv_heads,tokens", [(8, 2, 1), (8, 2, 13), (4, 4, 6)])
@pytest.mark.parametrize("neox,rotary_dim", [(True, 32), (False, 32), (True, 16)])
def test_split_qkv_norm_rope_with_step_cos_sin(dtype, qk_norm, heads, kv_heads, tokens, neox,
                                               rotary_dim):
    from vllm_ascend.ops.layernorm import AscendRMSNorm

    head = 32
    rope, rope32 = (make_rope(head, rotary_dim, neox, d) for d in (dtype, torch.float32))
    norms = norms32 = (None, None)
    if qk_norm:
        norms = tuple(AscendRMSNorm(head, eps=1e-6, dtype=dtype) for _ in range(2))
        norms32 = tuple(AscendRMSNorm(head, eps=1e-6, dtype=torch.float32) for _ in range(2))
        for n, n32 in zip(norms, norms32):
            n.weight.data.normal_()
            n32.weight.data.copy_(n.weight.float())
    q_size, kv_size = heads * head, kv_heads * head
    qkv = torch.randn(tokens, q_size + 2 * kv_size, dtype=dtype)
    pos = torch.randint(0, 256, (tokens,))
    step_rope = StepRope()
    step_rope.attach(rope, 64, dtype)
    step_rope.update(pos)  # once per step, before the forward
    fused = split_qkv_norm_rope(qkv, q_size, kv_size, head, step_rope, *norms)
    # The unfused sequence upstream runs, in fp32 on the same (low-precision) inputs.
    truth = split_qkv_norm_rope_reference(qkv.float(), q_size, kv_size, head, pos, rope32,
                                          *norms32)
    for a, b in zip(fused, truth):
        assert a.shape == b.shape and a.dtype == dtype
        close_to_truth(a, b, dtype)
    assert fused[0].is_contiguous() and fused[1].is_contiguous()  # as FIA and the KV write need
