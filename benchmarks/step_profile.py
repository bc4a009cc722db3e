"""Where one decode step's time goes, per graph mode: the table in docs/performance.md.

    bash scripts/run_tests.sh --co -q >/dev/null   # (any README command sets up the venv)
    python benchmarks/step_profile.py --model smollm2 --modes eager PIECEWISE FULL \
        FULL_AND_PIECEWISE --batch 1
    python benchmarks/step_profile.py --model tiny --modes PIECEWISE FULL_AND_PIECEWISE \
        --runners v1 v2          # vLLM's Model Runner V2 beside V1 (docs/model_runner_v2.md)

Each mode runs twice. First in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), with timers around
the engine's phases (this script wraps vLLM's and the simulator's functions; the product is
unchanged): the decode step is split into scheduler, input preparation (vLLM's and the builder's
per-step copies), the forward (graph replay or eager ops), of which attention (the simulated FIA
kernels) and FIA task updates, the LM head, sampling, output processing, and the rest of the
engine loop. Then as users run it (engine core in its own process): the extra time per step is
the frontend-engine IPC and the CPU contention between the two processes.

A second table is the chip-cost ledger of a decode step in each mode, counted by the simulator
in-process (vllm_ascend/device/sim/ledger.py): kernel launches (device ops launched one by one),
graph replays, FIA task updates, blocking device-to-host syncs and host-to-device copies.

Decode only: each phase's time over `1 + N` generated tokens minus its time over 1 token (the
prefill), divided by N.
"""

import argparse
import collections
import functools
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_ASCEND_SIM_MEMORY_GB", "2")

from benchmarks.decode_throughput import engine_args, prompts_for  # noqa: E402
from tests.e2e.conftest import chip_cost_per_decode_step  # noqa: E402

TIMES: collections.Counter = collections.Counter()

# (row, class path, method): the phases timed in-process, outermost first.
PHASES = [
    ("step (frontend + engine)", "vllm.v1.engine.llm_engine.LLMEngine", "step"),
    ("engine core step", "vllm.v1.engine.core.EngineCore", "step"),
    # (with async scheduling, vLLM's default, the engine steps through its batch queue)
    ("engine core step", "vllm.v1.engine.core.EngineCore", "step_with_batch_queue"),
    ("scheduler", "vllm.v1.core.sched.scheduler.Scheduler", "schedule"),
    ("scheduler", "vllm.v1.core.sched.scheduler.Scheduler", "update_from_output"),
    ("input preparation", "vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_update_states"),
    ("input preparation", "vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_prepare_inputs"),
    ("input preparation", "vllm_ascend.worker.model_runner.NPUModelRunner",
     "_build_attention_metadata"),
    ("forward", "vllm_ascend.worker.model_runner.NPUModelRunner", "_model_forward"),
    # Model Runner V2's (its eager forward: the model's own forward, wrapped per engine)
    ("input preparation", "vllm.v1.worker.gpu.model_runner.GPUModelRunner", "prepare_inputs"),
    ("input preparation", "vllm.v1.worker.gpu.model_runner.GPUModelRunner", "prepare_attn"),
    ("input preparation", "vllm.v1.worker.gpu.model_states.default.DefaultModelState",
     "prepare_attn"),
    ("forward", "vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager", "run_pw_graph"),
    ("forward", "vllm_ascend.worker.v2.graphs.NPUModelGraphManager", "run_fullgraph"),
    ("sampling", "vllm.v1.worker.gpu.model_runner.GPUModelRunner", "sample_tokens"),
    ("  attention (FIA kernels)", "vllm_ascend.device.sim.fia", "fia_kernel"),
    ("  FIA task updates", "vllm_ascend.device.sim.graph.SimGraph", "task_update"),
    ("LM head", None, "compute_logits"),  # on the engine's model instance
    ("sampling", "vllm.v1.worker.gpu_model_runner.GPUModelRunner", "sample_tokens"),
]
ROWS = ["scheduler", "input preparation", "forward", "  attention (FIA kernels)",
        "  FIA task updates", "LM head", "sampling"]


