"""Torch implementations of the Triton kernels of Model Runner V2's sampler (vllm/v1/worker/gpu/
sample/: Gumbel sampling with vLLM's murmur3 noise, temperature, logprobs and ranks, min_p,
penalties, logit bias, bad words, prompt logprobs) and structured output's grammar mask, for the
simulator; registered with the input-preparation kernels in v2_kernels.py, under the same rules
(each function takes its kernel's parameters in the kernel's order; the batch comes from the
tensors)."""

import math

import torch

M32 = 0xFFFFFFFF


def mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x < 2**32 without overflowing int64."""
    return ((x * (c & 0xFFFF)) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def _rotl(x: torch.Tensor, s: int) -> torch.Tensor:
    return ((x << s) | (x >> (32 - s))) & M32


def _mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = mul32(_rotl(mul32(key, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl(h ^ key, 13)
    return (mul32(h, 5) + 0xE6546B64) & M32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur3_hash32(seed, pos, offset, domain: int = 0) -> torch.Tensor:
    """vLLM's murmur3_hash32 (sample/gumbel.py) on int64 tensors holding uint32 values."""
    h = torch.full_like(offset, domain & M32)
    h = _mix(h, seed & M32)
    h = _mix(h, (seed >> 32) & M32)
    h = _mix(h, pos & M32)
    h = _mix(h, offset & M32)
    return _fmix(h ^ 16)


def gumbel_noise(seed, pos, keys, use_fp64: bool) -> torch.Tensor:
    if use_fp64:
        lo = murmur3_hash32(seed, pos, keys)
        hi = murmur3_hash32(seed, pos, keys, domain=0x9E3779B9)
        random53 = (hi << 21) | (lo >> 11)  # ((hi << 32) | lo) >> 11 in uint64, < 2**53
        u = (random53.to(torch.float64) + 0.5) * 1.1102230246251565e-16
        u = torch.where(u == 1.0, u - 1.1102230246251565e-16, u)
        return -torch.log(-torch.log(u))
    r = murmur3_hash32(seed, pos, keys)
    u = ((r >> 16).to(torch.float32) * 1.52587890625e-05
         + ((r & 0xFFFF).to(torch.float32) + 0.5) * 2.3283064365386963e-10)
    poly = torch.full_like(u, 1.0 / 8.0)
    for c in (7, 6, 5, 4, 3, 2):
        poly = 1.0 / c + u * poly
    series = -u * (1.0 + u * poly)
    direct = torch.log(torch.clamp(1.0 - u, min=5.960464477539063e-08))
    return -torch.log(-torch.where(u < 0.25, series, direct))


def gumbel_sample(local_argmax_ptr, local_argmax_stride, local_max_ptr, local_max_stride,
                  logits_cache_ptr, logits_cache_stride_0, logits_cache_stride_1,
                  logits_cache_col_ptr, logits_cache_source_ptr, logits_cache_source_stride,
                  logits_ptr, logits_stride, expanded_idx_mapping_ptr, seeds_ptr, pos_ptr,
                  temp_ptr, vocab_size, BLOCK_SIZE, IS_DRAFTING, APPLY_TEMPERATURE, USE_FP64,
                  PER_TOKEN_COL=False):
    """Per token and vocabulary block of BLOCK_SIZE: the block's argmax of the logits (divided
    by the request's temperature when applied) plus Gumbel noise hashed from the request's seed,
    the token's position and the token id; plain argmax at temperature 0. Optionally caches the
    raw logits (drafting)."""
    num_tokens = logits_ptr.shape[0]
    state = expanded_idx_mapping_ptr[:num_tokens].to(torch.int64)
    valid = state >= 0
    safe = state.clamp_min(0)
    temp = torch.where(valid, temp_ptr[safe].to(torch.float32), 0.0)
    if logits_cache_ptr is not None:
        cols = (logits_cache_col_ptr[:num_tokens] if PER_TOKEN_COL
                else logits_cache_col_ptr.reshape(-1)[:1].expand(num_tokens)).to(torch.int64)
        rows = valid.nonzero().squeeze(1)
        logits_cache_ptr[state[rows], cols[rows], :vocab_size] = \
            logits_cache_source_ptr[rows, :vocab_size]
    logits = logits_ptr[:, :vocab_size].to(torch.float32)
    sampling = temp != 0.0
    if APPLY_TEMPERATURE:
        logits = torch.where(sampling[:, None], logits / torch.where(sampling, temp, 1.0)[:, None],
                             logits)
    if USE_FP64:
        logits = logits.to(torch.float64)
    if bool(sampling.any()):
        seed = torch.where(valid, seeds_ptr[safe].to(torch.int64), 0)
        pos = pos_ptr[:num_tokens].to(torch.int64)
        if IS_DRAFTING:
            pos = pos + (1 << 30)
        keys = torch.arange(vocab_size, dtype=torch.int64)
        noise = gumbel_noise(seed[:, None], pos[:, None], keys[None, :], USE_FP64)
        logits = torch.where(sampling[:, None], logits + noise.to(logits.dtype), logits)
    num_blocks = local_argmax_ptr.shape[1]
    padded = logits.new_full((num_tokens, num_blocks * BLOCK_SIZE), float("-inf"))
    padded[:, :vocab_size] = logits
    value, idx = padded.view(num_tokens, num_blocks, BLOCK_SIZE).max(dim=-1)
    blocks = torch.arange(num_blocks)
    local_argmax_ptr[:num_tokens] = blocks * BLOCK_SIZE + idx
    local_max_ptr[:num_tokens] = value.to(local_max_ptr.dtype)


