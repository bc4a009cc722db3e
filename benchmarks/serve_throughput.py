"""Served throughput: vLLM's own client (``vllm bench serve``) against ``vllm serve``, in the
default graph mode and eager, one server at a time, and in the same run the offline decode step
at the batch the server ran, so that served TPOT / offline step shows what serving adds.

    bash scripts/run_tests.sh --co -q >/dev/null   # (any README command sets up the venv)
    python benchmarks/serve_throughput.py                       # SmolLM2 and a tiny Qwen3-MoE
    python benchmarks/serve_throughput.py --models smollm2 --runs 3

The load is issue 72's: random prompts of 128 tokens, 64 output tokens (EOS ignored), 48
prompts, 16 at a time. Each server is ``vllm serve <model> --dtype bfloat16 --max-model-len
512``, vLLM's defaults otherwise (the graph mode FULL_AND_PIECEWISE), with --enforce-eager in
the eager rows, started as the test suite starts one (tests/e2e/conftest.py's vllm_server, whose
dev mode gives the FULL graphs replayed during the run). The offline step is
benchmarks/decode_throughput.py's (generate N+1 minus 1 tokens, over N, the fastest of 3) at
the concurrency as batch, in an in-process engine started after the servers have stopped.
Ratios: 'graph/eager' is the output tok/s of the graph-mode server over the eager one's;
'TPOT/step' is the served mean TPOT over the offline step of the same mode.
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("VLLM_ASCEND_SIM_MEMORY_GB", "2")

MODES = {"graph": (), "eager": ("--enforce-eager",)}  # the server's arguments beyond the model's
NAME = "served"  # the model's name on the server


def bench_serve(base: str, tokenizer: str, prompts: int, concurrency: int, input_len: int,
                output_len: int) -> dict:
    """What ``vllm bench serve`` measures of the server at ``base`` (the function its command
    runs, in this process) for random prompts of ``input_len`` tokens, EOS ignored."""
    from vllm.benchmarks.serve import main as bench
    from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    BenchmarkServingSubcommand.add_cli_args(parser)
    return bench(parser.parse_args([
        "--backend", "vllm", "--base-url", base, "--model", NAME, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--num-prompts", str(prompts),
        "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0",
        "--disable-tqdm"]))


def offline_step_ms(path: str, mode: str, batch: int, max_model_len: int,
                    tokens: int = 32) -> float:
    """The offline decode step (ms) at ``batch`` with the server's settings, an engine made in
    this process (benchmarks/decode_throughput.py's measure)."""
    import gc

    from vllm import LLM

    from benchmarks.decode_throughput import decode_ms, vllm_generator

    llm = LLM(path, dtype="bfloat16", max_model_len=max_model_len, seed=0,
              enforce_eager=mode == "eager")
    try:
        ms, = decode_ms([vllm_generator(llm)], batch, tokens)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return ms


def measure(path: str, *, runs: int = 1, prompts: int = 48, concurrency: int = 16,
            input_len: int = 128, output_len: int = 64, max_model_len: int = 512) -> dict:
    """{mode: {'served': [bench results, one a run], 'replayed': [FULL graphs replayed in each
    run], 'step_ms': the offline step}}: each mode's server (bfloat16, the model's defaults but
    max_model_len), one at a time, then each mode's offline engine."""
    from tests.e2e.conftest import served_graph_counts, vllm_server

    results = {mode: {"served": [], "replayed": []} for mode in MODES}
    for _ in range(runs):
        for mode, args in MODES.items():
            with vllm_server(path, NAME, "--dtype", "bfloat16", "--max-model-len",
                             str(max_model_len), *args, start_s=900) as (base, _):
                before = served_graph_counts(base)[0]["replayed"].get("FULL", 0)
                results[mode]["served"].append(bench_serve(
                    base, path, prompts, concurrency, input_len, output_len))
                after = served_graph_counts(base)[0]["replayed"].get("FULL", 0)
                results[mode]["replayed"].append(after - before)
    for mode in MODES:
        results[mode]["step_ms"] = offline_step_ms(path, mode, concurrency, max_model_len)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2", "qwen3-moe"],
                        choices=["smollm2", "qwen3-moe", "tiny"])
    parser.add_argument("--runs", type=int, default=1, help="served runs of each mode")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()

    from scripts.models import smollm2_dir, tiny_model_dir

    paths = {"smollm2": lambda: str(smollm2_dir()), "tiny": lambda: tiny_model_dir("llama"),
             "qwen3-moe": lambda: tiny_model_dir("qwen3_moe")}
    rows = []
    for model in args.models:
        found = measure(paths[model](), runs=args.runs, prompts=args.prompts,
                        concurrency=args.concurrency, input_len=args.input_len,
                        output_len=args.output_len)
        for run in range(args.runs):
            eager_tps = found["eager"]["served"][run]["output_throughput"]
            for mode in MODES:
                served = found[mode]["served"][run]
                step = found[mode]["step_ms"]
                rows.append((model, run, mode, served["output_throughput"],
                             served["mean_ttft_ms"], served["mean_tpot_ms"], step,
                             served["mean_tpot_ms"] / step,
                             served["output_throughput"] / eager_tps,
                             found[mode]["replayed"][run]))
        print(f"[{model}] done", flush=True)
    print(f"\n{'model':10} {'run':>3} {'mode':6} {'tok/s':>8} {'TTFT ms':>8} {'TPOT ms':>8} "
          f"{'step ms':>8} {'TPOT/step':>9} {'graph/eager':>11} {'FULL replays':>12}")
    for model, run, mode, tps, ttft, tpot, step, ratio, ge, replayed in rows:
        print(f"{model:10} {run:3d} {mode:6} {tps:8.1f} {ttft:8.0f} {tpot:8.1f} {step:8.1f} "
              f"{ratio:9.2f} {f'{ge:.2f}x' if mode == 'graph' else '':>11} {replayed:12d}")


if __name__ == "__main__":
    main()
