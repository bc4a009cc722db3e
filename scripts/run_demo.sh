#!/usr/bin/env bash
# README command 1: SmolLM2-135M-Instruct answers a few prompts through vllm.LLM, in graph mode
# where available, on an Ascend chip or (without one) on the simulator.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python "$ROOT/scripts/demo.py" "$@"
