"""Check a mixture-of-experts model served with data parallelism in any graph mode: `vllm serve
--data-parallel-size 2 --enable-expert-parallel` (vLLM 0.32 refuses data parallelism in one LLM
process), four concurrent requests against HF transformers under the logprob-closeness rule,
one request pinned to DP rank 0 while rank 1 idles, and DP engine 0's workers' graph counts.
The suite runs the first line below (tests/e2e/test_data_parallel.py) and serves
FULL_AND_PIECEWISE in test_serve.py and test_defaults.py.

    python scripts/check_data_parallel.py --mode FULL_DECODE_ONLY
    python scripts/check_data_parallel.py --mode FULL_DECODE_ONLY --tensor-parallel-size 2
    VLLM_ASCEND_SIM_SOC=Ascend910_9382 python scripts/check_data_parallel.py \
        --family qwen3_moe_h1024 --mode FULL_DECODE_ONLY
    VLLM_ASCEND_SIM_SOC=Ascend910_9382 python scripts/check_data_parallel.py \
        --family qwen3_moe_h1024 --mode FULL_AND_PIECEWISE --tensor-parallel-size 2

The last two run MC2 (an A3 chip simulated, a hidden size MC2 takes): the script prints the MoE
communication of DP engine 0's steps.
"""

import argparse
import collections
import concurrent.futures
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen3_moe",
                        choices=["qwen3_moe", "qwen2_moe", "qwen3_moe_h1024"])
    parser.add_argument("--mode", default="FULL_DECODE_ONLY",
                        choices=["PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", default="float16", choices=["bfloat16", "float16"])
    args = parser.parse_args()
    os.environ.setdefault("HCCL_BUFFSIZE", "16")  # 2 x 16 MB per communicator, 2 GiB devices

    from tests.e2e.conftest import (check_logprobs_close, hf_greedy, model_path,
                                    served_completion, served_graph_counts, served_rpc,
                                    vllm_server)

    path, tokens = model_path(args.family), 16
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Hi there",
               "Write a short poem about the sea:"]
    with vllm_server(path, "m", "--data-parallel-size", "2", "--enable-expert-parallel",
                     "--tensor-parallel-size", str(args.tensor_parallel_size),
                     "--dtype", args.dtype, "--max-model-len", "512", "--max-num-seqs", "16",
                     "--compilation-config", f'{{"cudagraph_mode": "{args.mode}"}}',
                     start_s=600) as (base, _):
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p: served_completion(base, "m", p, tokens), prompts))
        for prompt, out in zip(prompts, outs):
            check_logprobs_close(hf_greedy(path, prompt, tokens), out, repr(prompt),
                                 dtype=args.dtype)
        print(f"{args.mode}: {len(prompts)} of {len(prompts)} answers close to HF transformers'")
        # what it ran (NPUWorker.summary), for the test suite
        print("engine:", json.dumps(served_rpc(base, "summary")[0]))
        pinned = served_completion(base, "m", "Hi there", tokens, {"X-data-parallel-rank": "0"})
        check_logprobs_close(hf_greedy(path, "Hi there", tokens), pinned, "pinned",
                             dtype=args.dtype)
        print("a request pinned to DP rank 0, rank 1 idle: close to HF transformers'")
        steps = collections.Counter((s["mode"], s["moe_comm"])
                                    for s in served_rpc(base, "recent_steps")[0])
        print("  DP engine 0, TP rank 0 steps by (runtime mode, MoE communication):",
              dict(sorted(steps.items())))
        for rank, counts in enumerate(served_graph_counts(base)):
            print(f"  DP engine 0, TP rank {rank}: captured {counts['captured']}, replayed "
                  f"{counts['replayed']}, streams {counts['streams_in_use']}")


if __name__ == "__main__":
    main()
