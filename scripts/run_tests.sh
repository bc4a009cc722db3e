#!/usr/bin/env bash
# README command 2: the whole test suite (unit tests, then the real vLLM engine end to end); the
# 15 slowest tests are listed at the end.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec python -m pytest tests --durations=15 "$@"
