"""Check a parallel layout in graph mode, in each graph mode asked for: greedy output against HF
transformers' under the logprob-closeness rule, and each rank's graphs, replays and streams. The
suite runs one mode per layout (tests/e2e/test_parallel.py, test_mp_executor.py, which runs this
script); this checks the others, or a layout of your own.

    python scripts/check_parallel.py --tensor-parallel-size 4
    python scripts/check_parallel.py --pipeline-parallel-size 2 --modes FULL_DECODE_ONLY
    python scripts/check_parallel.py --tensor-parallel-size 2 --speculative eagle
    python scripts/check_parallel.py --tensor-parallel-size 2 --family qwen2_moe \
        --enable-expert-parallel --dtype float16
    python scripts/check_parallel.py --family deepseek_v3_mtp --speculative mtp \
        --num-speculative-tokens 1 --modes FULL_DECODE_ONLY FULL_AND_PIECEWISE
"""

import argparse
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # the repo's tests/

MODES = ["PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


def check(mode: str, family: str, tp: int, pp: int, speculative: str | None,
          expert_parallel: bool = False, dtype: str = "bfloat16", k: int = 3,
          executor: str = "mp") -> None:
    from tests.e2e.conftest import (PROMPTS, check_logprobs_close, engine,
                                    graph_counts_per_rank, hf_greedy, MAX_TOKENS,
                                    model_path, speculative_config, vllm_greedy)

    n = MAX_TOKENS
    extra, sizes = {}, [1, 2, 4]
    if speculative:  # capture sizes are multiples of 1 + K
        extra["speculative_config"] = speculative_config(family, speculative, k)
        sizes = [(1 + k) * m for m in (1, 2, 4)]
    with engine(model_path(family), tensor_parallel_size=tp, pipeline_parallel_size=pp,
                enable_expert_parallel=expert_parallel, dtype=dtype, disable_log_stats=False,
                distributed_executor_backend=executor, max_num_seqs=4, compilation_config={
                    "cudagraph_mode": mode, "cudagraph_capture_sizes": sizes}, **extra) as llm:
        outs = vllm_greedy(llm, PROMPTS, n)
        ranks = graph_counts_per_rank(llm)
        summary = llm.ascend_summary
        spec = {m.name.removeprefix("vllm:spec_decode_"): m.value for m in llm.get_metrics()
                if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}
    for prompt, out in zip(PROMPTS, outs):
        check_logprobs_close(hf_greedy(model_path(family), prompt, n), out, f"{mode} {prompt!r}",
                             dtype=dtype)
    print(f"{mode}: {len(PROMPTS)} of {len(PROMPTS)} answers close to HF transformers'")
    print("engine:", json.dumps(summary))  # what it ran (NPUWorker.summary), for the test suite
    for rank, counts in enumerate(ranks):
        print(f"  rank {rank}: captured {counts['captured']}, replayed {counts['replayed']}, "
              f"drafter {counts.get('drafter', 'none')}, streams {counts['streams_in_use']}")
    if speculative:
        print(f"  spec decode: {spec}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--family", default="llama",
                        choices=["llama", "qwen2", "qwen3", "smollm2", "qwen3_moe", "qwen2_moe",
                                 "deepseek_v2", "deepseek_v2_moe", "deepseek_v3_mtp"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                        help="float16 for MoE models across ranks (docs/moe.md#tests-and-figures)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="split a mixture-of-experts model's experts over the ranks")
    parser.add_argument("--modes", nargs="+", default=MODES, choices=["NONE"] + MODES)
    parser.add_argument("--speculative", choices=["ngram", "draft_model", "eagle", "mtp"],
                        help="speculative decoding with this method")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "ray"],
                        help="ray: vLLM's Ray executor on the cluster at $RAY_ADDRESS "
                             "(docs/multi_node.md)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ASCEND_SIM_MEMORY_GB", "1")  # one simulated device per worker
    os.environ.setdefault("HCCL_BUFFSIZE", "8")  # 2 x 8 MB per communicator fits a 1 GiB device
    for mode in args.modes:
        check(mode, args.family, args.tensor_parallel_size, args.pipeline_parallel_size,
              args.speculative, args.enable_expert_parallel, args.dtype,
              args.num_speculative_tokens, args.distributed_executor_backend)


if __name__ == "__main__":
    main()
