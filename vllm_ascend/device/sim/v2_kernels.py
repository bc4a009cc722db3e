"""Torch implementations of the Triton kernels vLLM's Model Runner V2 launches on the paths
vllm-ascend runs (input preparation, block tables and slot mappings, staged writes, sampling,
logprobs and prompt logprobs, the sampling parameters: min_p, penalties, logit bias, allowed
tokens and min_tokens, bad words; structured output's grammar mask: the sampler's are in
v2_sampling.py; speculative decoding's, in v2_spec_kernels.py), for the simulator, which
has no Triton. On a chip triton-ascend runs vLLM's own kernels, as upstream vllm-ascend does.
Kernels of the paths it does not run are not here: worker/choice.py refuses what needs them.

Each function takes its kernel's parameters in the kernel's order (vLLM's kernel dispatcher,
``vllm.triton_utils.dispatcher``, forwards a launch positionally unless the names match). A
kernel's grid is not forwarded: the batch comes from the tensors, as each docstring says.
Pointer tables (``*_ptrs``: uint64 addresses of int32 tensors, as the kernels load them) are read
as the kernels read them, from the address: the simulated device's memory is the host's.
"""

import ctypes
import functools

import torch

from vllm_ascend.device.sim import ledger as _ledger
from vllm_ascend.device.sim.v2_sampling import (
    apply_temperature, bad_words, bincount, grammar_bitmask, gumbel_sample, logit_bias, min_p,
    penalties, prompt_logprobs_token_ids, ranks, topk_log_softmax)


def _int32_rows(address: int, rows: int, stride: int) -> torch.Tensor:
    """The [rows, stride] int32 tensor at ``address`` (a kernel's ``_load_ptr``), writable."""
    if rows <= 0:
        return torch.zeros(0, stride, dtype=torch.int32)
    buffer = (ctypes.c_int32 * (rows * stride)).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.int32).view(rows, stride)


def _pointer(ptrs: torch.Tensor, group: int) -> int:
    return int(ptrs[group].item())


# --- buffer_utils --------------------------------------------------------------------------

def apply_write(output_ptr, output_stride, write_indices_ptr, write_starts_ptr,
                write_contents_ptr, write_cu_lens_ptr, write_group_ids_ptr, BLOCK_SIZE,
                MULTI_GROUP):
    """Staged row writes: write i puts contents[cu[i-1]:cu[i]] at row indices[i] from
    starts[i] (of tensor group_ids[i] of a pointer table when MULTI_GROUP); one per cu_len."""
    cu = write_cu_lens_ptr.tolist()
    rows, starts = write_indices_ptr.tolist(), write_starts_ptr.tolist()
    groups = write_group_ids_ptr.tolist() if MULTI_GROUP else None
    contents = write_contents_ptr
    for i, end in enumerate(cu):
        begin = cu[i - 1] if i else 0
        if MULTI_GROUP:
            stride = int(output_stride[groups[i]])
            flat = _int32_rows(_pointer(output_ptr, groups[i]), rows[i] + 1, stride).view(-1)
        else:
            stride, flat = output_stride, output_ptr.view(-1)  # a row's stride (1 for 1-D)
        at = rows[i] * stride + starts[i]
        flat[at:at + end - begin] = contents[begin:end].to(flat.dtype)


# --- block_table ---------------------------------------------------------------------------

def gather_block_tables(batch_idx_to_req_idx, src_block_table_ptrs, dst_block_table_ptrs,
                        block_table_strides, num_blocks_ptr, num_blocks_stride, num_reqs,
                        BLOCK_SIZE):
    """dst[group][b, :num_blocks[req]] = src[group][req] for the batch's rows b < num_reqs, and
    the rows after them zeroed. The kernel zeroes up to its grid's padded batch, which the
    dispatcher does not forward: here every row up to max_num_reqs (num_blocks' width) is."""
    req_idx = batch_idx_to_req_idx[:num_reqs].to(torch.int64)
    max_num_reqs = num_blocks_ptr.shape[1]
    for group in range(block_table_strides.shape[0]):
        stride = int(block_table_strides[group])
        counts = num_blocks_ptr[group].to(torch.int64)
        dst = _int32_rows(_pointer(dst_block_table_ptrs, group), max_num_reqs, stride)
        if num_reqs:
            src = _int32_rows(_pointer(src_block_table_ptrs, group), max_num_reqs, stride)
            keep = torch.arange(stride)[None, :] < counts[req_idx][:, None]
            dst[:num_reqs] = torch.where(keep, src[req_idx], dst[:num_reqs])
        dst[num_reqs:] = 0