def timed(row, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[row] += time.perf_counter() - start
    return wrapper


def install_timers() -> None:
    """Wrap each phase's function, before the in-process engine binds any of them."""
    import importlib

    for row, path, name in PHASES:
        if path is None:
            continue
        try:
            owner = importlib.import_module(path)
        except ModuleNotFoundError:
            module, cls = path.rsplit(".", 1)
            owner = getattr(importlib.import_module(module), cls)
        setattr(owner, name, timed(row, getattr(owner, name)))


def decode_split(llm, batch: int, tokens: int, repeats: int = 3) -> dict:
    """Per decode step, ms: each timed phase and the wall time, the fastest of `repeats`."""
    from vllm import SamplingParams

    def run(n):
        TIMES.clear()
        start = time.perf_counter()
        llm.generate(prompts_for(batch), SamplingParams(temperature=0, max_tokens=n,
                                                       ignore_eos=True), use_tqdm=False)
        return dict(TIMES, wall=time.perf_counter() - start)

    run(4)
    short = min((run(1) for _ in range(repeats)), key=lambda t: t["wall"])
    long = min((run(1 + tokens) for _ in range(repeats)), key=lambda t: t["wall"])
    return {k: 1000 * (long.get(k, 0) - short.get(k, 0)) / tokens for k in long}


def start(path, mode, batch):
    from vllm import LLM

    return LLM(path, dtype="bfloat16", max_model_len=512, seed=0, max_num_seqs=max(batch, 16),
               **engine_args(mode))


def stop(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    parser.add_argument("--modes", nargs="+",
                        default=["eager", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runners", nargs="+", default=["v1"], choices=["v1", "v2"],
                        help="vLLM's model runners (VLLM_USE_V2_MODEL_RUNNER), side by side")
    args = parser.parse_args()

    from scripts.models import smollm2_dir, tiny_model_dir

    path = str(smollm2_dir()) if args.model == "smollm2" else tiny_model_dir("llama")
    install_timers()
    split, ledgers = {}, {}
    columns = [(mode, runner) for runner in args.runners for mode in args.modes]
    labels = [mode if len(args.runners) == 1 else f"{mode} {runner.upper()}"
              for mode, runner in columns]
    for (mode, runner), label in zip(columns, labels):
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        llm = start(path, mode, args.batch)
        multiprocess = decode_split(llm, args.batch, args.tokens)["wall"]
        stop(llm)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        llm = start(path, mode, args.batch)
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        model.compute_logits = timed("LM head", model.compute_logits)
        if runner == "v2" and mode == "eager":  # V2 calls the model itself when eager
            model.forward = timed("forward", model.forward)
        t = decode_split(llm, args.batch, args.tokens)
        if runner == "v2":  # V2 computes the logits inside sample_tokens
            t["sampling"] = t.get("sampling", 0) - t.get("LM head", 0)
        ledgers[label] = chip_cost_per_decode_step(llm, args.batch, args.tokens)
        stop(llm)
        t["multiprocess"] = multiprocess
        split[label] = t
    args.modes = labels  # the tables' columns

    def row(name, values):
        print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in values) + " |")

    print(f"\n{args.model}, batch {args.batch}, ms per decode step (bf16, "
          f"{os.cpu_count()} cores)\n")
    print("| phase | " + " | ".join(args.modes) + " |")
    print("|---" * (len(args.modes) + 1) + "|")
    for name in ROWS:
        row(name, [split[m].get(name, 0) for m in args.modes])
    row("output processing (frontend)", [split[m]["step (frontend + engine)"]
                                         - split[m]["engine core step"] for m in args.modes])

    timed_in_core = ("scheduler", "input preparation", "forward", "LM head", "sampling")
    row("rest of the engine loop", [split[m]["engine core step"]
                                    - sum(split[m].get(k, 0) for k in timed_in_core)
                                    for m in args.modes])
    row("**total, in-process**", [split[m]["wall"] for m in args.modes])
    row("IPC and process contention", [split[m]["multiprocess"] - split[m]["wall"]
                                       for m in args.modes])
    row("**total, as served (engine process)**", [split[m]["multiprocess"] for m in args.modes])

    from vllm_ascend.device.sim.ledger import ROWS as LEDGER_ROWS

    print(f"\nChip-cost ledger: per decode step, what a chip would be asked to do (the "
          f"simulator's counts)\n")
    print("| per decode step | " + " | ".join(args.modes) + " |")
    print("|---" * (len(args.modes) + 1) + "|")
    for name in LEDGER_ROWS:
        row(name, [ledgers[m][name] for m in args.modes])


if __name__ == "__main__":
    main()
