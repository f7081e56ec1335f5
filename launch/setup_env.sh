#!/usr/bin/env bash
# Create ./.venv (once) and install megatron_cispo into it.
#   bash launch/setup_env.sh          # CPU: installs the torch==2.13.0 CPU wheel first
#   TORCH_SPEC="torch==2.6.0" bash launch/setup_env.sh   # pick another torch (e.g. a CUDA build)
# Re-runs are cheap: the install is skipped while setup.py is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.megatron_cispo_installed"
want="$(sha256sum setup.py | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    # A bare `torch` requirement would pull a multi-GB CUDA build on a CPU box.
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}"
  fi
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test,plot]"
  echo "$want" > "$stamp"
fi
