#!/usr/bin/env bash
# The test suite, from a fresh clone:  bash tests/run.sh [--mcore VERSION] [pytest args]
# Sets up the virtual environment on first use (launch/setup_env.sh), then runs unit, distributed
# and end-to-end tests (pytest.ini's testpaths, or the paths given). Without --mcore: ./.venv with
# megatron-core 0.16.1 (the default install); --mcore 0.19.2: ./.venv-mcore-0.19.2, the second
# tier (docs/launch.md, "megatron-core versions").
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--mcore" ]; then
  export MCORE=${2:?"--mcore needs a version, e.g. --mcore 0.19.2"}
  shift 2
fi
bash launch/setup_env.sh
venv=".venv${MCORE:+-mcore-$MCORE}"
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
exec "$venv/bin/python" -m pytest "$@"
