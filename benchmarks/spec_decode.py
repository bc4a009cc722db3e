"""Speculative decoding against none, side by side in one run: tokens/s of greedy generation on
repetitive prompts (code and a repeated list), with vLLM's acceptance metrics.

    bash scripts/run_tests.sh --co -q >/dev/null   # (any README command sets up the venv)
    python benchmarks/spec_decode.py --model smollm2 --mode FULL_DECODE_ONLY \
        --methods none ngram --k 3 --batches 1 4

Each configuration runs in its own engine: a warm-up generation, then the fastest of 3
generations of --tokens new tokens per request (prefill included, EOS ignored). tok/s counts
generated tokens. Acceptance rate = accepted / drafted tokens; mean accepted length = 1 +
accepted / drafts (tokens per verify step), both over the timed runs, from vLLM's
spec-decode counters.
"""

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_ASCEND_SIM_MEMORY_GB", "2")

PROMPTS = [
    "def add_1(x):\n    return x + 1\n\ndef add_2(x):\n    return x + 2\n\n"
    "def add_3(x):\n    return x + 3\n\ndef add_4(x):\n",
    "apple, banana, cherry, apple, banana, cherry, apple, banana, cherry, apple,",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Monday, Tuesday, Wednesday,",
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1,",
]


def spec_counters(llm) -> dict:
    return {m.name.removeprefix("vllm:spec_decode_"): m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    parser.add_argument("--mode", default="FULL_DECODE_ONLY", help="a cudagraph_mode, or eager")
    parser.add_argument("--methods", nargs="+", default=["none", "ngram"],
                        choices=["none", "ngram", "draft_model"],
                        help="draft_model drafts with the model itself (an upper bound)")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from benchmarks.decode_throughput import engine_args
    from scripts.models import smollm2_dir, tiny_model_dir

    path = str(smollm2_dir()) if args.model == "smollm2" else tiny_model_dir("llama")
    results = {}
    for method in args.methods:
        spec = None
        if method != "none":
            spec = {"method": method, "num_speculative_tokens": args.k}
            spec.update({"prompt_lookup_min": 2, "prompt_lookup_max": 4} if method == "ngram"
                        else {"model": path})
        llm = LLM(path, dtype="bfloat16", max_model_len=512, seed=0,
                  max_num_seqs=max(args.batches), disable_log_stats=False,
                  speculative_config=spec, **engine_args(args.mode))
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        for batch in args.batches:
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
            llm.generate(prompts, params, use_tqdm=False)  # warm-up
            before = spec_counters(llm)
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                best = min(best, time.perf_counter() - start)
            after = spec_counters(llm)
            counts = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            results[(method, batch)] = (batch * args.tokens / best, counts)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()

    print(f"\n{args.model}, {args.mode}, num_speculative_tokens={args.k}, {args.tokens} tokens "
          "per request")
    print(f"{'method':12} {'batch':>5} {'tok/s':>8} {'vs none':>8} {'acceptance':>11} "
          f"{'mean accepted len':>18}")
    for (method, batch), (tps, c) in results.items():
        base = results.get(("none", batch))
        ratio = f"{tps / base[0]:.2f}x" if base and method != "none" else "-"
        drafted = c.get("num_draft_tokens", 0)
        rate = f"{c['num_accepted_tokens'] / drafted:.2f}" if drafted else "-"
        mean = f"{1 + c['num_accepted_tokens'] / c['num_drafts']:.2f}" if c.get("num_drafts") \
            else "-"
        print(f"{method:12} {batch:5d} {tps:8.1f} {ratio:>8} {rate:>11} {mean:>18}")


if __name__ == "__main__":
    main()
