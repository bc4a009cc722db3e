"""Torch implementations of the Triton kernels vLLM's speculative decoding launches: the
rejection sampler's four and the EAGLE/draft-model proposer's four (no Triton on Ascend).

Each function takes the Triton kernel's own parameter names, so vLLM's kernel dispatcher
(`vllm.triton_utils.dispatcher.register_kernels`) forwards the launch by keyword. The batch
size, which the kernels read from their launch grid, comes from the tensors here. Everything
is vectorised over the batch, with no per-request host loop; a few steps index by data-dependent
sizes (nonzero, repeat_interleave), which on a chip read a size back to the host.
"""

import torch


def _starts_and_lengths(cu_num_tokens: torch.Tensor):
    """Per-request start offsets and lengths from an inclusive cumulative count."""
    cu = cu_num_tokens.to(torch.int64)
    starts = torch.cat([cu.new_zeros(1), cu[:-1]])
    return starts, cu - starts


def _positions(cu_num_tokens: torch.Tensor, width: int):
    """[batch, width] token indices of each request's draft positions, and which are real."""
    starts, lengths = _starts_and_lengths(cu_num_tokens)
    pos = torch.arange(width, device=cu_num_tokens.device)
    valid = pos < lengths[:, None]
    return starts[:, None] + pos, valid, lengths


def _write_until_rejected(output, index, valid, accepted, tokens, rows, lengths, bonus):
    """The kernels' per-request loop: write each position's token up to and including the
    first rejected one; when none is rejected, the bonus token goes after the last draft."""
    rejected = valid & ~accepted
    before_first_reject = (torch.cumsum(rejected.to(torch.int32), 1) - rejected.to(torch.int32)) == 0
    write = valid & before_first_reject & rows[:, None]
    width = index.shape[1]
    output[:, :width] = torch.where(write, tokens.to(output.dtype), output[:, :width])
    all_accepted = rows & ~rejected.any(1)
    req = all_accepted.nonzero().squeeze(1)
    output[req, lengths[req]] = bonus.reshape(-1)[req].to(output.dtype)


