"""SmolLM2-135M-Instruct answering a few questions through vllm.LLM on vllm-ascend.

The questions are ones whose greedy answers are decisive: at every token of HF transformers'
answer the first choice leads the second by at least 0.87 nats (fp32 and bf16), so the answers do
not depend on the CPU's bf16 rounding. Each answer is checked against the expected one; the exit
status is 1 when any differs.
"""

import argparse
import time

# question -> the answer HF transformers gives (greedy, bf16 and fp32)
EXPECTED = {
    "What is the capital of Japan?": "The capital of Japan is Tokyo.",
    "What is the capital of Kenya?": "The capital of Kenya is Nairobi.",
    "What is the capital of Russia?": "The capital of Russia is Moscow.",
}


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--enforce-eager", action="store_true", help="turn graph mode off")
    args = parser.parse_args(argv)

    from scripts.models import smollm2_dir

    model = str(smollm2_dir())
    from vllm import LLM, SamplingParams

    from vllm_ascend import device

    start = time.perf_counter()
    # A quick start for a demo: max_num_seqs 16 keeps the capture sizes few, and 1024 batched
    # tokens keep the start-up profile run (a full batch through the model, on the CPU when
    # simulated) short.
    llm = LLM(model, max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=1024,
              enforce_eager=args.enforce_eager, seed=0)
    started = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=32)
    conversations = [[{"role": "user", "content": q}] for q in EXPECTED]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    config = llm.llm_engine.vllm_config
    # (Not the device's name: this process runs no worker, and asking would open the device.)
    print(f"\ndevice backend: {device.current.name}; "
          f"dtype: {str(config.model_config.dtype).removeprefix('torch.')}; graph mode: "
          f"{config.compilation_config.cudagraph_mode.name}; engine start {started:.1f} s")
    wrong = 0
    for (question, expected), out in zip(EXPECTED.items(), outputs):
        answer = out.outputs[0].text.strip()
        ok = answer == expected
        wrong += not ok
        print(f"\nQ: {question}\nA: {answer}" + ("" if ok else f"\n   (expected: {expected})"))
    print(f"\n{len(EXPECTED) - wrong} of {len(EXPECTED)} answers as expected")
    llm.llm_engine.engine_core.shutdown()
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
