"""The attention operators' limits as the start-up check reads them (attention/limits.py): which
shapes pass, which fail, and the fix each failure names (the check on real configs:
tests/e2e/test_start_up_errors.py)."""

import pytest

from vllm_ascend.attention import limits


@pytest.mark.parametrize("head_size,heads,kv_heads,tp", [
    (64, 9, 3, 1),  # SmolLM2
    (128, 32, 8, 1), (128, 32, 8, 4), (128, 64, 8, 8),
    (256, 8, 1, 1), (16, 4, 4, 1),
    (128, 128, 2, 1),  # 64 query heads per key/value head: the largest group
    (128, 32, 2, 8),  # kv heads replicated: 4 query heads and 1 kv head per rank
])
def test_shapes_fia_takes_pass(head_size, heads, kv_heads, tp):
    assert limits.dense_attention(head_size, heads, kv_heads, tp) == []


@pytest.mark.parametrize("head_size,heads,kv_heads,tp,what,fix", [
    (40, 4, 2, 1, "head size 40", "cannot run on Ascend"),
    (72, 32, 32, 1, "head size 72", "cannot run on Ascend"),
    (288, 4, 2, 1, "head size 288", "cannot run on Ascend"),
    (128, 512, 512, 1, "512 query heads", "--tensor-parallel-size 2"),
    (128, 128, 1, 1, "128 query heads and 1 key/value heads", "--tensor-parallel-size 2"),
    (128, 12, 8, 1, "12 query heads and 8 key/value heads", "No tensor parallel size"),
])
def test_shapes_fia_refuses_name_the_limit_and_the_fix(head_size, heads, kv_heads, tp, what,
                                                       fix):
    (violation,) = limits.dense_attention(head_size, heads, kv_heads, tp)
    assert what in violation.what and fix in violation.fix


class Config:
    def __init__(self, **dims):
        self.__dict__.update(dims)


DEEPSEEK = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


@pytest.mark.parametrize("heads,tp", [(16, 1), (128, 1), (128, 8), (4, 1)])
def test_deepseeks_mla_shapes_pass(heads, tp):
    assert limits.latent_attention(Config(**DEEPSEEK), heads, tp) == []


def test_other_mla_shapes_and_head_counts_name_what_the_fused_kernels_take():
    minicpm3 = Config(kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64)
    (shape,) = limits.latent_attention(minicpm3, 40, 2)[:1]
    assert "kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64" in \
        shape.what and "no unfused MLA path" in shape.fix
    (heads,) = limits.latent_attention(Config(**DEEPSEEK), 40, 1)
    assert "40 attention heads" in heads.what and "--tensor-parallel-size" not in heads.fix
    (heads,) = limits.latent_attention(Config(**DEEPSEEK), 256, 1)
    assert "--tensor-parallel-size 2" in heads.fix
