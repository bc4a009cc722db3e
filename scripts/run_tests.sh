#!/usr/bin/env bash
# README command 2: the whole test suite (unit tests, then the real vLLM engine end to end).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec python -m pytest tests "$@"
