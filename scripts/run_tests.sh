#!/usr/bin/env bash
# README command 2: the test suite, then its 15 slowest tests.
#   bash scripts/run_tests.sh           the full tier (what CI runs): every claim the docs make
#   bash scripts/run_tests.sh --quick   the developer's loop: leaves out the tests marked slow
# Other arguments go to pytest.
# The full tier (no arguments) also records what each passing test's engines ran and checks
# docs/supported_models.md's coverage table against it (scripts/coverage_table.py).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
args=()
for arg in "$@"; do
  if [ "$arg" = "--quick" ]; then args+=(-m "not slow"); else args+=("$arg"); fi
done
if [ $# -gt 0 ]; then
  exec python -m pytest tests --durations=15 "${args[@]}"
fi
mkdir -p results
export VLLM_ASCEND_TEST_CELLS="$ROOT/results/cells.jsonl"
: > "$VLLM_ASCEND_TEST_CELLS"
python -m pytest tests --durations=15
python scripts/coverage_table.py --check "$VLLM_ASCEND_TEST_CELLS"
