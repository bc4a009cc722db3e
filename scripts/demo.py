"""SmolLM2-135M-Instruct answering a few questions through vllm.LLM on vllm-ascend."""

import argparse
import time

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--enforce-eager", action="store_true", help="turn graph mode off")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    from scripts.models import smollm2_dir

    model = str(smollm2_dir())
    from vllm import LLM, SamplingParams

    from vllm_ascend import device

    start = time.perf_counter()
    # max_num_seqs 16 keeps the capture sizes (and start-up) small for a demo.
    llm = LLM(model, max_model_len=1024, max_num_seqs=16, enforce_eager=args.enforce_eager,
              seed=0)
    started = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    config = llm.llm_engine.vllm_config.compilation_config
    print(f"\ndevice backend: {device.current.name} ({device.current.device_name()}); "
          f"graph mode: {config.cudagraph_mode.name}; engine start {started:.1f} s")
    for prompt, out in zip(PROMPTS, outputs):
        print(f"\nQ: {prompt}\nA: {out.outputs[0].text.strip()}")


if __name__ == "__main__":
    main()
