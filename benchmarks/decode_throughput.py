"""Decode ms/step per graph mode, and HF transformers' ``generate`` on the same model and dtype,
measured side by side in one run.

    bash scripts/run_tests.sh --co -q >/dev/null   # (any README command sets up the venv)
    python benchmarks/decode_throughput.py --models tiny smollm2 \
        --modes gemm hf eager PIECEWISE FULL FULL_AND_PIECEWISE --batches 1 8
    python benchmarks/decode_throughput.py --models qwen3-moe qwen2-moe   # mixture of experts
    python benchmarks/decode_throughput.py --models tiny tiny-w8a8-dynamic tiny-w8a8 \
        --modes eager FULL_AND_PIECEWISE                                # W8A8 against bf16
    python benchmarks/decode_throughput.py --models tiny tiny-lora \
        --modes eager FULL_DECODE_ONLY FULL_AND_PIECEWISE             # LoRA against none

Decode time excludes prefill: each batch is generated twice, for 1 and for 1 + N new tokens (greedy,
EOS ignored), and ms/step is the difference over N. One engine at a time (HF's model stays loaded
beside it; one of them runs at any moment), after a warm-up generation, the fastest of 3 runs.
Ratios are speed ratios (higher is faster) against eager and against HF in the same run:
against HF's runs interleaved with the engine's ('HF alongside': their runs alternate, so a
slow spell of the machine falls on both). The 'gemm' row is HF's floor: the step's matrix
products alone, through torch's F.linear as HF computes them (the simulator reads a model's
weights packed, sim/matmul.py, and its products take less). The W8A8 exports of the tiny Llama (docs/quantization.md) are compared with the
bf16 model ('vs tiny'): on the simulator that measures the quantized operators' host overhead, not
the chip's int8 speed
('hf' and 'gemm' rows are skipped for them). 'tiny-lora' is the tiny Llama with LoRA on (rank 8 on
every projection, two adapters loaded, the batch's requests alternating between them), compared with
the tiny Llama without ('vs tiny'): the cost of the punica wrapper's products.
"""

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_ASCEND_SIM_MEMORY_GB", "2")


def prompts_for(batch: int) -> list[str]:
    return [f"Request {i}: tell me a story about the number {i}." for i in range(batch)]


def decode_ms(generates, batch: int, tokens: int, repeats: int = 3) -> list[float]:
    """ms per decode step of each generator: generate(batch, 1 + tokens) minus
    generate(batch, 1), over tokens (the fastest of `repeats` runs of each). The generators' runs
    interleave, so that a slow spell of the machine (their speed drifts by up to a quarter
    over a minute here) falls on each of them alike."""
    for generate in generates:
        generate(batch, 4)  # warm-up
    times = [{} for _ in generates]
    for _ in range(repeats):
        for generate, runs in zip(generates, times):
            for n in (1, 1 + tokens):
                start = time.perf_counter()
                generate(batch, n)
                runs.setdefault(n, []).append(time.perf_counter() - start)
    return [1000 * (min(runs[1 + tokens]) - min(runs[1])) / tokens for runs in times]


def vllm_generator(llm, adapters=()):
    from vllm import SamplingParams

    def generate(batch, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        loras = [adapters[i % len(adapters)] for i in range(batch)] if adapters else None
        llm.generate(prompts_for(batch), params, use_tqdm=False, lora_request=loras)
    return generate


def lora_requests() -> list:
    from vllm.lora.request import LoRARequest

    from scripts.models import lora_adapter_dir

    return [LoRARequest(f"adapter{seed}", seed, lora_adapter_dir("llama", seed))
            for seed in (1, 2)]


def load_hf(path: str):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def gemm_floor_ms(path: str, batch: int, repeats: int = 20) -> float:
    """The step's matrix products alone: every Linear of the model (the LM head included) once
    on `batch` bf16 rows through torch's F.linear, back to back, the fastest of `repeats` passes:
    HF's floor. (The simulator's products read a model's weights packed and take less.)"""
    import torch

    model = load_hf(path)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {m.in_features: torch.randn(batch, m.in_features, dtype=torch.bfloat16)
          for m in linears}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for m in linears:
                torch.nn.functional.linear(xs[m.in_features], m.weight)
            best = min(best, time.perf_counter() - start)
    return 1000 * best


def hf_generator(path: str):
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    model = load_hf(path)
    # An engine made in this process sets its torch threads to 1 (vLLM's frontend): HF keeps
    # the count it had when loaded.
    threads = torch.get_num_threads()

    def generate(batch, n):
        inputs = tok(prompts_for(batch), return_tensors="pt", padding=True)
        frontend = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.inference_mode():
                model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=tok.pad_token_id)
        finally:
            torch.set_num_threads(frontend)
    return generate


