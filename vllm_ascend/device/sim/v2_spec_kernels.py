"""Torch implementations of the Triton kernels of Model Runner V2's speculative decoding on the
paths vllm-ascend runs (EAGLE, EAGLE-3 and MTP drafters: vllm/v1/worker/gpu/spec_decode/
target_dependent_ar; the rejection sampler: spec_decode/rejection_sampler*.py), for the
simulator. Verification covers greedy requests and Leviathan et al.'s ratio test for sampled
ones, with one-hot drafts or the drafter's logits, and synthetic acceptance rates; block
verification and watermarking are refused at start-up (worker/choice.py).

As in v2_kernels.py: each function takes its kernel's parameters in the kernel's order, and the
batch (the kernel's grid) comes from the tensors. Random draws are the kernels' own: Triton's
Philox ``tl.rand`` for the acceptance test, vLLM's murmur3 Gumbel noise for resampling.
"""

import torch

from vllm_ascend.device.sim.v2_kernels import one_kernel
from vllm_ascend.device.sim.v2_sampling import M32, gumbel_noise, mul32

_TL_RAND_MIN = 4.6566127342e-10  # the smallest positive value of Triton's fp32 tl.rand


# --- target_dependent_ar/speculator.py -----------------------------------------------------

def prepare_draft_prefill_inputs(
        last_token_indices_ptr, draft_current_step_ptr, draft_input_ids_ptr,
        draft_positions_ptr, draft_query_start_loc_ptr, draft_seq_lens_ptr,
        target_input_ids_ptr, target_positions_ptr, idx_mapping_ptr, last_sampled_ptr,
        next_prefill_tokens_ptr, num_sampled_ptr, num_rejected_ptr, query_start_loc_ptr,
        seq_lens_ptr, max_num_reqs, BLOCK_SIZE):
    """The draft prefill's inputs: each request's target input ids shifted left by one over its
    accepted tokens, with the next token (the last sampled one, or the next prompt token of a
    chunked prefill) last; its positions, query start and seq_len as the target's; rows past the
    batch padded (query starts at the last end, seq_len 0, last-token index 0); step 0."""
    num_reqs = idx_mapping_ptr.shape[0]
    qsl = query_start_loc_ptr[:num_reqs + 1].tolist()
    rejected, sampled = num_rejected_ptr[:num_reqs].tolist(), num_sampled_ptr[:num_reqs].tolist()
    for b, state in enumerate(idx_mapping_ptr.tolist()):
        start = qsl[b]
        query_len = qsl[b + 1] - start - rejected[b]
        next_token = (last_sampled_ptr[state] if sampled[b] > 0
                      else next_prefill_tokens_ptr[state])
        draft_input_ids_ptr[start:start + query_len - 1] = \
            target_input_ids_ptr[start + 1:start + query_len]
        last = start + query_len - 1
        last_token_indices_ptr[b] = last
        draft_input_ids_ptr[last] = next_token.to(draft_input_ids_ptr.dtype)
        draft_positions_ptr[start:start + query_len] = \
            target_positions_ptr[start:start + query_len]
    draft_query_start_loc_ptr[:num_reqs] = query_start_loc_ptr[:num_reqs]
    draft_seq_lens_ptr[:num_reqs] = seq_lens_ptr[:num_reqs]
    if num_reqs:
        draft_current_step_ptr.fill_(0)
        draft_query_start_loc_ptr[num_reqs:max_num_reqs + 1] = qsl[num_reqs]
        draft_seq_lens_ptr[num_reqs:max_num_reqs] = 0
        last_token_indices_ptr[num_reqs:max_num_reqs] = 0


