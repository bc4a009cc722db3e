"""The KV cache of a hybrid model (full attention beside Gated DeltaNet layers) as Ascend's
kernels read it.

vLLM lays out a hybrid model's caches by page: block b of every layer that shares a KV cache
tensor (one attention layer and one GDN layer of each other group) lives in the bytes
[b * page, (b + 1) * page), the attention layer's K and V side by side in it. FIA reads K and V
as two contiguous caches [num_blocks, block_size, heads, head_dim], and
``npu_recurrent_gated_delta_rule`` the recurrent states as one contiguous pool
[num_blocks, Nv, Dv, Dk] (non-contiguous inputs are not supported, F14): no page holds both. So
the tensor is read as two lanes of num_blocks slots, as upstream vllm-ascend reads it
(model_runner_v1.py, its hybrid layout): the K lane holds an attention layer's K and a GDN
layer's recurrent state, the V lane the V and the conv state (a strided view: only aten ops read
it). Block b is slot b of each lane in every layer, so that blocks of different groups never
share a byte, provided one block's K is exactly one recurrent state: the attention block size is
the state's bytes over a token's K bytes, and the page two of them.
"""

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class HybridLayout:
    block_size: int  # tokens per attention block
    lane_bytes: int  # a block's K (or V), and one recurrent state (a conv state fits a V slot)

    @property
    def page_bytes(self) -> int:
        return 2 * self.lane_bytes


def _state_shapes(vllm_config) -> tuple:
    from vllm.model_executor.models import ModelRegistry

    model = vllm_config.model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model.architecture, model_config=model)
    return (model_cls.get_mamba_state_shape_from_config(vllm_config),
            model_cls.get_mamba_state_dtype_from_config(vllm_config))


def state_bytes(vllm_config, shapes_and_dtypes: "tuple | None" = None) -> tuple[int, int]:
    """A GDN layer's (conv, recurrent) state bytes for one request."""
    shapes, dtypes = shapes_and_dtypes or _state_shapes(vllm_config)
    conv, ssm = (math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))
    return conv, ssm


def gdn_layout(vllm_config, block_sizes: tuple[int, int]) -> "HybridLayout | str":
    """The layout of ``vllm_config``'s model, or why its states do not fit one; paged
    attention takes block sizes that are multiples of ``block_sizes[0]`` below
    ``block_sizes[1]`` (attention/limits.py), so a larger block is read in kernel blocks."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    shapes, dtypes = _state_shapes(vllm_config)
    conv, ssm = state_bytes(vllm_config, (shapes, dtypes))
    if dtypes[1] != torch.bfloat16:
        return (f"recurrent states in {str(dtypes[1]).removeprefix('torch.')}: "
                "npu_recurrent_gated_delta_rule updates bfloat16 states only on an Atlas A2/A3 "
                "(--mamba-ssm-cache-dtype auto, with --dtype bfloat16)")
    kv_dtype = model.dtype  # (a quantized KV cache is refused elsewhere)
    token = model.get_num_kv_heads(parallel) * model.get_head_size() * kv_dtype.itemsize
    if ssm % token:
        return (f"a recurrent state of {ssm} bytes is not a whole number of attention tokens "
                f"of {token} bytes (the two share the KV cache's slots)")
    block_size = ssm // token
    align = block_sizes[0]
    if block_size % align:
        return (f"its attention blocks would hold {block_size} tokens (one recurrent state of "
                f"{ssm} bytes over a token's K of {token} bytes), and paged attention takes "
                f"multiples of {align} (F6)")
    # (A block of block_sizes[1] tokens or more is read by FIA as kernel blocks below it: vLLM
    # splits the attention group's blocks by the backend's get_supported_kernel_block_sizes.)
    if conv > ssm:
        return f"a conv state of {conv} bytes does not fit a V block of {ssm} bytes"
    return HybridLayout(block_size, ssm)


def without_prefix_caching(vllm_config) -> bool:
    """Prefix caching of Gated DeltaNet states (vLLM's mamba_cache_mode 'align') copies a
    request's states between blocks by address with a Triton kernel (mamba_utils.batch_memcpy),
    which has no Ascend path here yet: prefix caching is turned off for these models. True if it
    was on."""
    cache, model = vllm_config.cache_config, vllm_config.model_config
    if not cache.enable_prefix_caching:
        return False
    cache.enable_prefix_caching = False
    cache.mamba_cache_mode = "none"
    cache.mamba_block_size = model.max_model_len
    return True


def apply_layout(vllm_config, block_sizes: tuple[int, int]) -> HybridLayout:
    """Set the attention block size and the GDN layers' page to the layout's (in the worker,
    where vLLM aligns a hybrid model's block sizes; the front end checked that it exists)."""
    layout = gdn_layout(vllm_config, block_sizes)
    if isinstance(layout, str):
        raise ValueError(layout)
    cache = vllm_config.cache_config
    cache.block_size = layout.block_size
    cache.mamba_page_size_padded = layout.page_bytes
    if cache.mamba_cache_mode == "align":
        cache.mamba_block_size = layout.block_size
    return layout


def gdn_state_views(raw: torch.Tensor, start: int, num_blocks: int, spec) -> tuple:
    """A GDN layer's (conv, recurrent) states in its region of the backing allocation ``raw``
    (int8), which starts at ``start`` and holds ``num_blocks`` pages of ``spec.page_size_bytes``
    (the layout above): the recurrent states are the K lane, contiguous; the conv states sit at
    the start of the V lane's slots."""
    (conv_shape, ssm_shape), (conv_dtype, ssm_dtype) = spec.shapes, spec.dtypes
    lane = spec.page_size_bytes // 2
    if math.prod(ssm_shape) * ssm_dtype.itemsize != lane:
        raise ValueError(f"a recurrent state {ssm_shape} of {ssm_dtype} is not one K lane slot "
                         f"of {lane} bytes (attention/hybrid.py)")
    ssm = raw[start:start + num_blocks * lane].view(ssm_dtype).view(num_blocks, *ssm_shape)
    v_lane = raw[start + num_blocks * lane:start + 2 * num_blocks * lane].view(conv_dtype)
    item = conv_dtype.itemsize
    inner = torch.empty(conv_shape).stride()
    conv = v_lane.as_strided((num_blocks, *conv_shape), (lane // item, *inner))
    return conv, ssm
