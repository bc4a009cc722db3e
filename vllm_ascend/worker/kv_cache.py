"""The KV cache as FIA and MLA read it, viewed over the backing allocation vLLM sizes."""

import numpy as np
import torch
from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, MLAAttentionSpec

from vllm_ascend.attention.hybrid import gdn_state_views


def npu_kv_cache_views(raw: torch.Tensor, kv_cache_config,
                       kernel_block_sizes: "list[int] | None" = None) -> dict[str, torch.Tensor]:
    """vLLM views each layer's pages as interleaved K|V per head; FIA reads K and V as separate
    contiguous caches. Each layer gets one [2, num_blocks, block_size, kv_heads, head_size] view
    of its region of ``raw`` (the one int8 backing allocation): K and V are its halves. An MLA
    layer gets [num_blocks, block_size, head_size], which its backend reads as separate latent
    and rope caches (attention/mla.py). A Gated DeltaNet layer gets its (conv, recurrent) states
    in the same region, read as the two lanes attention/hybrid.py describes. An attention
    layer's blocks are viewed at its group's kernel block size (``kernel_block_sizes``: a
    hybrid model's blocks of 512 tokens or more, which FIA reads as smaller ones)."""
    specs, kernel = {}, {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        for name in group.layer_names:
            specs[name] = group.kv_cache_spec
            kernel[name] = (kernel_block_sizes[gid] if kernel_block_sizes
                            and gid < len(kernel_block_sizes) else group.kv_cache_spec.block_size)
    kv_caches = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        num_blocks = kv_cache_config.num_blocks_of(tensor)
        for i, name in enumerate(tensor.layers):
            spec = specs[name]
            start = tensor.offset + i * tensor.layer_stride
            if isinstance(spec, MambaSpec):
                kv_caches[name] = gdn_state_views(raw, start, num_blocks, spec)
                continue
            if not isinstance(spec, AttentionSpec):
                raise NotImplementedError(f"KV cache of {type(spec).__name__} layers is not "
                                          "supported by vllm-ascend")
            if isinstance(spec, MLAAttentionSpec):
                shape = (num_blocks, spec.block_size, spec.head_size)
            else:
                split = spec.block_size // kernel[name]  # kernel blocks a block
                shape = (2, num_blocks * split, kernel[name], spec.num_kv_heads, spec.head_size)
            nbytes = spec.dtype.itemsize * int(np.prod(shape))
            if tensor.layer_stride < nbytes:
                raise ValueError(f"the KV cache layout does not give layer {name} a region "
                                 f"of its own ({tensor.layer_stride} < {nbytes} bytes)")
            kv_caches[name] = raw[start:start + nbytes].view(spec.dtype).view(shape)
    return kv_caches
