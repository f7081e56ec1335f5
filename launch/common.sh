# Sourced by the launch scripts: picks the Python, counts GPUs, sets per-device env, validates the
# launch variables and an experiment once before any process is started, and runs torchrun.
#   source "$(dirname "$0")/common.sh"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LAUNCH_SCRIPT=${LAUNCH_SCRIPT:-${0##*/}}  # the name errors start with

# launch_fail NAME VALUE EXPECTED: the one line a launch mistake gets; exit 2, nothing started.
launch_fail() {
  echo "$LAUNCH_SCRIPT: $1='$2' is not valid: expected $3" >&2
  exit 2
}

# Integers are matched as text first: bash arithmetic reads "abc" as a variable name and "08" as bad
# octal. Nine digits keep it clear of overflow.
_uint_in() {  # VALUE MIN MAX
  [[ $1 =~ ^[0-9]{1,9}$ ]] && [ $((10#$1)) -ge "$2" ] && [ $((10#$1)) -le "$3" ]
}

# check_launch_env NAME...: validate each named launch variable that is set (callers apply their
# defaults first; NNODES goes before NODE_RANK and MASTER_ADDR, which depend on it). The first bad
# one prints one line naming it, its value and what is expected, and exits 2.
check_launch_env() {
  local name value max=999999999
  for name in "$@"; do
    value=${!name-}
    if [ -z "$value" ] && [ "$name" != MASTER_ADDR ]; then continue; fi
    case $name in
      NNODES) _uint_in "$value" 1 $max || launch_fail NNODES "$value" "a positive integer (the number of nodes)" ;;
      NODE_RANK)
        _uint_in "$value" 0 $((NNODES - 1)) ||
          launch_fail NODE_RANK "$value" "an integer in 0..$((NNODES - 1)) (this node's rank; NNODES=$NNODES)" ;;
      MASTER_ADDR)
        if [ -z "$value" ]; then
          if [ "$NNODES" -gt 1 ]; then
            echo "$LAUNCH_SCRIPT: MASTER_ADDR is not set: expected node 0's host name or IP address (required when NNODES=$NNODES > 1)" >&2
            exit 2
          fi
        elif [[ $value =~ [[:space:]] || $value =~ ^[^:]+:[0-9]*$ ]]; then
          launch_fail MASTER_ADDR "$value" "a host name or IP address, without a port (the port goes in MASTER_PORT)"
        fi ;;
      NPROC) _uint_in "$value" 1 $max || launch_fail NPROC "$value" "a positive integer (processes on this node)" ;;
      GPUS_PER_NODE) _uint_in "$value" 1 $max || launch_fail GPUS_PER_NODE "$value" "a positive integer (processes per node)" ;;
      NGPU) _uint_in "$value" 0 $max || launch_fail NGPU "$value" "a non-negative integer (visible GPUs)" ;;
      MASTER_PORT) _uint_in "$value" 1 65535 || launch_fail MASTER_PORT "$value" "an integer in 1..65535 (the rendezvous TCP port)" ;;
      RDZV_TIMEOUT)
        _uint_in "$value" 1 $max || launch_fail RDZV_TIMEOUT "$value" "a positive integer (seconds to wait for every node to join)" ;;
      RDZV) [ "$value" = c10d ] || launch_fail RDZV "$value" "empty (static rendezvous, the default) or c10d" ;;
      ENGINE_GPUS_PER_NODE)
        _uint_in "$value" 0 $max || launch_fail ENGINE_GPUS_PER_NODE "$value" "a non-negative integer (each node's GPUs for Ray's engines)" ;;
      RAY_PORT) _uint_in "$value" 1 65535 || launch_fail RAY_PORT "$value" "an integer in 1..65535 (the Ray head's port)" ;;
      RAY_START_TIMEOUT)
        _uint_in "$value" 1 $max || launch_fail RAY_START_TIMEOUT "$value" "a positive integer (seconds to wait for the Ray head)" ;;
      *) echo "check_launch_env: no rule for $name" >&2; exit 70 ;;  # a bug in the launch scripts
    esac
    # "08" is valid but would break later arithmetic: store integers in plain decimal
    if [ "$name" != MASTER_ADDR ] && [[ $value =~ ^[0-9]+$ ]]; then printf -v "$name" %d "$((10#$value))"; fi
  done
}

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
check_launch_env NGPU
if [ "$NGPU" -gt 0 ]; then
  # megatron-core's TP/SP overlap relies on one CUDA hardware queue ordering its kernels.
  export CUDA_DEVICE_MAX_CONNECTIONS=1
else
  # one BLAS thread per rank: several ranks share the cores
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}

# run_torchrun WAITED_FOR WORLD_SIZE TORCHRUN_ARGS...: exec launch/run_torchrun.py. It first checks the
# config and overrides that follow `-m megatron_cispo.train` as `train --check --world-size WORLD_SIZE`
# does, in its own process (one Python start-up and torch import fewer than a separate check): a bad
# one prints one line, exit 2, no rank started. Then it runs torch.distributed.run. When the
# rendezvous fails (a node did not come within the rendezvous timeout, or the port is taken), the
# agent's traceback is replaced by one line: WAITED_FOR, then torch's own message; exit 1. When the
# ranks stop with one of train.py's REPORTED_EXIT_CODES (2 config error, 3 non-finite, 4 peer lost,
# 5 preempted, 6 save failed, ...), rank 0's one line is all that is printed and the script exits with it.
run_torchrun() {
  exec "$PY" "$ROOT/launch/run_torchrun.py" "$LAUNCH_SCRIPT" "$@"
}