def prepare_draft_decode_inputs(
        draft_tokens_ptr, draft_tokens_stride, target_seq_lens_ptr, num_rejected_ptr,
        input_ids_ptr, positions_ptr, sample_src_positions_ptr, query_start_loc_ptr,
        seq_lens_ptr, max_model_len, max_num_reqs, BLOCK_SIZE, ADVANCE_DRAFT_POSITIONS):
    """The first draft decode step's inputs: one query token a request (the first draft), its
    sampling key advanced, seq_len = the target's less the rejected tokens (+1 and the position
    +1 when positions advance, both clamped to the model length); query starts 0..num_reqs and
    then padded, seq_lens past the batch 0. ``draft_tokens_ptr`` is the drafts' first column."""
    num_reqs = draft_tokens_ptr.shape[0]
    blocks = torch.arange(max_num_reqs + 1, dtype=query_start_loc_ptr.dtype)
    query_start_loc_ptr[:max_num_reqs + 1] = blocks.clamp_max(num_reqs)
    seq_lens_ptr[num_reqs:max_num_reqs] = 0
    if not num_reqs:
        return
    input_ids_ptr[:num_reqs] = draft_tokens_ptr.to(input_ids_ptr.dtype)
    sample_src_positions_ptr[:num_reqs] += 1
    seq_len = target_seq_lens_ptr[:num_reqs].to(torch.int64) - num_rejected_ptr[:num_reqs]
    if ADVANCE_DRAFT_POSITIONS:
        positions_ptr[:num_reqs] = (positions_ptr[:num_reqs] + 1).clamp_max(max_model_len - 1)
        seq_len = (seq_len + 1).clamp_max(max_model_len)
    seq_lens_ptr[:num_reqs] = seq_len.to(seq_lens_ptr.dtype)


def update_draft_inputs(
        output_draft_tokens_ptr, output_draft_tokens_stride, next_input_hidden_states_ptr,
        next_input_hidden_states_stride, input_ids_ptr, positions_ptr, sample_src_positions_ptr,
        seq_lens_ptr, draft_tokens_ptr, current_draft_step_ptr, hidden_states_ptr,
        hidden_states_stride, hidden_size, max_model_len, num_speculative_steps, BLOCK_SIZE,
        ADVANCE_DRAFT_POSITIONS):
    """After a draft step: its tokens into the drafts' column ``step``; unless it was the last,
    they become the next step's input ids, the step's hidden states its input hidden states,
    the sampling keys advance, and positions and seq_lens advance (clamped). The step is a
    device scalar read on the device (no host read: a draft step's FULL graph holds this
    kernel, and each replay runs it at another step)."""
    num_reqs = draft_tokens_ptr.shape[0]
    if not num_reqs:
        return
    step = current_draft_step_ptr.reshape(1).to(torch.int64)
    tokens = draft_tokens_ptr[:, None].to(output_draft_tokens_ptr.dtype)
    output_draft_tokens_ptr[:num_reqs].scatter_(1, step.expand(num_reqs)[:, None], tokens)
    more = step < num_speculative_steps - 1  # [1]: not the last step

    def advance(rows: torch.Tensor, new: torch.Tensor) -> None:
        rows.copy_(torch.where(more.view(-1, *[1] * (rows.dim() - 1)), new.to(rows.dtype), rows))

    advance(sample_src_positions_ptr[:num_reqs], sample_src_positions_ptr[:num_reqs] + 1)
    advance(input_ids_ptr[:num_reqs], draft_tokens_ptr)
    advance(next_input_hidden_states_ptr[:num_reqs, :hidden_size],
            hidden_states_ptr[:num_reqs, :hidden_size])
    if ADVANCE_DRAFT_POSITIONS:
        advance(positions_ptr[:num_reqs], (positions_ptr[:num_reqs] + 1).clamp_max(
            max_model_len - 1))
        advance(seq_lens_ptr[:num_reqs], (seq_lens_ptr[:num_reqs] + 1).clamp_max(max_model_len))


# --- rejection_sampler.py ------------------------------------------------------------------

def flatten_sampled(flat_sampled_ptr, sampled_ptr, sampled_stride, num_sampled_ptr,
                    cu_num_logits_ptr, num_warps=None):
    """Each request's sampled tokens, flat at its logits' offsets."""
    cu = cu_num_logits_ptr.tolist()
    for b, n in enumerate(num_sampled_ptr[:len(cu) - 1].tolist()):
        flat_sampled_ptr[cu[b]:cu[b] + n] = sampled_ptr[b, :n]