def engine_args(mode: str) -> dict:
    if mode == "eager":
        return {"enforce_eager": True}
    return {"compilation_config": {"cudagraph_mode": mode}}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"],
                        choices=["tiny", "smollm2", "qwen3-moe", "qwen2-moe",
                                 "tiny-w8a8-dynamic", "tiny-w8a8", "tiny-lora"])
    parser.add_argument("--modes", nargs="+",
                        default=["gemm", "hf", "eager", "FULL_AND_PIECEWISE"],
                        help="'hf' (transformers generate), 'gemm' (the step's matrix "
                        "products alone: the floor), 'eager', or a cudagraph_mode")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--classes", nargs="+", default=["ours"], choices=["ours", "upstream"],
                        help="model classes: vllm-ascend's per-family files or upstream vLLM's")
    args = parser.parse_args()

    from scripts.models import quantized_model_dir, smollm2_dir, tiny_model_dir

    paths = {"tiny": tiny_model_dir("llama"), "smollm2": str(smollm2_dir()),
             "qwen3-moe": tiny_model_dir("qwen3_moe"), "qwen2-moe": tiny_model_dir("qwen2_moe"),
             "tiny-w8a8-dynamic": quantized_model_dir("llama", "W8A8_DYNAMIC", "bfloat16"),
             "tiny-w8a8": quantized_model_dir("llama", "W8A8", "bfloat16"),
             "tiny-lora": tiny_model_dir("llama")}
    results = {}
    alongside = {}  # (model, classes, mode, batch) -> HF's ms measured interleaved with it
    for model in args.models:
        for classes in args.classes:
            # vLLM's plugin allow-list, read by every process the engine spawns: the platform
            # plugin alone loads upstream's model classes; both load the per-family files.
            os.environ["VLLM_PLUGINS"] = "ascend" if classes == "upstream" else \
                "ascend,ascend_models"
            # HF stays loaded while the engines run: its runs interleave with each engine's.
            hf = hf_generator(paths[model]) if "hf" in args.modes and classes == \
                args.classes[0] and not ("w8a8" in model or model == "tiny-lora") else None
            for mode in args.modes:
                derived = "w8a8" in model or model == "tiny-lora"  # compared with tiny
                if mode in ("hf", "gemm") and (classes != args.classes[0] or derived):
                    continue
                start = time.perf_counter()
                if mode == "gemm":
                    for batch in args.batches:
                        results[(model, classes, mode, batch)] = gemm_floor_ms(paths[model], batch)
                    continue
                if mode == "hf":
                    llm, generate = None, hf
                else:
                    from vllm import LLM

                    lora = model == "tiny-lora"
                    llm = LLM(paths[model], dtype="bfloat16", max_model_len=512, seed=0,
                              max_num_seqs=max(args.batches), **engine_args(mode),
                              **(dict(enable_lora=True, max_lora_rank=8, max_loras=2)
                                 if lora else {}))
                    generate = vllm_generator(llm, lora_requests() if lora else ())
                startup = time.perf_counter() - start
                for batch in args.batches:
                    key = (model, classes, mode, batch)
                    if hf is None or mode == "hf":
                        results[key], = decode_ms([generate], batch, args.tokens)
                    else:
                        results[key], alongside[key] = decode_ms([generate, hf], batch,
                                                                 args.tokens)
                print(f"[{model} {classes} {mode}] start {startup:.1f} s", flush=True)
                if llm is not None:
                    llm.llm_engine.engine_core.shutdown()
                del llm, generate
                gc.collect()
            del hf

    print(f"\n{'model':17} {'classes':9} {'mode':20} {'batch':>5} {'ms/step':>9} {'tok/s':>9} "
          f"{'vs eager':>9} {'HF alongside':>12} {'vs HF':>7} {'vs upstream':>11} {'vs tiny':>7}")
    for (model, classes, mode, batch), ms in results.items():
        def ratio(key):
            base = results.get(key)
            return f"{base / ms:.2f}x" if base and key != (model, classes, mode, batch) else "-"
        up = ratio((model, "upstream", mode, batch)) if classes != "upstream" else "-"
        hf_ms = alongside.get((model, classes, mode, batch))
        # 'vs HF': against HF's runs interleaved with this engine's where there are some
        vs_hf = f"{hf_ms / ms:.2f}x" if hf_ms else ratio((model, args.classes[0], "hf", batch))
        print(f"{model:17} {classes:9} {mode:20} {batch:5d} {ms:9.2f} {1000 * batch / ms:9.1f} "
              f"{ratio((model, classes, 'eager', batch)):>9} "
              f"{f'{hf_ms:.2f}' if hf_ms else '-':>12} {vs_hf:>7} {up:>11} "
              f"{ratio(('tiny', classes, mode, batch)) if model.startswith('tiny-') else '-':>7}")


if __name__ == "__main__":
    main()
