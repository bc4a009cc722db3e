"""Decode tokens/s and ms per step, per graph mode, measured side by side in one run.

    bash scripts/run_tests.sh --co -q >/dev/null   # (any README command sets up the venv)
    python benchmarks/decode_throughput.py --models tiny smollm2 --modes eager PIECEWISE

Each (model, mode) gets one engine; each batch size is timed after a warm-up generation.
Ratios are against eager in the same run.
"""

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_ASCEND_SIM_MEMORY_GB", "2")


def engine_args(mode: str) -> dict:
    if mode == "eager":
        return {"enforce_eager": True}
    return {"compilation_config": {"cudagraph_mode": mode}}


def measure(llm, batch: int, tokens: int) -> tuple[float, float]:
    from vllm import SamplingParams

    prompts = [f"Request {i}: tell me a story about the number {i}." for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return batch * tokens / elapsed, 1000 * elapsed / tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--modes", nargs="+", default=["eager"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--classes", nargs="+", default=["ours"], choices=["ours", "upstream"],
                        help="model classes: vllm-ascend's per-family files or upstream vLLM's")
    args = parser.parse_args()

    from vllm import LLM

    from scripts.models import smollm2_dir, tiny_model_dir

    paths = {"tiny": tiny_model_dir("llama"), "smollm2": str(smollm2_dir())}
    results = {}
    for model in args.models:
        for classes in args.classes:
            # vLLM's plugin allow-list, read by every process the engine spawns: the platform
            # plugin alone loads upstream's model classes; both load the per-family files.
            os.environ["VLLM_PLUGINS"] = "ascend" if classes == "upstream" else \
                "ascend,ascend_models"
            for mode in args.modes:
                start = time.perf_counter()
                llm = LLM(paths[model], dtype="bfloat16", max_model_len=512, seed=0,
                          max_num_seqs=max(args.batches), **engine_args(mode))
                startup = time.perf_counter() - start
                for batch in args.batches:
                    results[(model, classes, mode, batch)] = measure(llm, batch, args.tokens)
                print(f"[{model} {classes} {mode}] engine start {startup:.1f} s", flush=True)
                llm.llm_engine.engine_core.shutdown()
                del llm
                gc.collect()

    print(f"\n{'model':8} {'classes':9} {'mode':20} {'batch':>5} {'tok/s':>9} {'ms/step':>9} "
          f"{'vs eager':>9} {'vs upstream':>11}")
    for (model, classes, mode, batch), (tps, ms) in results.items():
        base = results.get((model, classes, "eager", batch))
        up = results.get((model, "upstream", mode, batch))
        ratio = f"{tps / base[0]:.2f}x" if base else "-"
        vs_up = f"{tps / up[0]:.2f}x" if up and classes != "upstream" else "-"
        print(f"{model:8} {classes:9} {mode:20} {batch:5d} {tps:9.1f} {ms:9.2f} {ratio:>9} "
              f"{vs_up:>11}")


if __name__ == "__main__":
    main()
