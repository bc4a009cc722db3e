"""The simulator's W8A8 operators against their formulas in plain torch (the aclnn pages'), and
the chip's checks on the combinations the product must not pass (docs/torch_npu_calls.md)."""

import pytest
import torch

import vllm_ascend.device.sim as torch_npu
from vllm_ascend.device.sim.errors import AscendOpError

M, K, N = 5, 32, 24


def rand(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def int8(*shape, seed=1):
    return torch.randint(-128, 128, shape, generator=torch.Generator().manual_seed(seed),
                         dtype=torch.int8)


def test_dynamic_quant_is_symmetric_per_token():
    x = rand(M, K)
    y, scale = torch_npu.npu_dynamic_quant(x, dst_type=torch.int8)
    expected = x.float().abs().amax(-1) / 127
    assert y.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (M,)
    torch.testing.assert_close(scale, expected)
    assert torch.equal(y, torch.round(x.float() / expected[:, None]).to(torch.int8))
    assert (y.abs().amax(-1) == 127).all()  # each row's largest magnitude maps to 127


def test_quantize_multiplies_without_div_mode_and_saturates():
    x = rand(M, K) * 50
    scale = torch.full((K,), 0.5, dtype=torch.bfloat16)
    offset = torch.full((K,), 3.0, dtype=torch.bfloat16)
    y = torch_npu.npu_quantize(x, scale, offset, torch.qint8, -1, False)
    assert y.dtype == torch.int8
    assert torch.equal(y, torch.round(x.float() * 0.5 + 3).clamp(-128, 127).to(torch.int8))


def test_quant_matmul_dequantizes_per_channel_and_per_token():
    x1, x2 = int8(M, K), int8(K, N, seed=2)
    scale, pertoken = rand(N, dtype=torch.float32).abs(), rand(M, dtype=torch.float32).abs()
    bias = rand(N)
    out = torch_npu.npu_quant_matmul(x1, x2, scale, pertoken_scale=pertoken, bias=bias,
                                     output_dtype=torch.bfloat16)
    exact = (x1.double() @ x2.double()).float() * scale * pertoken[:, None] + bias.float()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, exact.to(torch.bfloat16))


def test_quant_matmul_reads_an_int64_scale_and_adds_an_int32_bias_before_it():
    x1, x2 = int8(M, K), int8(K, N, seed=2)
    deq = rand(N, dtype=torch.float32).abs() / 1000
    encoded = deq.view(torch.int32).to(torch.int64)  # npu_trans_quant_param's encoding
    bias = torch.randint(-500, 500, (N,), dtype=torch.int32)
    out = torch_npu.npu_quant_matmul(x1, x2, encoded, bias=bias, output_dtype=torch.float16)
    exact = ((x1.double() @ x2.double()) + bias.double()).float() * deq
    torch.testing.assert_close(out, exact.half())


def test_add_rms_norm_quant_and_dynamic_quant_fuse_the_norm():
    x, residual, gamma = rand(M, K), rand(M, K, seed=3), rand(K, seed=4)
    summed = x + residual
    norm = summed.float() * torch.rsqrt(summed.float().pow(2).mean(-1, keepdim=True) + 1e-6) \
        * gamma.float()
    scale = torch.full((K,), 0.02, dtype=torch.bfloat16)
    offset = torch.full((K,), -2.0, dtype=torch.bfloat16)
    y, _, added = torch_npu.npu_add_rms_norm_quant(x, residual, gamma, scale, offset,
                                                   epsilon=1e-6)
    assert torch.equal(added, summed)
    assert torch.equal(y, torch.round(norm / scale.float() - 2).clamp(-128, 127).to(torch.int8))
    y, _, added, row_scale, _ = torch_npu.npu_add_rms_norm_dynamic_quant(
        x, residual, gamma, epsilon=1e-6, output_mask=[True, False])
    torch.testing.assert_close(row_scale, norm.abs().amax(-1) / 127)
    assert torch.equal(y, torch.round(norm / row_scale[:, None]).to(torch.int8))


@pytest.mark.parametrize("call,message", [
    # float16 output with a per-token scale takes a float32 weight scale only (upstream keeps
    # weight_scale in the model's dtype; the product passes float32).
    (lambda: torch_npu.npu_quant_matmul(
        int8(M, K), int8(K, N), torch.ones(N, dtype=torch.float16),
        pertoken_scale=torch.ones(M), output_dtype=torch.float16), "scale must be one of"),
    # int64 scales (a float16 export's deq_scale) do not dequantize to bfloat16
    (lambda: torch_npu.npu_quant_matmul(
        int8(M, K), int8(K, N), torch.ones(N, dtype=torch.int64),
        output_dtype=torch.bfloat16), "scale must be one of"),
    (lambda: torch_npu.npu_quant_matmul(
        int8(M, K), int8(K + 1, N), torch.ones(N), output_dtype=torch.bfloat16), "k differs"),
    (lambda: torch_npu.npu_quant_matmul(
        rand(M, K), int8(K, N), torch.ones(N), output_dtype=torch.bfloat16), "must be int8"),
    (lambda: torch_npu.npu_quantize(rand(M, K), torch.ones(K), None, torch.qint8, -1, False),
     "must equal input's"),
    (lambda: torch_npu.npu_dynamic_quant(rand(M, K, dtype=torch.float32)),
     "float16 or bfloat16"),
    (lambda: torch_npu.npu_add_rms_norm_quant(
        rand(M, K), rand(M, K), rand(K), torch.ones(K, dtype=torch.float16), None),
     "scales1"),
])
def test_combinations_the_chip_refuses_are_refused(call, message):
    with pytest.raises(AscendOpError, match=message):
        call()