def gather_draft_sampled(draft_sampled_ptr, pos_ptr, input_ids_ptr, positions_ptr,
                         logits_indices_ptr, expanded_idx_mapping_ptr, expanded_local_pos_ptr,
                         prefill_len_ptr, num_logits, BLOCK_SIZE):
    """Each logits row's input token and position; a draft row of a request that has not
    sampled past its prefill (a placeholder) is -1."""
    token = logits_indices_ptr[:num_logits].to(torch.int64)
    ids, pos = input_ids_ptr[token], positions_ptr[token]
    local = expanded_local_pos_ptr[:num_logits].to(torch.int64)
    prefill = prefill_len_ptr[expanded_idx_mapping_ptr[:num_logits].to(torch.int64)]
    placeholder = (local > 0) & (pos.to(torch.int64) - local < prefill)
    draft_sampled_ptr[:num_logits] = torch.where(placeholder, -1, ids).to(draft_sampled_ptr.dtype)
    pos_ptr[:num_logits] = pos.to(pos_ptr.dtype)


# --- rejection_sampler_utils.py ------------------------------------------------------------

def _blocks(rows: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """[n, V] fp32 rows as [n, num_blocks, block_size], padded with -inf (a kernel's mask)."""
    padded = rows.new_full((rows.shape[0], num_blocks * block_size), float("-inf"))
    padded[:, :rows.shape[1]] = rows
    return padded.view(rows.shape[0], num_blocks, block_size)


def _max_and_sumexp(blocks: torch.Tensor):
    value = blocks.amax(-1)
    finite = value > float("-inf")
    sumexp = torch.exp(blocks - torch.where(finite, value, 0.0)[..., None]).sum(-1)
    return value, torch.where(finite, sumexp, 0.0)


def _draft_rows(draft_logits_ptr, state, step, vocab_size, temp):
    """The drafter's cached (pre-temperature) logits of each row, divided by its temperature."""
    rows = draft_logits_ptr[state, step, :vocab_size].to(torch.float32)
    return rows / temp[:, None]


def local_logits_stats(
        target_local_argmax_ptr, target_local_argmax_stride, target_local_max_ptr,
        target_local_max_stride, target_local_sumexp_ptr, target_local_sumexp_stride,
        draft_local_max_ptr, draft_local_max_stride, draft_local_sumexp_ptr,
        draft_local_sumexp_stride, target_logits_ptr, target_logits_stride, draft_logits_ptr,
        draft_logits_stride_0, draft_logits_stride_1, expanded_idx_mapping_ptr,
        expanded_local_pos_ptr, temp_ptr, vocab_size, num_speculative_steps, BLOCK_SIZE,
        HAS_DRAFT_LOGITS):
    """Per draft row (not the bonus) and vocabulary block: a greedy row's target max and argmax;
    a sampled row's target max and summed exponentials (and the draft's, from its logits)."""
    num_logits, num_blocks = target_local_argmax_ptr.shape
    local = expanded_local_pos_ptr[:num_logits].to(torch.int64)
    state = expanded_idx_mapping_ptr[:num_logits].to(torch.int64)
    temp = temp_ptr[state].to(torch.float32)
    draft_row = local < num_speculative_steps
    target = _blocks(target_logits_ptr[:num_logits, :vocab_size].to(torch.float32), num_blocks,
                     BLOCK_SIZE)
    greedy = (draft_row & (temp == 0.0)).nonzero().squeeze(1)
    value, idx = target[greedy].max(-1)
    target_local_argmax_ptr[greedy] = torch.arange(num_blocks) * BLOCK_SIZE + idx
    target_local_max_ptr[greedy] = value
    sampled = (draft_row & (temp != 0.0)).nonzero().squeeze(1)
    if not len(sampled):
        return
    target_local_max_ptr[sampled], target_local_sumexp_ptr[sampled] = \
        _max_and_sumexp(target[sampled])
    if HAS_DRAFT_LOGITS:
        draft = _draft_rows(draft_logits_ptr, state[sampled], local[sampled], vocab_size,
                            temp[sampled])
        draft_local_max_ptr[sampled], draft_local_sumexp_ptr[sampled] = \
            _max_and_sumexp(_blocks(draft, num_blocks, BLOCK_SIZE))


def _logsumexp(local_max: torch.Tensor, local_sumexp: torch.Tensor) -> torch.Tensor:
    top = local_max.amax(-1)
    return top + torch.log((local_sumexp * torch.exp(local_max - top[..., None])).sum(-1))


def _umulhi(a: int, b: torch.Tensor) -> torch.Tensor:
    """The high 32 bits of a * b, for b < 2**32, without overflowing int64."""
    lo, hi = b & 0xFFFF, b >> 16
    low = a * lo
    return (a * hi + (low >> 16)) >> 16


def _philox_rand(seed: int, offset: torch.Tensor) -> torch.Tensor:
    """Triton's ``tl.rand(seed, offset)`` (Philox 4x32, 10 rounds) for int64 offsets."""
    c0, c1 = offset & M32, (offset >> 32) & M32
    c2, c3 = torch.zeros_like(c0), torch.zeros_like(c0)
    k0, k1 = seed & M32, (seed >> 32) & M32
    for _ in range(10):
        _c0, _c2 = c0, c2
        c0 = (_umulhi(0xCD9E8D57, _c2) ^ c1 ^ k0) & M32
        c2 = (_umulhi(0xD2511F53, _c0) ^ c3 ^ k1) & M32
        c1, c3 = mul32(_c2, 0xCD9E8D57), mul32(_c0, 0xD2511F53)
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    signed = torch.where(c0 >= 1 << 31, c0 - (1 << 32), c0)
    signed = torch.where(signed < 0, -signed - 1, signed)
    return signed.to(torch.float32) * 4.6566127342e-10


def rejection(
        sampled_ptr, sampled_stride, rejected_steps_ptr, target_rejected_logsumexp_ptr,
        draft_rejected_logsumexp_ptr, target_logits_ptr, target_logits_stride,
        target_local_argmax_ptr, target_local_argmax_stride, target_local_max_ptr,
        target_local_max_stride, target_local_sumexp_ptr, target_local_sumexp_stride,
        draft_sampled_ptr, draft_logits_ptr, draft_logits_stride_0, draft_logits_stride_1,
        draft_local_max_ptr, draft_local_max_stride, draft_local_sumexp_ptr,
        draft_local_sumexp_stride, cu_num_logits_ptr, idx_mapping_ptr, temp_ptr, seed_ptr,
        pos_ptr, synthetic_conditional_rates_ptr, cumulative_log_p_ptr, local_residual_mass_ptr,
        local_residual_mass_stride, vocab_num_blocks, PADDED_VOCAB_NUM_BLOCKS, HAS_DRAFT_LOGITS,
        SYNTHETIC_MODE, USE_BLOCK_VERIFICATION, num_warps=None):
    """Per request, its drafts in order until the first rejection: a greedy request accepts a
    draft equal to the target's argmax and writes the argmax where it rejects; a sampled one
    accepts where log p(x) > log u + log q(x) (u from Philox at the row's position; q one-hot
    unless the drafter's logits are given), or u < the step's rate in synthetic mode. Stores the
    accepted count (as num_sampled) and, for a sampled request, the log-sum-exps the resampling
    of its rejected row needs."""
    if USE_BLOCK_VERIFICATION:
        raise NotImplementedError("block verification is refused at start-up")
    cu = cu_num_logits_ptr.tolist()
    num_reqs = len(cu) - 1
    temps = temp_ptr[idx_mapping_ptr[:num_reqs].to(torch.int64)].to(torch.float32).tolist()
    for b, state in enumerate(idx_mapping_ptr[:num_reqs].tolist()):
        start, num_drafts = cu[b], cu[b + 1] - cu[b] - 1
        seed, greedy = int(seed_ptr[state]), temps[b] == 0.0
        accepted, target_lse, draft_lse = 0, 0.0, 0.0
        rows = torch.arange(start, start + max(num_drafts, 0))
        drafts = draft_sampled_ptr[rows + 1].to(torch.int64)
        valid = drafts >= 0
        drafts = drafts.clamp_min(0)
        u = _philox_rand(seed, pos_ptr[rows].to(torch.int64)).clamp_min(_TL_RAND_MIN)
        if greedy:
            local_max = target_local_max_ptr[rows, :vocab_num_blocks]
            best = torch.nan_to_num(local_max, nan=float("-inf")).argmax(-1)
            argmax = target_local_argmax_ptr[rows, best].to(torch.int64)
            ok = (u < synthetic_conditional_rates_ptr[:num_drafts] if SYNTHETIC_MODE
                  else argmax == drafts) & valid
            accepted = int(torch.cumprod(ok.to(torch.int64), 0).sum()) if num_drafts > 0 else 0
            written = min(accepted + 1, num_drafts)
            sampled_ptr[b, :written] = torch.where(ok, drafts, argmax)[:written]
        elif num_drafts > 0:
            lse = _logsumexp(target_local_max_ptr[rows, :vocab_num_blocks],
                             target_local_sumexp_ptr[rows, :vocab_num_blocks])
            target_logprob = target_logits_ptr[rows, drafts].to(torch.float32) - lse
            draft_logprob = torch.zeros_like(target_logprob)
            d_lse = torch.zeros_like(lse)
            if HAS_DRAFT_LOGITS:
                d_lse = _logsumexp(draft_local_max_ptr[rows, :vocab_num_blocks],
                                   draft_local_sumexp_ptr[rows, :vocab_num_blocks])
                steps = torch.arange(num_drafts)
                draft_logprob = (draft_logits_ptr[state, steps, drafts].to(torch.float32)
                                 / temps[b] - d_lse)
            ok = (u < synthetic_conditional_rates_ptr[:num_drafts] if SYNTHETIC_MODE
                  else target_logprob > torch.log(u) + draft_logprob)
            verifying = torch.cumprod((ok & valid).to(torch.int64), 0)
            accepted = int(verifying.sum())
            # The kernel writes each draft it verifies, and the lse of the last one it verified.
            verified = min(accepted + 1, num_drafts) if bool(valid[min(accepted, num_drafts - 1)]) \
                else accepted
            sampled_ptr[b, :verified] = drafts[:verified]
            if verified:
                target_lse, draft_lse = float(lse[verified - 1]), float(d_lse[verified - 1])
        rejected_steps_ptr[b] = accepted
        target_rejected_logsumexp_ptr[b] = target_lse
        draft_rejected_logsumexp_ptr[b] = draft_lse


def resample(
        resampled_local_argmax_ptr, resampled_local_argmax_stride, resampled_local_max_ptr,
        resampled_local_max_stride, target_logits_ptr, target_logits_stride,
        target_rejected_logsumexp_ptr, draft_logits_ptr, draft_logits_stride_0,
        draft_logits_stride_1, draft_rejected_logsumexp_ptr, rejected_step_ptr,
        cu_num_logits_ptr, expanded_idx_mapping_ptr, draft_sampled_ptr, temp_ptr, seed_ptr,
        pos_ptr, cumulative_log_p_ptr, contexts_ptr, contexts_stride, watermarking_ptr,
        watermarking_skip_mask_ptr, watermark_key_0, watermark_key_1, vocab_size, BLOCK_SIZE,
        HAS_DRAFT_LOGITS, USE_FP64, USE_BLOCK_VERIFICATION, CONTEXT_WIDTH, WATERMARK,
        DEDUPLICATE_CONTEXTS):
    """For each request whose token at its first rejected row (or the bonus row) is to be drawn
    (sampled requests, and greedy ones at the bonus row): per vocabulary block, the argmax of the
    residual logits plus Gumbel noise keyed by the request's seed and the row's position. The
    residual is the target's logits without the rejected draft (one-hot drafts), or
    log max(p - q, 0) (the drafter's logits); the target's at the bonus row or a placeholder."""
    if WATERMARK or USE_BLOCK_VERIFICATION:
        raise NotImplementedError("watermarking and block verification are refused at start-up")
    cu = cu_num_logits_ptr.tolist()
    num_blocks = resampled_local_argmax_ptr.shape[1]
    keys = torch.arange(vocab_size, dtype=torch.int64)
    for b in range(len(cu) - 1):
        index = int(rejected_step_ptr[b])
        row, bonus = cu[b] + index, cu[b] + index == cu[b + 1] - 1
        state = int(expanded_idx_mapping_ptr[row])
        temp = float(temp_ptr[state])
        if temp == 0.0 and not bonus:
            continue
        logits = target_logits_ptr[row, :vocab_size].to(torch.float32)
        rejected = -1 if bonus else int(draft_sampled_ptr[row + 1])
        if rejected < 0:
            residual = logits
        elif HAS_DRAFT_LOGITS:
            target_lp = logits - float(target_rejected_logsumexp_ptr[b])
            draft = draft_logits_ptr[state, index, :vocab_size].to(torch.float32) / temp
            ratio = torch.exp(draft - float(draft_rejected_logsumexp_ptr[b]) - target_lp)
            residual = torch.where(ratio < 1.0, target_lp + torch.log1p(-ratio), float("-inf"))
        else:
            residual = logits.clone()
            residual[rejected] = float("-inf")
        if USE_FP64:
            residual = residual.to(torch.float64)
        if temp != 0.0:
            seed = torch.tensor(int(seed_ptr[state]), dtype=torch.int64)
            pos = torch.tensor(int(pos_ptr[row]), dtype=torch.int64)
            residual = residual + gumbel_noise(seed, pos, keys, USE_FP64).to(residual.dtype)
        value, idx = _blocks(residual[None], num_blocks, BLOCK_SIZE)[0].max(-1)
        resampled_local_argmax_ptr[b] = torch.arange(num_blocks) * BLOCK_SIZE + idx
        resampled_local_max_ptr[b] = value.to(resampled_local_max_ptr.dtype)


def insert_resampled(sampled_ptr, sampled_stride, num_sampled_ptr, resampled_local_argmax_ptr,
                     resampled_local_argmax_stride, resampled_local_max_ptr,
                     resampled_local_max_stride, resample_num_blocks, cu_num_logits_ptr,
                     expanded_idx_mapping_ptr, temp_ptr, PADDED_RESAMPLE_NUM_BLOCKS):
    """num_sampled += 1 per request, and the resampled token (the best block's argmax) written
    after the accepted ones, unless the request is greedy and rejected a draft (its argmax is
    already there)."""
    cu = cu_num_logits_ptr.tolist()
    for b in range(len(cu) - 1):
        n = int(num_sampled_ptr[b])
        row = cu[b] + n
        num_sampled_ptr[b] = n + 1
        state = int(expanded_idx_mapping_ptr[row])
        if float(temp_ptr[state]) == 0.0 and row != cu[b + 1] - 1:
            continue
        local_max = resampled_local_max_ptr[b, :resample_num_blocks]
        best = int(torch.nan_to_num(local_max, nan=float("-inf")).argmax())
        sampled_ptr[b, n] = resampled_local_argmax_ptr[b, best]


_GPU = "vllm.v1.worker.gpu.spec_decode."
_TDAR = _GPU + "target_dependent_ar.speculator."
_REJECT = _GPU + "rejection_sampler_utils."
_KERNELS = {
    _TDAR + "_prepare_prefill_inputs_kernel": prepare_draft_prefill_inputs,
    _TDAR + "_prepare_decode_inputs_kernel": prepare_draft_decode_inputs,
    _TDAR + "_update_draft_inputs_kernel": update_draft_inputs,
    _GPU + "rejection_sampler._flatten_sampled_kernel": flatten_sampled,
    _GPU + "rejection_sampler._gather_draft_sampled_kernel": gather_draft_sampled,
    _REJECT + "_compute_local_logits_stats_kernel": local_logits_stats,
    _REJECT + "_rejection_kernel": rejection,
    _REJECT + "_resample_kernel": resample,
    _REJECT + "_insert_resampled_kernel": insert_resampled,
}
KERNELS = {name: one_kernel(fn) for name, fn in _KERNELS.items()}