def _gather(values: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    if values.numel() == 0:
        return torch.zeros(index.shape, dtype=values.dtype, device=values.device)
    return values[torch.where(valid, index, 0)]


def rejection_greedy_sample(output_token_ids_ptr, cu_num_draft_tokens_ptr, draft_token_ids_ptr,
                            target_argmax_ptr, bonus_token_ids_ptr, is_greedy_ptr, max_spec_len,
                            uniform_probs_ptr, synthetic_conditional_rates_ptr, SYNTHETIC_MODE):
    out = output_token_ids_ptr
    index, valid, lengths = _positions(cu_num_draft_tokens_ptr, max_spec_len)
    draft = _gather(draft_token_ids_ptr, index, valid).to(torch.int64)
    target = _gather(target_argmax_ptr, index, valid).to(torch.int64)
    if SYNTHETIC_MODE:
        rates = synthetic_conditional_rates_ptr[:max_spec_len]
        accepted = (_gather(uniform_probs_ptr, index, valid) < rates) & (draft >= 0)
        tokens = torch.where(accepted, draft, target)
    else:
        accepted = draft == target
        tokens = target
    rows = (torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
            if is_greedy_ptr is None else is_greedy_ptr.to(torch.bool))
    _write_until_rejected(out, index, valid, accepted, tokens, rows, lengths, bonus_token_ids_ptr)


def rejection_random_sample(output_token_ids_ptr, cu_num_draft_tokens_ptr, draft_token_ids_ptr,
                            draft_probs_ptr, target_probs_ptr, bonus_token_ids_ptr,
                            recovered_token_ids_ptr, uniform_probs_ptr, is_greedy_ptr,
                            max_spec_len, vocab_size, synthetic_conditional_rates_ptr,
                            NO_DRAFT_PROBS, SYNTHETIC_MODE):
    out = output_token_ids_ptr
    index, valid, lengths = _positions(cu_num_draft_tokens_ptr, max_spec_len)
    safe = torch.where(valid, index, 0)
    draft = _gather(draft_token_ids_ptr, index, valid).to(torch.int64)
    uniform = _gather(uniform_probs_ptr, index, valid)
    if SYNTHETIC_MODE:
        accepted = uniform < synthetic_conditional_rates_ptr[: index.shape[1]]
    else:
        token = draft.clamp_min(0)
        target_prob = target_probs_ptr.view(-1, vocab_size)[safe, token] if target_probs_ptr.numel() \
            else torch.zeros_like(uniform)
        if NO_DRAFT_PROBS:
            draft_prob = torch.ones_like(target_prob)
        else:
            draft_prob = draft_probs_ptr.view(-1, vocab_size)[safe, token]
        # A zero draft probability is rejected, as in the kernel (no NaN from 0/0).
        accepted = (draft_prob > 0) & (target_prob / draft_prob.clamp_min(1e-30) >= uniform)
    accepted = accepted & (draft >= 0)  # -1 marks a padded draft token: always rejected
    tokens = torch.where(accepted, draft, _gather(recovered_token_ids_ptr, index, valid).to(torch.int64))
    rows = ~is_greedy_ptr.to(torch.bool)
    _write_until_rejected(out, index, valid, accepted, tokens, rows, lengths, bonus_token_ids_ptr)


def expand(output_ptr, input_ptr, cu_num_tokens_ptr, replace_from, replace_to, MAX_NUM_TOKENS):
    """output[start_r:end_r] = input[r] (replace_from mapped to replace_to)."""
    _, lengths = _starts_and_lengths(cu_num_tokens_ptr)
    values = torch.where(input_ptr == replace_from, torch.as_tensor(replace_to, dtype=input_ptr.dtype),
                         input_ptr)
    expanded = torch.repeat_interleave(values, lengths.clamp_max(MAX_NUM_TOKENS))
    output_ptr[: expanded.numel()] = expanded


def sample_recovered_tokens(output_token_ids_ptr, cu_num_draft_tokens_ptr, draft_token_ids_ptr,
                            draft_probs_ptr, target_probs_ptr, inv_q_ptr, vocab_size, BLOCK_SIZE,
                            NO_DRAFT_PROBS, USE_FP64_GUMBEL):
    """Per draft position: argmax over the vocabulary of prob * inv_q[request], where prob is
    the target distribution without the draft token (no draft probs) or max(target - draft, 0)."""
    num_tokens = draft_token_ids_ptr.shape[0]
    if num_tokens == 0:
        return
    _, lengths = _starts_and_lengths(cu_num_draft_tokens_ptr)
    req = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    target = target_probs_ptr.view(-1, vocab_size)[:num_tokens]
    dtype = torch.float64 if USE_FP64_GUMBEL else torch.float32
    if NO_DRAFT_PROBS:
        prob = target.to(dtype).scatter(1, draft_token_ids_ptr.to(torch.int64)[:, None], 0.0)
    else:
        prob = (target - draft_probs_ptr.view(-1, vocab_size)[:num_tokens]).clamp_min(0).to(dtype)
    score = prob * inv_q_ptr.view(-1, vocab_size)[req].to(dtype)
    output_token_ids_ptr[:num_tokens] = score.argmax(1).to(output_token_ids_ptr.dtype)


def eagle_step_slot_mapping_metadata(positions_ptr, block_table_ptr, block_table_stride,
                                     seq_lens_ptr, out_clamped_positions_ptr,
                                     out_slot_mapping_ptr, block_size, max_model_len,
                                     n_blocks_per_req, PAD_ID, batch_size):
    """One autoregressive draft step: position + 1 (0 past max_model_len), its slot (PAD_ID
    past max_model_len and for the graph-padding tail of out_slot_mapping), seq_lens + 1."""
    position = positions_ptr[:batch_size].to(torch.int64) + 1
    exceeds = position >= max_model_len
    clamped = torch.where(exceeds, 0, position)
    table = block_table_ptr.reshape(-1)
    rows = torch.arange(batch_size, device=position.device) * block_table_stride
    block = table[rows + (clamped // block_size).clamp_max(n_blocks_per_req - 1)].to(torch.int64)
    slot = torch.where(exceeds, PAD_ID, block * block_size + clamped % block_size)
    seq_len = torch.where(exceeds, 1, seq_lens_ptr[:batch_size] + 1).clamp_max(max_model_len)
    out_clamped_positions_ptr[:batch_size] = clamped.to(out_clamped_positions_ptr.dtype)
    out_slot_mapping_ptr[:batch_size] = slot.to(out_slot_mapping_ptr.dtype)
    out_slot_mapping_ptr[batch_size:] = PAD_ID
    seq_lens_ptr[:batch_size] = seq_len.to(seq_lens_ptr.dtype)


def eagle_prepare_inputs_padded(cu_num_draft_tokens_ptr, valid_sampled_tokens_count_ptr,
                                query_start_loc_gpu_ptr, token_indices_to_sample_ptr,
                                num_rejected_tokens_gpu_ptr, num_reqs):
    """Per request: rejected = drafts + 1 - valid sampled (0 without drafts); the token to
    sample from is the request's last query token minus the rejected ones."""
    _, num_drafts = _starts_and_lengths(cu_num_draft_tokens_ptr[:num_reqs])
    valid = valid_sampled_tokens_count_ptr[:num_reqs].to(torch.int64)
    rejected = torch.where(num_drafts > 0, num_drafts + 1 - valid, 0)
    last = query_start_loc_gpu_ptr[1: num_reqs + 1].to(torch.int64) - 1
    token_indices_to_sample_ptr[:num_reqs] = (last - rejected).to(token_indices_to_sample_ptr.dtype)
    num_rejected_tokens_gpu_ptr[:num_reqs] = rejected.to(num_rejected_tokens_gpu_ptr.dtype)


def eagle_prepare_next_token_padded(sampled_token_ids_ptr, discard_request_mask_ptr,
                                    backup_next_token_ids_ptr, next_token_ids_ptr,
                                    valid_sampled_tokens_count_ptr, vocab_size,
                                    num_sampled_tokens_per_req, num_reqs,
                                    stride_sampled_token_ids, BLOCK_SIZE_TOKENS):
    """Per request: the count of valid sampled tokens (not -1, inside the vocabulary) and the
    last valid one; the backup token when none is valid or the request is discarded."""
    sampled = torch.as_strided(sampled_token_ids_ptr, (num_reqs, num_sampled_tokens_per_req),
                               (stride_sampled_token_ids, 1))
    valid = (sampled != -1) & (sampled < vocab_size)
    count = valid.sum(1)
    width = torch.arange(num_sampled_tokens_per_req, device=sampled.device)
    last_index = torch.where(valid, width, -1).amax(1).clamp_min(0)
    last = sampled.gather(1, last_index[:, None]).squeeze(1)
    discarded = discard_request_mask_ptr[:num_reqs].to(torch.bool)
    backup = backup_next_token_ids_ptr[:num_reqs]
    use_backup = discarded | (count == 0)
    next_token_ids_ptr[:num_reqs] = torch.where(use_backup, backup.to(last.dtype), last).to(
        next_token_ids_ptr.dtype)
    valid_sampled_tokens_count_ptr[:num_reqs] = torch.where(discarded, 0, count).to(
        valid_sampled_tokens_count_ptr.dtype)


def copy_and_expand_eagle_inputs(target_token_ids_ptr, target_positions_ptr, next_token_ids_ptr,
                                 out_input_ids_ptr, out_positions_ptr,
                                 out_is_rejected_token_mask_ptr, out_is_masked_token_mask_ptr,
                                 out_new_token_indices_ptr, out_hidden_state_mapping_ptr,
                                 query_start_loc_ptr, query_end_loc_ptr, padding_token_id,
                                 parallel_drafting_token_id, total_input_tokens,
                                 num_padding_slots_per_request, shift_input_ids,
                                 BLOCK_SIZE_TOKENS):
    """The drafter's first-pass inputs with extra slots per request (draft models, parallel
    drafting). Request r's output span is laid out as: its valid input tokens (shifted by one
    when the drafter takes hidden states), the bonus token, num_padding_slots - 1 parallel
    drafting slots, then its rejected slots; positions continue from the request's first."""
    dev = query_start_loc_ptr.device
    num_reqs = query_end_loc_ptr.shape[0]
    start = query_start_loc_ptr[:num_reqs].to(torch.int64)
    next_start = query_start_loc_ptr[1: num_reqs + 1].to(torch.int64)
    end = query_end_loc_ptr[:num_reqs].to(torch.int64)
    req_ids = torch.arange(num_reqs, device=dev)
    pad = num_padding_slots_per_request
    if shift_input_ids:
        num_valid, offset, out_start = end - start, 1, start + req_ids * (pad - 1)
    else:
        num_valid, offset, out_start = end - start + 1, 0, start + req_ids * pad
    num_rejected = next_start - end - 1
    total = num_valid + pad + num_rejected
    req = torch.repeat_interleave(req_ids, total)  # output token -> its request
    j = torch.arange(req.numel(), device=dev) - torch.repeat_interleave(
        torch.cumsum(total, 0) - total, total)  # index inside the request's span
    nv = num_valid[req]
    valid_region, bonus_region = j < nv, j == nv
    parallel_region = (j > nv) & (j < nv + pad)
    rejected_region = j >= nv + pad
    out_idx = out_start[req] + j
    in_idx = (start[req] + offset + j).clamp_max(total_input_tokens - 1)
    tokens = torch.where(valid_region, target_token_ids_ptr[in_idx].to(torch.int64), 0)
    tokens = torch.where(bonus_region, next_token_ids_ptr[req].to(torch.int64), tokens)
    tokens = torch.where(parallel_region, parallel_drafting_token_id, tokens)
    tokens = torch.where(rejected_region, padding_token_id, tokens)
    positions = torch.where(rejected_region, 0, target_positions_ptr[start[req]].to(torch.int64) + j)
    out_input_ids_ptr[out_idx] = tokens.to(out_input_ids_ptr.dtype)
    out_positions_ptr[out_idx] = positions.to(out_positions_ptr.dtype)
    out_is_rejected_token_mask_ptr[out_idx] = rejected_region
    out_is_masked_token_mask_ptr[out_idx] = parallel_region
    new = (j >= nv) & (j < nv + pad)
    out_new_token_indices_ptr[(req * pad + j - nv)[new]] = out_idx[new].to(
        out_new_token_indices_ptr.dtype)
    if shift_input_ids:
        # Hidden states are not shifted: every input token (rejected ones included) maps to
        # the output slot of the same index inside its request's span.
        num_inputs = (next_start - start)[req]
        src = (start[req] + j)[j < num_inputs]
        out_hidden_state_mapping_ptr[src] = out_idx[j < num_inputs].to(
            out_hidden_state_mapping_ptr.dtype)


def kernel_overrides() -> dict:
    """vLLM's kernel names -> these implementations, for vLLM's kernel dispatcher."""
    sampler, proposer = "vllm.v1.sample.rejection_sampler.", "vllm.v1.spec_decode.utils."
    return {
        sampler + "rejection_greedy_sample_kernel": rejection_greedy_sample,
        sampler + "rejection_random_sample_kernel": rejection_random_sample,
        sampler + "expand_kernel": expand,
        sampler + "sample_recovered_tokens_kernel": sample_recovered_tokens,
        proposer + "eagle_step_slot_mapping_metadata_kernel": eagle_step_slot_mapping_metadata,
        proposer + "eagle_prepare_inputs_padded_kernel": eagle_prepare_inputs_padded,
        proposer + "eagle_prepare_next_token_padded_kernel": eagle_prepare_next_token_padded,
        proposer + "copy_and_expand_eagle_inputs_kernel": copy_and_expand_eagle_inputs,
    }
