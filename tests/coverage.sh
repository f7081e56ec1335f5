#!/usr/bin/env bash
# Line coverage of megatron_cispo/ over the test suite, every process counted: torchrun's ranks and the
# other subprocesses (the CLI, the README's scripts, reward workers) through coverage.py's
# patch = subprocess, and the harness's forkserver ranks through concurrency = multiprocessing.
#   bash tests/coverage.sh [--mcore VERSION] [pytest args]    # e.g. -q tests/unit -n 2
# Prints the report (per file, and the total); the combined data stays in ./.coverage.
# Coverage makes the suite slower (about 1.3x here), so it is not part of .ci/run; docs/testing.md
# keeps the figures.
set -euo pipefail
cd "$(dirname "$0")/.."
mcore=()
if [ "${1:-}" = "--mcore" ]; then mcore=(--mcore "${2:?--mcore needs a version}"); shift 2; fi
MCORE=${mcore[1]:-} bash launch/setup_env.sh
venv=".venv${mcore[1]:+-mcore-${mcore[1]}}"
"$venv/bin/python" -c "import coverage" 2>/dev/null \
  || "$venv/bin/python" -m pip install -q --disable-pip-version-check "coverage>=7.10"
rm -f .coverage .coverage.*
export COVERAGE_FILE="$PWD/.coverage" COVERAGE_RCFILE="$PWD/tests/coveragerc"  # absolute: every process's cwd
status=0
"$venv/bin/python" -m coverage run -m pytest -p no:cacheprovider "$@" || status=$?
"$venv/bin/python" -m coverage combine -q
"$venv/bin/python" -m coverage report
exit "$status"
