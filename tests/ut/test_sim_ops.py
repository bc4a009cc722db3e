"""The simulator's other torch_npu operators on the graph-mode path: results against plain
torch, and the contracts they enforce (TORCH_NPU_CONTRACTS.md sections 2 and 5)."""

import pytest
import torch

from vllm_ascend.device import sim as torch_npu
from vllm_ascend.device.sim.errors import AscendOpError

BF16 = torch.bfloat16


def caches(num_blocks=4, block=16, heads=2, d=16, dtype=BF16):
    return (torch.zeros(num_blocks, block, heads, d, dtype=dtype),
            torch.zeros(num_blocks, block, heads, d, dtype=dtype))


def test_scatter_pa_kv_cache_writes_slots_and_skips_padding():
    kc, vc = caches()
    key, value = torch.randn(5, 2, 16).to(BF16), torch.randn(5, 2, 16).to(BF16)
    slots = torch.tensor([17, -1, 0, 63, -1], dtype=torch.int32)
    assert torch_npu.npu_scatter_pa_kv_cache(key=key, value=value, key_cache=kc, value_cache=vc,
                                             slot_mapping=slots, cache_mode="Norm") is None
    torch.testing.assert_close(kc[1, 1], key[0])
    torch.testing.assert_close(vc[0, 0], value[2])
    torch.testing.assert_close(kc[3, 15], key[3])
    assert kc.flatten(0, 1).abs().sum((-1, -2)).count_nonzero() == 3  # padding wrote nothing


def scatter(**overrides):
    kc, vc = caches()
    args = dict(key=torch.randn(2, 2, 16).to(BF16), value=torch.randn(2, 2, 16).to(BF16),
                key_cache=kc, value_cache=vc, slot_mapping=torch.tensor([0, 1], dtype=torch.int32),
                cache_mode="Norm")
    args.update(overrides)
    torch_npu.npu_scatter_pa_kv_cache(**args)


def test_scatter_needs_cache_mode_norm_for_nd_caches():
    with pytest.raises(AscendOpError, match="161002(.|\n)*cache_mode 'PA_NZ' expects NZ caches"):
        scatter(cache_mode="PA_NZ")


def test_scatter_needs_int32_slots():
    with pytest.raises(AscendOpError, match="slot_mapping must be a 1-D int32 tensor"):
        scatter(slot_mapping=torch.tensor([0, 1]))


def test_scatter_needs_contiguous_inputs_of_one_dtype_and_unique_slots():
    with pytest.raises(AscendOpError, match="key must be contiguous"):
        scatter(key=torch.randn(2, 2, 32).to(BF16)[..., :16])
    with pytest.raises(AscendOpError, match="must share one dtype"):
        scatter(value=torch.randn(2, 2, 16))
    with pytest.raises(AscendOpError, match="must be unique"):
        scatter(slot_mapping=torch.tensor([3, 3], dtype=torch.int32))
    with pytest.raises(AscendOpError, match="out of range"):
        scatter(slot_mapping=torch.tensor([0, 64], dtype=torch.int32))


def test_rms_norm_returns_y_and_rstd_and_add_rms_norm_the_sum():
    x, r = torch.randn(3, 4, 64).to(BF16), torch.randn(3, 4, 64).to(BF16)
    w = torch.rand(64).to(BF16)
    y, rstd = torch_npu.npu_rms_norm(x, w, 1e-6)
    ref = torch.nn.functional.rms_norm(x.float(), (64,), w.float(), 1e-6)
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
    assert rstd.dtype == torch.float32 and rstd.shape == (3, 4, 1)
    y2, _, summed = torch_npu.npu_add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(summed, x + r)
    torch.testing.assert_close(y2, torch_npu.npu_rms_norm(x + r, w, 1e-6)[0])
    with pytest.raises(AscendOpError, match="gamma .* must equal the trailing dims"):
        torch_npu.npu_rms_norm(x, torch.ones(32, dtype=BF16))
    with pytest.raises(AscendOpError, match="must share the dtype"):
        torch_npu.npu_add_rms_norm(x, r.float(), w)


def test_swiglu_halves_the_last_dim_and_needs_it_even_and_contiguous():
    x = torch.randn(3, 8)
    torch.testing.assert_close(torch_npu.npu_swiglu(x),
                               torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
    with pytest.raises(AscendOpError, match="must be even"):
        torch_npu.npu_swiglu(torch.randn(3, 7))
    with pytest.raises(AscendOpError, match="input must be contiguous"):
        torch_npu.npu_swiglu(torch.randn(8, 3).t())


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_mul_rotates_with_broadcast_cos_sin(mode):
    x = torch.randn(1, 5, 3, 8)
    angle = torch.rand(1, 5, 1, 4)
    if mode == "half":
        cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
        x1, x2 = x[..., :4], x[..., 4:]
        ref = torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()],
                        -1)
    else:
        cos, sin = angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1)
        x1, x2 = x[..., ::2], x[..., 1::2]
        ref = torch.stack([x1 * angle.cos() - x2 * angle.sin(),
                           x2 * angle.cos() + x1 * angle.sin()], -1).flatten(-2)
    torch.testing.assert_close(torch_npu.npu_rotary_mul(x, cos, sin, rotary_mode=mode), ref)
    with pytest.raises(AscendOpError, match="must broadcast to the input"):
        torch_npu.npu_rotary_mul(x, cos[..., :4], sin[..., :4], rotary_mode=mode)


def test_mrope_rotates_the_rotary_dims_and_passes_the_rest():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=512, is_neox_style=True, dtype=BF16,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                         "partial_rotary_factor": 0.5})
    pos = torch.tensor([0, 7, 300])
    q, k = torch.randn(3, 2 * 64).to(BF16), torch.randn(3, 64).to(BF16)
    cache = rope.cos_sin_cache.to(BF16)
    got_q, got_k = torch_npu.npu_mrope(pos, q, k, cache, 64, mrope_section=[0, 0, 0],
                                       rotary_mode="half")
    ref_q, ref_k = rope.forward_native(pos, q.clone(), k.clone())
    torch.testing.assert_close(got_q, ref_q, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_k, ref_k, atol=2e-2, rtol=2e-2)
    with pytest.raises(AscendOpError, match="multiples of 32 for fp16/bf16"):
        torch_npu.npu_mrope(pos, q[:, :96], k[:, :48], cache[:, :16], 48)
