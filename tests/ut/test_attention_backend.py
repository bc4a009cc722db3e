"""The attention backend's choices per layer: FIA's mask arguments for a causal or a
sliding-window layer, and the variants it refuses at start-up (when the model's layers are
built), by name, instead of failing later."""

import pytest
import torch

from vllm_ascend.attention.backend import AscendAttentionImpl, fia_mask_args


def impl(**kwargs):
    args = dict(num_heads=4, head_size=32, scale=32 ** -0.5, num_kv_heads=2, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto")
    return AscendAttentionImpl(**{**args, **kwargs})


def test_a_causal_layer_takes_mode_3_and_a_window_of_w_keys_the_band_w_minus_1_before():
    assert fia_mask_args(None) == dict(sparse_mode=3)
    assert fia_mask_args(6) == dict(sparse_mode=4, pre_tokens=5, next_tokens=0)
    assert impl().mask_args == dict(sparse_mode=3)
    assert impl(sliding_window=4096).mask_args == dict(sparse_mode=4, pre_tokens=4095,
                                                        next_tokens=0)


@pytest.mark.parametrize("variant,kwargs", [
    # GPT-OSS's sinks with heads wider than FIA v2's learnable_sink takes
    ("attention sinks with a head size of 256", dict(sinks=torch.zeros(4, dtype=torch.bfloat16),
                                                     head_size=256)),
    ("logits soft-capping", dict(logits_soft_cap=50.0)),  # Gemma-2
    ("ALiBi", dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625])),
])
def test_a_variant_without_a_kernel_is_refused_by_name(variant, kwargs):
    with pytest.raises(NotImplementedError, match=f"does not support {variant}"):
        impl(**kwargs)


def test_no_soft_cap_given_as_zero_is_no_soft_cap():
    assert impl(logits_soft_cap=0.0).mask_args == dict(sparse_mode=3)


def test_a_layer_with_sinks_runs_fia_v2_with_learnable_sink_in_v2s_names():
    """GPT-OSS: FIA v2 with the layer's sinks (upstream's attention_v1.py), v1's keywords
    renamed, the step's host lists too; sinks in another dtype than bfloat16 are refused with
    the fix, as the model is built."""
    from vllm_ascend.device import torch_npu

    sinks = torch.zeros(4, dtype=torch.bfloat16)
    layer = impl(sinks=sinks)
    assert layer.fia is torch_npu.npu_fused_infer_attention_score_v2
    args = layer.fia_args(dict(actual_seq_lengths=[1], actual_seq_lengths_kv=[3], num_heads=4,
                               scale=0.5, sparse_mode=3))
    assert args == dict(actual_seq_qlen=[1], actual_seq_kvlen=[3], num_query_heads=4,
                        softmax_scale=0.5, sparse_mode=3, learnable_sink=sinks)
    assert impl().fia is torch_npu.npu_fused_infer_attention_score
    with pytest.raises(ValueError, match="--dtype bfloat16"):
        impl(sinks=torch.zeros(4, dtype=torch.float16))


def test_mla_context_is_cut_into_chunks_of_the_requests_that_have_some():
    """Three prefill requests with 5, 0 and 4 tokens of cached context, chunks of 4: each chunk
    lists the requests it covers (never one with no context in it), their query rows, and the
    cache slots of its tokens in order."""
    import numpy as np

    from vllm_ascend.attention.mla import AscendMLAMetadataBuilder

    builder = object.__new__(AscendMLAMetadataBuilder)  # the two settings it reads
    builder.block_size, builder.chunk_tokens = 4, 4
    tables = torch.tensor([[7, 3, 0], [5, 0, 0], [2, 9, 0]], dtype=torch.int32)
    q_cu = np.array([0, 2, 5, 6])  # query lengths 2, 3, 1
    context = np.array([5, 0, 4])
    chunks = builder._context_chunks(tables, q_cu, context)
    assert [c.kv_lens_cu for c in chunks] == [[4], [1, 4], [1]]
    assert [c.query_lens_cu for c in chunks] == [[2], [2, 3], [1]]
    assert [c.query_rows.tolist() for c in chunks] == [[0, 1], [0, 1, 5], [5]]
    slots = torch.cat([c.slots for c in chunks]).tolist()
    assert slots == [28, 29, 30, 31, 12] + [8, 9, 10, 11]  # blocks 7, 3 | block 2
    # The query tokens' own positions follow their context's, from the same table rows.
    new = builder._slots(tables, context, np.diff(q_cu)).tolist()
    assert new == [13, 14] + [20, 21, 22] + [36]  # block 3 | block 5 | block 9


@pytest.mark.parametrize("value", [0, -4, 2.5, "8", True])
def test_a_bad_mla_chunk_size_is_refused_with_the_setting_named(value):
    import types

    from vllm_ascend.attention.mla import prefill_chunk_tokens

    config = types.SimpleNamespace(
        additional_config={"mla_prefill_chunk_tokens": value},
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=256))
    with pytest.raises(ValueError, match="mla_prefill_chunk_tokens=.* must be an integer >= 1"):
        prefill_chunk_tokens(config)
    config.additional_config = None
    assert prefill_chunk_tokens(config) == 256
