"""Torch implementations of the Triton kernels the V1 runner launches (no Triton on Ascend)."""

import torch


def compute_slot_mapping(num_tokens, max_num_tokens, query_start_loc_ptr, positions_ptr,
                         block_table_ptr, block_table_stride, slot_mapping_ptr,
                         KV_CACHE_BLOCK_SIZE, TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK,
                         CP_KV_CACHE_INTERLEAVE_SIZE, PAD_ID, BLOCK_SIZE):
    """slot = block_table[req, pos // block_size] * block_size + pos % block_size; PAD_ID for
    tokens past the last request and for the tail up to max_num_tokens (graph padding)."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("context parallelism is not supported by vllm-ascend")
    qsl = query_start_loc_ptr
    num_reqs = qsl.shape[0] - 1
    tokens = torch.arange(num_tokens, device=qsl.device)
    req = torch.searchsorted(qsl[1:].to(torch.int64), tokens, right=True)
    valid = req < num_reqs
    req = req.clamp_max(max(num_reqs - 1, 0))
    pos = positions_ptr[:num_tokens].to(torch.int64)
    block_idx = pos // KV_CACHE_BLOCK_SIZE
    table = block_table_ptr.view(-1, block_table_stride) if block_table_ptr.dim() == 1 \
        else block_table_ptr
    blocks = table[req, block_idx.clamp_max(table.shape[1] - 1)].to(torch.int64)
    slots = blocks * KV_CACHE_BLOCK_SIZE + pos % KV_CACHE_BLOCK_SIZE
    slot_mapping_ptr[:num_tokens] = torch.where(valid, slots, PAD_ID)
    slot_mapping_ptr[num_tokens:max_num_tokens] = PAD_ID