def apply_temperature(logits_ptr, logits_stride, expanded_idx_mapping_ptr, temperature_ptr,
                      vocab_size, BLOCK_SIZE):
    """logits /= the request's temperature, where it is neither 0 nor 1."""
    temp = temperature_ptr[expanded_idx_mapping_ptr[:logits_ptr.shape[0]].to(torch.int64)]
    temp = temp.to(torch.float32)
    scale = torch.where((temp == 0.0) | (temp == 1.0), 1.0, temp)
    logits_ptr[:, :vocab_size] = (logits_ptr[:, :vocab_size].to(torch.float32)
                                  / scale[:, None]).to(logits_ptr.dtype)


def topk_log_softmax(output_ptr, logits_ptr, logits_stride, topk_ids_ptr, topk_ids_stride, topk,
                     vocab_size, BLOCK_SIZE, TOPK_BLOCK_SIZE):
    """log_softmax (fp32) of each row, at the row's ``topk`` token ids."""
    logits = logits_ptr[:, :vocab_size].to(torch.float32)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    ids = topk_ids_ptr[:, :topk].to(torch.int64)
    output_ptr.view(-1, topk)[:] = logits.gather(1, ids) - lse


def ranks(output_ptr, logits_ptr, logits_stride, token_ids_ptr, vocab_size, BLOCK_SIZE):
    """How many of the row's logits are >= the chosen token's (its rank, 1 = top)."""
    logits = logits_ptr[:, :vocab_size]
    chosen = logits.gather(1, token_ids_ptr[:logits.shape[0]].to(torch.int64).view(-1, 1))
    output_ptr[:logits.shape[0]] = (logits >= chosen).sum(dim=-1)


def min_p(logits_ptr, logits_stride, expanded_idx_mapping_ptr, min_p_ptr, vocab_size,
          BLOCK_SIZE):
    """Logits below the row's max + log(min_p) set to -inf, for requests with min_p > 0."""
    for t, state in enumerate(expanded_idx_mapping_ptr[:logits_ptr.shape[0]].tolist()):
        p = float(min_p_ptr[state])
        if p == 0.0:
            continue
        row = logits_ptr[t, :vocab_size]
        threshold = row.max().float() + math.log(p)
        row.masked_fill_(row < threshold, float("-inf"))


