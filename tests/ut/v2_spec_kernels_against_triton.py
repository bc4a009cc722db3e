"""Runs vLLM's Model Runner V2 speculative-decoding wrappers (and its Gumbel-max sampling)
twice on the same inputs: with vLLM's own Triton kernels (Triton's CPU interpreter,
TRITON_INTERPRET=1, set before anything imports Triton) and with the simulator's torch versions
registered in their place (device/sim/v2_spec_kernels.py), and prints one JSON line per case:
its name and whether every output tensor agreed exactly. Run by
tests/ut/test_sim_v2_spec_kernels.py in a subprocess."""

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language.extra.libdevice  # noqa: E402
import vllm.triton_utils as triton_utils  # noqa: E402

# vLLM takes Triton for absent where no GPU driver is active: hand it the interpreter's before its
# kernel modules import it.
triton_utils.triton, triton_utils.tl = triton, triton.language
triton_utils.tldevice = triton.language.extra.libdevice
from vllm.v1.worker.gpu.input_batch import InputBuffers  # noqa: E402
from vllm.v1.worker.gpu.spec_decode import rejection_sampler as rs  # noqa: E402
from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils as rsu  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.target_dependent_ar import speculator as ar  # noqa: E402

VOCAB = 9000  # two vocabulary blocks of the kernels' 8192
K = 3  # drafts a request
# Requests: (temperature, seed, number of drafts its target agrees with, a placeholder row)
REQUESTS = [(0.0, 1, 3, False), (0.0, 2, 1, False), (0.8, 3, 0, False), (1.0, 4, 2, True),
            (1.3, 5, 3, False), (0.0, 6, 0, True)]


def rejection_inputs(with_draft_logits: bool, synthetic: bool, fp64: bool):
    g = torch.Generator().manual_seed(0)
    n = len(REQUESTS)
    num_logits = n * (K + 1)
    target = torch.randn(num_logits, VOCAB, generator=g) * 3
    draft_logits = (torch.randn(n, K, VOCAB, generator=g) * 3) if with_draft_logits else None
    drafts = torch.randint(0, VOCAB, (num_logits,), generator=g)
    for b, (_, _, agree, placeholder) in enumerate(REQUESTS):
        rows = target[b * (K + 1): (b + 1) * (K + 1)]
        for i in range(agree):  # the target's argmax (block 2 for some), dominant, is the
            # next draft: a sampled request that still rejects it (synthetic rates) must not
            # draw it again
            rows[i, rows[i].argmax()] += 30
            drafts[b * (K + 1) + i + 1] = int(rows[i].argmax())
        if placeholder:
            drafts[b * (K + 1) + K] = -1
    cu = torch.arange(0, num_logits + 1, K + 1, dtype=torch.int32)
    idx_mapping = torch.tensor([5, 0, 3, 1, 4, 2], dtype=torch.int64)
    state_order = idx_mapping.tolist()
    temperature = torch.zeros(8, dtype=torch.float32)
    seeds = torch.zeros(8, dtype=torch.int64)
    for b, (temp, seed, _, _) in enumerate(REQUESTS):
        temperature[state_order[b]], seeds[state_order[b]] = temp, seed * 7919
    expanded = idx_mapping.repeat_interleave(K + 1)
    local = torch.arange(K + 1).repeat(n)
    pos = torch.arange(num_logits, dtype=torch.int64) + 100
    if draft_logits is not None:  # by request state, as the drafter caches them
        by_state = torch.zeros(8, K, VOCAB)
        by_state[idx_mapping] = draft_logits
        draft_logits = by_state
    rates = torch.tensor([0.9, 0.5, 0.2]) if synthetic else None
    return dict(target_logits=target, draft_logits=draft_logits, draft_sampled=drafts,
                cu_num_logits=cu, pos=pos, idx_mapping=idx_mapping,
                expanded_idx_mapping=expanded, expanded_local_pos=local,
                temperature=temperature, seed=seeds, num_speculative_steps=K,
                synthetic_conditional_rates=rates, use_fp64=fp64)


def run_rejection(kwargs):
    sampled, num_sampled = rsu.rejection_sample(**kwargs)
    # Past num_sampled a row holds whatever the kernels left: only the tokens sampled count.
    return [torch.cat([sampled[b, :n] for b, n in enumerate(num_sampled.tolist())]), num_sampled]


def run_gather():
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (32,), generator=g, dtype=torch.int32)
    positions = torch.arange(32, dtype=torch.int64) + 3
    logits_indices = torch.tensor([1, 2, 3, 7, 8, 9, 10, 20], dtype=torch.int64)
    expanded = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2], dtype=torch.int64)
    local = torch.tensor([0, 1, 2, 0, 1, 2, 3, 0], dtype=torch.int32)
    prefill_len = torch.tensor([2, 13, 9], dtype=torch.int32)
    return list(rs.gather_draft_sampled(input_ids, positions, logits_indices, expanded, local,
                                        prefill_len))


def run_flatten():
    sampled = torch.arange(24, dtype=torch.int64).view(6, 4)
    num_sampled = torch.tensor([1, 4, 2, 3, 1, 2], dtype=torch.int32)
    cu = torch.arange(0, 25, 4, dtype=torch.int32)
    flat = torch.zeros(24, dtype=torch.int64)
    rs._flatten_sampled_kernel[(6,)](flat, sampled, sampled.stride(0), num_sampled, cu,
                                     num_warps=1)
    return [flat]


