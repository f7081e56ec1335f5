# Sourced by the launch scripts: picks the Python, counts GPUs, sets per-device env, and
# validates an experiment once before any process is started.
#   source "$(dirname "$0")/common.sh"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -z "${PY:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
# Visible GPUs (0 on a CPU machine: the job then uses gloo on CPU automatically). Counted without
# importing torch; set NGPU to override.
if [ -z "${NGPU:-}" ]; then
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    NGPU=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
  elif command -v nvidia-smi > /dev/null 2>&1; then
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  else
    NGPU=0
  fi
fi
if [ "$NGPU" -gt 0 ]; then
  # megatron-core's TP/SP overlap relies on one CUDA hardware queue ordering its kernels.
  export CUDA_DEVICE_MAX_CONNECTIONS=1
else
  # one BLAS thread per rank: several ranks share the cores
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}

# preflight CONFIG WORLD_SIZE [overrides...]: config errors print once here, exit 2, no ranks started.
preflight() {
  local config=$1 world=$2
  shift 2
  "$PY" -m megatron_cispo.train --check --world-size "$world" "$config" "$@" > /dev/null
}
