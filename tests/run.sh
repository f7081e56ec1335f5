#!/usr/bin/env bash
# The test suite, from a fresh clone:  bash tests/run.sh [pytest args]
# Sets up ./.venv on first use (launch/setup_env.sh), then runs unit, distributed and end-to-end tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_env.sh
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
exec .venv/bin/python -m pytest tests "$@"
