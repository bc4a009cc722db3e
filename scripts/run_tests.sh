#!/usr/bin/env bash
# README command 2: the test suite, then its 15 slowest tests.
#   bash scripts/run_tests.sh           the full tier (what CI runs): every claim the docs make
#   bash scripts/run_tests.sh --quick   the developer's loop: leaves out the tests marked slow
# Other arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
args=()
for arg in "$@"; do
  if [ "$arg" = "--quick" ]; then args+=(-m "not slow"); else args+=("$arg"); fi
done
exec python -m pytest tests --durations=15 "${args[@]}"
