"""The NPU punica wrapper (vllm_ascend/lora/punica_npu.py) against the per-token definition:
each row gets its own slot's adapter (none for -1), whatever the other rows run; rows past the
step's tokens (a captured batch's padding) get none."""

import pytest
import torch
from vllm.lora.layers import LoRAMapping

from vllm_ascend.lora.punica_npu import PunicaWrapperNPU

SLOTS, RANK, HIDDEN = 3, 4, 16
SLICES = (8, 12)  # a merged projection's outputs (e.g. gate and up)


def wrapper(slot_of_token: list[int], rows: int = 32) -> PunicaWrapperNPU:
    punica = PunicaWrapperNPU(rows, 8, "cpu")
    ids = [0 if s < 0 else s + 1 for s in slot_of_token]  # adapter id s + 1 in slot s
    mapping = LoRAMapping(tuple(ids), tuple(ids[:1]), is_prefill=True)
    punica.update_metadata(mapping, [i + 1 for i in range(SLOTS)], SLOTS, 100)
    return punica


def stacks(generator):
    a = tuple(torch.randn(SLOTS, 1, RANK, HIDDEN, generator=generator) for _ in SLICES)
    b = tuple(torch.randn(SLOTS, 1, size, RANK, generator=generator) for size in SLICES)
    return a, b


def per_token(x, a, b, slots, scale):
    out = torch.zeros(x.shape[0], sum(SLICES))
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        parts = [x[row] @ ai[slot, 0].t() @ bi[slot, 0].t() * scale for ai, bi in zip(a, b)]
        out[row] = torch.cat(parts)
    return out


@pytest.mark.parametrize("slots", [[0, 1, 2, -1, 1], [-1, -1], [2]])
def test_each_row_gets_its_own_slots_adapter(slots):
    generator = torch.Generator().manual_seed(0)
    a, b = stacks(generator)
    x = torch.randn(len(slots), HIDDEN, generator=generator)
    base = torch.randn(len(slots), sum(SLICES), generator=generator)
    y = base.clone()
    wrapper(slots).add_lora_linear(y, x, a, b, 0.5, SLICES)
    torch.testing.assert_close(y, base + per_token(x, a, b, slots, 0.5), rtol=1e-5, atol=1e-5)


def test_padding_rows_past_the_steps_tokens_get_no_adapter():
    generator = torch.Generator().manual_seed(1)
    a, b = stacks(generator)
    x = torch.randn(4, HIDDEN, generator=generator)  # 2 tokens padded to a capture size of 4
    y = torch.zeros(4, sum(SLICES))
    wrapper([1, 0]).add_lora_linear(y, x, a, b, 1.0, SLICES)
    torch.testing.assert_close(y[:2], per_token(x[:2], a, b, [1, 0], 1.0), rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(y[2:], torch.zeros(2, sum(SLICES)))


def test_shrink_then_expand_is_the_linear_path():
    """The row-parallel and sharded layers call add_shrink and add_expand apart."""
    generator = torch.Generator().manual_seed(2)
    a, b = stacks(generator)
    slots = [2, -1, 0]
    x = torch.randn(3, HIDDEN, generator=generator)
    punica = wrapper(slots)
    buffer = torch.zeros(len(SLICES), 3, RANK)
    punica.add_shrink(buffer, x, a, 2.0)
    y = torch.zeros(3, sum(SLICES))
    punica.add_expand(y, buffer, b, SLICES)
    torch.testing.assert_close(y, per_token(x, a, b, slots, 2.0), rtol=1e-5, atol=1e-5)


def test_bfloat16_output_takes_the_float32_product_rounded_once():
    generator = torch.Generator().manual_seed(3)
    a, b = stacks(generator)
    slots = [0, 1]
    x = torch.randn(2, HIDDEN, generator=generator)
    base = torch.randn(2, sum(SLICES), generator=generator).bfloat16()
    y = base.clone()
    wrapper(slots).add_lora_linear(y, x.bfloat16(), a, b, 1.0, SLICES)
    expected = (base.float() + per_token(x.bfloat16().float(), a, b, slots, 1.0)).bfloat16()
    torch.testing.assert_close(y, expected, rtol=1e-2, atol=1e-2)