def _unpacked_bits(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A row of int32 words, bit i of word w standing for token 32 w + i, as a bool row."""
    bits = (words.to(torch.int64)[:, None] >> torch.arange(32)) & 1
    return bits.reshape(-1)[:vocab_size].bool()


def penalties(logits_ptr, logits_stride, expanded_idx_mapping_ptr, token_ids_ptr,
              expanded_local_pos_ptr, repetition_penalty_ptr, frequency_penalty_ptr,
              presence_penalty_ptr, prompt_bin_mask_ptr, prompt_bin_mask_stride,
              output_bin_counts_ptr, output_bin_counts_stride, vocab_size, BLOCK_SIZE):
    """Repetition (tokens of the prompt or the output: positive logits divided, others
    multiplied), frequency (per count) and presence (per token seen) penalties, in float32;
    the output counts include the row's earlier draft tokens of this step."""
    positions = expanded_local_pos_ptr.tolist()
    for t, state in enumerate(expanded_idx_mapping_ptr[:logits_ptr.shape[0]].tolist()):
        rep = float(repetition_penalty_ptr[state])
        freq = float(frequency_penalty_ptr[state])
        pres = float(presence_penalty_ptr[state])
        if rep == 1.0 and freq == 0.0 and pres == 0.0:
            continue
        logits = logits_ptr[t, :vocab_size].float()
        counts = output_bin_counts_ptr[state, :vocab_size].clone()
        first = t - positions[t]
        for prev in range(positions[t]):
            counts[int(token_ids_ptr[first + prev + 1])] += 1
        seen = counts > 0
        if rep != 1.0:
            scale = torch.where(seen | _unpacked_bits(prompt_bin_mask_ptr[state], vocab_size),
                                rep, 1.0)
            logits = logits * torch.where(logits > 0, 1.0 / scale, scale)
        logits = logits - freq * counts - pres * seen.float()
        logits_ptr[t, :vocab_size] = logits.to(logits_ptr.dtype)


def bincount(expanded_idx_mapping_ptr, all_token_ids_ptr, all_token_ids_stride, prompt_len_ptr,
             prefill_len_ptr, prompt_bin_mask_ptr, prompt_bin_mask_stride,
             output_bin_counts_ptr, output_bin_counts_stride, BLOCK_SIZE):
    """Per row: the prompt's tokens ORed into the request's packed bit mask, and each token
    after the prompt up to the prefill's end counted into its output counts (once per row: a
    request with several rows counts its tokens as often, as the kernel's atomics do)."""
    for state in expanded_idx_mapping_ptr.tolist():
        prompt_len, prefill_len = int(prompt_len_ptr[state]), int(prefill_len_ptr[state])
        tokens = all_token_ids_ptr[state, :prefill_len].to(torch.int64)
        prompt = tokens[:prompt_len].unique()
        words = torch.zeros(prompt_bin_mask_ptr.shape[1], dtype=torch.int64)
        words.index_add_(0, prompt // 32, 1 << (prompt % 32))  # distinct bits: sum == OR
        words = (words + (1 << 31)) % (1 << 32) - (1 << 31)  # as the int32 it is
        row = prompt_bin_mask_ptr[state]
        row.copy_(row | words.to(row.dtype))
        output_bin_counts_ptr[state].index_add_(
            0, tokens[prompt_len:], torch.ones_like(tokens[prompt_len:],
                                                    dtype=output_bin_counts_ptr.dtype))


def logit_bias(logits_ptr, logits_stride, vocab_size, expanded_idx_mapping_ptr,
               num_allowed_token_ids_ptr, allowed_token_ids_ptr, allowed_token_ids_stride,
               num_logit_bias_ptr, bias_token_ids_ptr, bias_token_ids_stride, bias_ptr,
               bias_stride, pos_ptr, min_lens_ptr, num_stop_token_ids_ptr,
               restore_when_all_masked_ptr, stop_token_ids_ptr, stop_token_ids_stride,
               BLOCK_SIZE, LOGITS_BLOCK_SIZE, CHECK_ALL_MASKED_ROWS):
    """Per row: only the allowed tokens kept (the rest -inf), the logit biases added, and
    before min_tokens the stop tokens masked (restored where that masks the whole row and the
    request asks for it)."""
    for t, state in enumerate(expanded_idx_mapping_ptr[:logits_ptr.shape[0]].tolist()):
        row = logits_ptr[t, :vocab_size]
        n = int(num_allowed_token_ids_ptr[state])
        if n > 0:
            allowed = allowed_token_ids_ptr[state, :n].to(torch.int64)
            kept = row[allowed].clone()
            row.fill_(float("-inf"))
            row[allowed] = kept
        n = int(num_logit_bias_ptr[state])
        if n > 0:
            ids = bias_token_ids_ptr[state, :n].to(torch.int64)
            row[ids] = row[ids] + bias_ptr[state, :n].to(row.dtype)
        n = int(num_stop_token_ids_ptr[state])
        if n > 0 and int(pos_ptr[t]) + 1 < int(min_lens_ptr[state]):
            stops = stop_token_ids_ptr[state, :n].to(torch.int64)
            saved = row[stops].clone()
            row[stops] = float("-inf")
            if (CHECK_ALL_MASKED_ROWS and int(restore_when_all_masked_ptr[state])
                    and bool((row == float("-inf")).all())):
                finite = saved.isfinite()
                row[stops[finite]] = saved[finite]


def bad_words(logits_ptr, logits_stride, expanded_idx_mapping_ptr, bad_word_token_ids_ptr,
              bad_word_token_ids_stride, bad_word_offsets_ptr, bad_word_offsets_stride,
              num_bad_words_ptr, all_token_ids_ptr, all_token_ids_stride, prompt_len_ptr,
              total_len_ptr, input_ids_ptr, expanded_local_pos_ptr):
    """A bad word's last token masked (-inf) where the tokens before it end the output so far
    (the committed output, then this step's draft tokens)."""
    positions = expanded_local_pos_ptr.tolist()
    for t, state in enumerate(expanded_idx_mapping_ptr[:logits_ptr.shape[0]].tolist()):
        pos = positions[t]
        prompt_len, total_len = int(prompt_len_ptr[state]), int(total_len_ptr[state])
        output_len = total_len - prompt_len
        output = all_token_ids_ptr[state, prompt_len:total_len].tolist()
        drafts = input_ids_ptr[t - pos + 1: t + 1].tolist()  # local positions 1..pos
        seen = output + drafts  # effective_len tokens
        offsets = bad_word_offsets_ptr[state].tolist()
        words = bad_word_token_ids_ptr[state].tolist()
        for w in range(int(num_bad_words_ptr[state])):
            word = words[offsets[w]:offsets[w + 1]]
            prefix = word[:-1]
            if len(prefix) > output_len + pos:
                continue
            if not prefix or seen[len(seen) - len(prefix):] == prefix:
                logits_ptr[t, word[-1]] = float("-inf")


def prompt_logprobs_token_ids(prompt_logprobs_token_ids_ptr, query_start_loc_ptr,
                              idx_mapping_ptr, num_computed_tokens_ptr, all_token_ids_ptr,
                              all_token_ids_stride, BLOCK_SIZE):
    """Each scheduled prompt position's next token (the one its logprob is of)."""
    qsl = query_start_loc_ptr.tolist()
    width = all_token_ids_ptr.shape[1]
    for b, state in enumerate(idx_mapping_ptr.tolist()):
        start, end = qsl[b], qsl[b + 1]
        first = int(num_computed_tokens_ptr[state]) + 1
        row = all_token_ids_ptr[state, first:min(first + end - start, width)]
        out = prompt_logprobs_token_ids_ptr[start:end]
        out[:row.shape[0]] = row.to(out.dtype)
        out[row.shape[0]:] = 0  # past the row (the kernel reads on into memory beyond it)


def grammar_bitmask(logits_ptr, logits_stride, logits_indices_ptr, cu_num_logits_ptr,
                    bitmask_ptr, bitmask_stride, vocab_size, MASK_STRIDE, BLOCK_SIZE):
    """Structured output: each mask's logits row (request, position) keeps the tokens whose bit
    is set; the others become -inf. A position past the request's logits is left alone."""
    cu = cu_num_logits_ptr.tolist()
    for m, mapping in enumerate(logits_indices_ptr[:bitmask_ptr.shape[0]].tolist()):
        req, position = divmod(mapping, MASK_STRIDE)
        if position >= cu[req + 1] - cu[req]:
            continue
        allowed = _unpacked_bits(bitmask_ptr[m], vocab_size)
        logits_ptr[cu[req] + position, :vocab_size].masked_fill_(~allowed, float("-inf"))