class Batch:  # what prepare_prefill_inputs reads of an InputBatch
    def __init__(self):
        self.num_reqs = 3
        self.input_ids = torch.arange(100, 112, dtype=torch.int32)
        self.positions = torch.arange(40, 52, dtype=torch.int64)
        self.idx_mapping = torch.tensor([2, 0, 1], dtype=torch.int64)
        self.query_start_loc = torch.tensor([0, 4, 5, 9], dtype=torch.int32)
        self.seq_lens = torch.tensor([44, 20, 33], dtype=torch.int32)


def run_draft_inputs():
    buffers = InputBuffers(max_num_reqs=6, max_num_tokens=16, device=torch.device("cpu"))
    for t in (buffers.input_ids, buffers.positions, buffers.query_start_loc, buffers.seq_lens):
        t.fill_(-7)
    last = torch.full((6,), -7, dtype=torch.int64)
    step = torch.tensor(5, dtype=torch.int64)
    num_sampled = torch.tensor([2, 0, 1], dtype=torch.int32)
    num_rejected = torch.tensor([1, 0, 3], dtype=torch.int32)
    last_sampled = torch.tensor([900, 901, 902, 903], dtype=torch.int64)
    next_prefill = torch.tensor([[800, 801, 802, 803]], dtype=torch.int32)[0]
    batch = Batch()
    ar.prepare_prefill_inputs(last, step, buffers, batch, num_sampled, num_rejected,
                              last_sampled, next_prefill, 6)
    out = [last.clone(), step.clone(), buffers.input_ids[:12].clone(),
           buffers.positions[:12].clone(), buffers.query_start_loc.clone(),
           buffers.seq_lens.clone()]
    draft_tokens = torch.tensor([[11, 12], [21, 22], [31, 32]], dtype=torch.int64)
    sample_src = torch.tensor([60, 70, 80, 0, 0, 0], dtype=torch.int64)
    buffers.positions[:3] = torch.tensor([50, 510, 60])
    ar.prepare_decode_inputs(draft_tokens[:, 0], batch.seq_lens, num_rejected, buffers,
                             sample_src, 512, 6)
    out += [buffers.input_ids[:6].clone(), buffers.positions[:6].clone(), sample_src.clone(),
            buffers.query_start_loc.clone(), buffers.seq_lens.clone()]
    hidden_in = torch.zeros(16, 8)
    hidden_out = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    output_drafts = torch.zeros(6, 2, dtype=torch.int64)
    for s in (0, 1):
        step.fill_(s)
        ar.update_draft_inputs(torch.tensor([41 + s, 42 + s, 43 + s]), step, hidden_out,
                               output_drafts, hidden_in, buffers, sample_src, 3, 512, 2)
        out += [output_drafts.clone(), hidden_in.clone(), buffers.input_ids[:6].clone(),
                buffers.positions[:6].clone(), buffers.seq_lens.clone(), sample_src.clone()]
    return out


def run_gumbel(use_fp64: bool, is_drafting: bool):
    """V2's sampler's and drafter's draws (sample/gumbel.py)."""
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, VOCAB, generator=g) * 2
    expanded = torch.tensor([5, 0, 3, 1, 4, 2], dtype=torch.int64)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.5, 0.0, 0.9])
    seeds = torch.tensor([11, 2**40 + 3, 7, 2**63 - 5, 0, 99], dtype=torch.int64)
    pos = torch.tensor([3, 17, 500, 2**31 + 1, 8, 64], dtype=torch.int64)
    # (The drafter's logits cache is left out: Triton's interpreter cannot run its masked store.)
    return [gumbel_sample(logits, expanded, temperature, seeds, pos, apply_temperature=True,
                          is_drafting=is_drafting, use_fp64=use_fp64)]


CASES = {
    "Gumbel-max draws, fp32": lambda: run_gumbel(False, False),
    "Gumbel-max draws, fp64": lambda: run_gumbel(True, False),
    "the drafter's draws": lambda: run_gumbel(False, True),
    "greedy and sampled, one-hot drafts": lambda: run_rejection(
        rejection_inputs(False, False, False)),
    "sampled with the drafter's logits": lambda: run_rejection(
        rejection_inputs(True, False, False)),
    "synthetic acceptance rates": lambda: run_rejection(rejection_inputs(False, True, False)),
    "fp64 Gumbel noise": lambda: run_rejection(rejection_inputs(True, False, True)),
    "draft rows gathered, placeholders -1": run_gather,
    "sampled tokens flattened": run_flatten,
    "draft prefill and decode inputs": run_draft_inputs,
}


def main():
    from vllm_ascend import patch
    from vllm_ascend.platform import NPUPlatform

    patch.apply()
    expected = {name: case() for name, case in CASES.items()}
    NPUPlatform.register_triton_kernel_overrides()
    for name, case in CASES.items():
        made = case()
        same = len(made) == len(expected[name]) and all(
            a.shape == b.shape and bool(torch.equal(a, b))
            for a, b in zip(made, expected[name]))
        diff = "" if same else f"triton {[t.tolist() for t in expected[name]][:3]} " \
                               f"sim {[t.tolist() for t in made][:3]}"
        print(json.dumps({"case": name, "same": same, "diff": diff[:2000]}), flush=True)


if __name__ == "__main__":
    main()
