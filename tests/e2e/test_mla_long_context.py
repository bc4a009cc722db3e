"""Long-context MLA prefill (attention/mla.py): a request's cached context is attended to in
chunks of at most ``mla_prefill_chunk_tokens`` tokens (by default the scheduler's token budget),
merged by the softmax LSE with ``npu_attention_update``. A prompt of about 2,000 tokens is
prefilled 256 tokens a step, so its last steps attend to some 1,800 tokens of context.

Measured in the engine's own process on the simulated device (the peak of torch's allocator
while a request is served): with chunks of 256 the prefill's peak is the same for a 1,000- and a
2,000-token prompt, and within what the profile run kept from the KV cache; with the whole
context in one chunk (the prefill before chunking) the peak grows with the context. The two
answer alike."""

import pytest
from vllm import SamplingParams

from tests.e2e.conftest import (check_logprobs_close, engine, hf_greedy, model_path, TOPK,
                                word_prompt)
from vllm_ascend.device import torch_npu

pytestmark = pytest.mark.slow  # the full tier; test_mla.py's chunked prompt runs in both
MiB = 1 << 20
BATCHED = 256
LONG = 4096  # one chunk holds the whole context: the prefill as it was before chunking
# Measured (the peak above the allocation before a request, a 2,000-word prompt's minus a
# 1,000-word one's, tiny DeepSeek-V2 in bfloat16): chunks of 256: 0.07 MiB; one chunk: 2.28 MiB.
FLAT, GROWS = MiB // 2, 3 * MiB // 2
# The request's own bookkeeping (its token lists, the step's metadata: in-process, on the heap
# the simulator counts as the device's) beside the profile run's peak: measured 0.06 MiB.
HOST_SLACK = MiB // 4
MAX_TOKENS = 4


def peak_above_before(run):
    """``run()``'s result and the device's peak allocation while it ran, above the allocation
    before it (the engine runs in this process)."""
    torch_npu.npu.synchronize()
    before = torch_npu.npu.memory_allocated()
    torch_npu.npu.reset_peak_memory_stats()
    result = run()
    torch_npu.npu.synchronize()
    return result, torch_npu.npu.max_memory_allocated() - before


def serve_measured(llm, text: str):
    """The answer to ``text`` and the peak above the allocation before it was served."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOPK)
    return peak_above_before(lambda: llm.generate([text], params, use_tqdm=False)[0])


def profile_peak(worker) -> int:
    """The profile run's peak above the allocation before it, measured as a request's (run
    again on the serving engine: past its first-use allocations)."""
    return peak_above_before(worker.model_runner.profile_run)[1]


@pytest.fixture(scope="module")
def measured():
    """Per chunk size: the answers and peaks for a 1,000- and a 2,000-token prompt, and the
    profile run's peak."""
    results = {}
    for chunk in (None, LONG):
        extra = {} if chunk is None else {"additional_config": {"mla_prefill_chunk_tokens": chunk}}
        with engine(model_path("deepseek_v2"), enforce_eager=True, dtype="bfloat16",
                    max_model_len=LONG, max_num_batched_tokens=BATCHED, max_num_seqs=2,
                    enable_prefix_caching=False,
                    hf_overrides={"max_position_embeddings": LONG}, **extra) as llm:
            tokens = len(llm.get_tokenizer()(word_prompt(2000)).input_ids)
            serve_measured(llm, word_prompt(2000))  # first-use allocations (the host's, vLLM's)
            runs = {words: serve_measured(llm, word_prompt(words)) for words in (1000, 2000)}
            results[chunk] = dict(runs=runs, tokens=tokens,
                                  profiled=llm.collective_rpc(profile_peak)[0])
    return results


def test_a_long_context_is_prefilled_in_chunks_of_flat_memory(measured):
    chunked, whole = measured[None], measured[LONG]
    assert chunked["tokens"] > 1800
    growth = {k: r["runs"][2000][1] - r["runs"][1000][1] for k, r in measured.items()}
    print(f"peak growth from 1,000 to 2,000 words: {growth[None] / MiB:.2f} MiB in chunks of "
          f"{BATCHED}, {growth[LONG] / MiB:.2f} MiB in one chunk")
    assert growth[None] < FLAT, growth
    assert growth[LONG] > GROWS, growth
    # What serving takes above the allocation before it stays within what the profile run
    # takes (the activation peak the KV cache leaves room for): it reserves a chunk's tensors.
    for chunk, r in measured.items():
        served, profiled = r["runs"][2000][1], r["profiled"]
        print(f"chunk {chunk or BATCHED}: served {r['runs'][1000][1] / MiB:.2f} MiB (1,000 "
              f"words), {served / MiB:.2f} MiB (2,000) above the allocation before; the profile "
              f"run {profiled / MiB:.2f} MiB")
        assert served <= profiled + HOST_SLACK, (chunk, served, profiled)


def test_chunked_context_answers_as_one_chunk_close_to_hf(measured):
    """Both close to HF transformers' float32 model by the suite's rule (the chunks' bfloat16
    partial results, merged in float32, round differently from one chunk's), with the same
    tokens."""
    for words in (1000, 2000):
        reference = hf_greedy(model_path("deepseek_v2"), word_prompt(words), MAX_TOKENS)
        outs = {k: measured[k]["runs"][words][0].outputs[0] for k in (None, LONG)}
        for chunk, out in outs.items():
            check_logprobs_close(reference, (list(out.token_ids), [
                {t: lp.logprob for t, lp in step.items()} for step in out.logprobs]),
                f"MLA, {words} words, context in chunks of {chunk or BATCHED}")
        assert outs[None].token_ids == outs[LONG].token_ids