def compute_slot_mappings(max_num_tokens, idx_mapping, query_start_loc, pos, block_table_ptrs,
                          block_table_strides, block_sizes, slot_mapping_enabled, dcp_sharded,
                          slot_mappings_ptr, slot_mappings_stride, cp_rank, CP_SIZE,
                          CP_INTERLEAVE, PAD_ID, TRITON_BLOCK_SIZE):
    """slot = block_table[req, pos // block_size] * block_size + pos % block_size per token of
    each group; PAD_ID for dummy requests (idx_mapping < 0), disabled groups, and every slot from
    the batch's last token to max_num_tokens (graph padding)."""
    if CP_SIZE != 1:
        raise NotImplementedError("context parallelism is not supported by vllm-ascend")
    num_reqs = idx_mapping.shape[0]
    qsl = query_start_loc[:num_reqs + 1].to(torch.int64)
    num_tokens = int(qsl[-1])
    tokens = torch.arange(num_tokens)
    req = torch.searchsorted(qsl[1:], tokens, right=True).clamp_max(max(num_reqs - 1, 0))
    state = idx_mapping.to(torch.int64)[req] if num_reqs else tokens
    real = state >= 0
    positions = pos[:num_tokens].to(torch.int64)
    for group in range(block_table_strides.shape[0]):
        out = slot_mappings_ptr[group]
        out[num_tokens:max_num_tokens] = PAD_ID
        if num_tokens == 0:
            continue
        block_size = int(block_sizes[group])
        enabled = bool(slot_mapping_enabled[group])
        stride = int(block_table_strides[group])
        rows = int(state.max()) + 1 if bool(real.any()) else 0
        table = _int32_rows(_pointer(block_table_ptrs, group), rows, stride)
        block_idx = positions // block_size if enabled else torch.zeros_like(positions)
        numbers = torch.zeros_like(positions)
        if rows:
            numbers[real] = table[state[real], block_idx[real]].to(torch.int64)
        slots = numbers * block_size + positions % block_size
        out[:num_tokens] = torch.where(real & enabled, slots, PAD_ID).to(out.dtype)


# --- input_batch ---------------------------------------------------------------------------

def prepare_prefill_inputs(input_ids_ptr, next_prefill_tokens_ptr, next_prefill_tokens_stride,
                           num_lookahead, idx_mapping_ptr, query_start_loc_ptr,
                           all_token_ids_ptr, all_token_ids_stride, prefill_lens_ptr,
                           num_computed_tokens_ptr, BLOCK_SIZE, LOOKAHEAD_BLOCK):
    """A prefilling request's scheduled prompt tokens into input_ids, and its next
    ``num_lookahead`` prompt tokens (0 past the prompt) into next_prefill_tokens."""
    qsl = query_start_loc_ptr.tolist()
    for b, state in enumerate(idx_mapping_ptr.tolist()):
        prefill_len = int(prefill_lens_ptr[state])
        computed = int(num_computed_tokens_ptr[state])
        if computed >= prefill_len:
            continue
        start, end = qsl[b], qsl[b + 1]
        row = all_token_ids_ptr[state]
        input_ids_ptr[start:end] = row[computed:computed + end - start].to(input_ids_ptr.dtype)
        for k in range(num_lookahead):
            p = computed + end - start + k
            next_prefill_tokens_ptr[k, state] = row[p] if p < prefill_len else 0


def prepare_pos_seq_lens(pos_ptr, seq_lens_ptr, idx_mapping_ptr, query_start_loc_ptr,
                         num_computed_tokens_ptr, max_num_reqs, BLOCK_SIZE):
    """Each request's positions (computed + 0..query_len-1) and seq_len; seq_lens past the batch
    zeroed up to max_num_reqs (for FULL graphs)."""
    num_reqs = idx_mapping_ptr.shape[0]
    qsl = query_start_loc_ptr[:num_reqs + 1].to(torch.int64)
    computed = num_computed_tokens_ptr[idx_mapping_ptr.to(torch.int64)].to(torch.int64)
    lens = qsl[1:] - qsl[:-1]
    seq_lens_ptr[:num_reqs] = (computed + lens).to(seq_lens_ptr.dtype)
    seq_lens_ptr[num_reqs:max_num_reqs] = 0
    num_tokens = int(qsl[-1]) if num_reqs else 0
    tokens = torch.arange(num_tokens)
    req = torch.searchsorted(qsl[1:], tokens, right=True)
    pos_ptr[:num_tokens] = (computed[req] + tokens - qsl[req]).to(pos_ptr.dtype)


def combine_sampled_and_draft_tokens(input_ids_ptr, idx_mapping_ptr, last_sampled_tokens_ptr,
                                     query_start_loc_ptr, seq_lens_ptr, prefill_len_ptr,
                                     draft_tokens_ptr, draft_tokens_stride, cu_num_logits_ptr,
                                     logits_indices_ptr, BLOCK_SIZE,
                                     NUM_NEW_SAMPLED_TOKENS=1):
    """The logits indices (each request's last num_logits tokens) and, for a request past its
    prompt, the last sampled token and the draft tokens written into input_ids."""
    qsl, cu = query_start_loc_ptr.tolist(), cu_num_logits_ptr.tolist()
    for b, state in enumerate(idx_mapping_ptr.tolist()):
        num_logits = cu[b + 1] - cu[b]
        num_draft = num_logits - NUM_NEW_SAMPLED_TOKENS
        query_end = qsl[b + 1]
        start = query_end - num_logits
        logits_indices_ptr[cu[b]:cu[b + 1]] = torch.arange(start, query_end)
        seq_len, prefill_len = int(seq_lens_ptr[b]), int(prefill_len_ptr[state])
        if seq_len <= prefill_len:
            continue
        if NUM_NEW_SAMPLED_TOKENS > 0 and seq_len - num_logits >= prefill_len:
            input_ids_ptr[start] = last_sampled_tokens_ptr[state]
        if num_draft > 0:
            input_ids_ptr[query_end - num_draft:query_end] = \
                draft_tokens_ptr[state, :num_draft].to(input_ids_ptr.dtype)


def get_num_sampled_and_rejected(num_sampled_ptr, num_rejected_ptr, seq_lens_ptr,
                                 cu_num_logits_ptr, idx_mapping_ptr, prefill_len_ptr):
    """A chunked-prefilling request samples and rejects nothing; otherwise rejected =
    num_logits - num_sampled."""
    n = idx_mapping_ptr.shape[0]
    chunked = seq_lens_ptr[:n] < prefill_len_ptr[idx_mapping_ptr.to(torch.int64)]
    num_logits = cu_num_logits_ptr[1:n + 1] - cu_num_logits_ptr[:n]
    sampled = torch.where(chunked, 0, num_sampled_ptr[:n])
    num_sampled_ptr[:n] = sampled.to(num_sampled_ptr.dtype)
    num_rejected_ptr[:n] = torch.where(chunked, 0, num_logits - sampled).to(
        num_rejected_ptr.dtype)


def post_update(idx_mapping_ptr, num_computed_tokens_ptr, last_sampled_tokens_ptr,
                output_bin_counts_ptr, output_bin_counts_stride, sampled_tokens_ptr,
                sampled_tokens_stride, num_sampled_ptr, num_rejected_ptr, query_start_loc_ptr,
                all_token_ids_ptr, all_token_ids_stride, total_len_ptr, num_warps=None):
    """After sampling, per request (idx < 0: skipped): append the sampled tokens to its token
    ids (and output bin counts), keep the last as last_sampled, and advance num_computed by the
    query length less the rejected drafts."""
    num_sampled, num_rejected = num_sampled_ptr.tolist(), num_rejected_ptr.tolist()
    qsl = query_start_loc_ptr.tolist() if query_start_loc_ptr is not None else None
    for b, state in enumerate(idx_mapping_ptr.tolist()):
        if state < 0:
            continue
        total = int(total_len_ptr[state])
        n = num_sampled[b]
        if n > 0:
            tokens = sampled_tokens_ptr[b, :n]
            last_sampled_tokens_ptr[state] = tokens[-1]
            total_len_ptr[state] = total + n
            all_token_ids_ptr[state, total:total + n] = tokens.to(all_token_ids_ptr.dtype)
            if output_bin_counts_ptr is not None:
                for token in tokens.tolist():
                    output_bin_counts_ptr[state, token] += 1
        query_len = qsl[b + 1] - qsl[b] if qsl is not None else 0
        delta = query_len - num_rejected[b]
        if delta:
            num_computed_tokens_ptr[state] += delta


def post_update_num_computed_tokens(idx_mapping_ptr, num_computed_tokens_ptr,
                                    query_start_loc_ptr):
    """num_computed += query length, per request."""
    n = idx_mapping_ptr.shape[0]
    lens = query_start_loc_ptr[1:n + 1] - query_start_loc_ptr[:n]
    num_computed_tokens_ptr.index_add_(0, idx_mapping_ptr.to(torch.int64),
                                       lens.to(num_computed_tokens_ptr.dtype))


def expand_idx_mapping(idx_mapping_ptr, expanded_idx_mapping_ptr, expanded_local_pos_ptr,
                       cu_num_logits_ptr, BLOCK_SIZE):
    """Each logit's request state index, and its position within the request's logits."""
    n = idx_mapping_ptr.shape[0]
    cu = cu_num_logits_ptr[:n + 1].to(torch.int64)
    counts = cu[1:] - cu[:-1]
    total = int(cu[-1]) - int(cu[0])
    expanded_idx_mapping_ptr[int(cu[0]):int(cu[-1])] = \
        torch.repeat_interleave(idx_mapping_ptr, counts)
    req = torch.repeat_interleave(torch.arange(n), counts)
    expanded_local_pos_ptr[int(cu[0]):int(cu[-1])] = \
        (torch.arange(total) + cu[0] - cu[req]).to(expanded_local_pos_ptr.dtype)


def one_kernel(fn):
    """``fn`` as the chip runs it: one kernel launch in the simulator's chip-cost ledger."""
    @functools.wraps(fn)
    def launch(*args, **kwargs):
        with _ledger.one_kernel():
            return fn(*args, **kwargs)
    return launch


_GPU = "vllm.v1.worker.gpu."
_KERNELS = {
    _GPU + "buffer_utils._apply_write_kernel": apply_write,
    _GPU + "block_table._gather_block_tables_kernel": gather_block_tables,
    _GPU + "block_table._compute_slot_mappings_kernel": compute_slot_mappings,
    _GPU + "input_batch._prepare_prefill_inputs_kernel": prepare_prefill_inputs,
    _GPU + "input_batch._prepare_pos_seq_lens_kernel": prepare_pos_seq_lens,
    _GPU + "input_batch._combine_sampled_and_draft_tokens_kernel":
        combine_sampled_and_draft_tokens,
    _GPU + "input_batch._get_num_sampled_and_rejected_kernel": get_num_sampled_and_rejected,
    _GPU + "input_batch._post_update_kernel": post_update,
    _GPU + "input_batch._post_update_num_computed_tokens_kernel":
        post_update_num_computed_tokens,
    _GPU + "input_batch._expand_idx_mapping_kernel": expand_idx_mapping,
    _GPU + "sample.gumbel._gumbel_sample_kernel": gumbel_sample,
    _GPU + "sample.gumbel._temperature_kernel": apply_temperature,
    _GPU + "sample.logprob._topk_log_softmax_kernel": topk_log_softmax,
    _GPU + "sample.logprob._ranks_kernel": ranks,
    _GPU + "sample.min_p._min_p_kernel": min_p,
    _GPU + "sample.penalties._penalties_kernel": penalties,
    _GPU + "sample.penalties._bincount_kernel": bincount,
    _GPU + "sample.logit_bias._bias_kernel": logit_bias,
    _GPU + "sample.bad_words._bad_words_kernel": bad_words,
    _GPU + "sample.prompt_logprob._prompt_logprobs_token_ids_kernel": prompt_logprobs_token_ids,
    _GPU + "structured_outputs._apply_grammar_bitmask_kernel": grammar_bitmask,
}
KERNELS = {name: one_kernel(fn) for name, fn in _KERNELS.items()}
