#!/usr/bin/env bash
# Line coverage of megatron_cispo/ over the whole test suite, every process counted: torchrun's ranks and
# the other subprocesses (the CLI, the README's scripts, reward workers, xdist's workers) through
# coverage.py's patch = subprocess, and the harness's forkserver ranks through concurrency =
# multiprocessing (tests/coveragerc).
#   bash tests/coverage.sh [--mcore VERSION] [pytest args]
# Runs tests/unit on 2 pytest-xdist workers, then tests/distributed and tests/e2e serially, as .ci/run
# does; prints the report (per file, and the total) and keeps the combined data in ./.coverage.
# Coverage makes the suite slower, so it is not part of .ci/run; docs/testing.md keeps the figures.
set -uo pipefail
cd "$(dirname "$0")/.."
mcore=${MCORE:-}
if [ "${1:-}" = "--mcore" ]; then mcore=${2:?"--mcore needs a version, e.g. --mcore 0.19.2"}; shift 2; fi
MCORE=$mcore bash launch/setup_env.sh || exit 1
venv=".venv${mcore:+-mcore-$mcore}"
py="$venv/bin/python"
"$py" -c "import coverage" 2>/dev/null || "$py" -m pip install -q --disable-pip-version-check "coverage>=7.10" || exit 1
rm -f .coverage .coverage.*
# absolute paths: every process (a README command's clone, a reward worker) has its own cwd
export COVERAGE_FILE="$PWD/.coverage" COVERAGE_RCFILE="$PWD/tests/coveragerc" OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
status=0
"$py" -m coverage run -m pytest -p no:cacheprovider -q -n 2 --dist loadfile "$@" tests/unit || status=$?
"$py" -m coverage run -m pytest -p no:cacheprovider -q "$@" tests/distributed tests/e2e || status=$?
"$py" -m coverage combine -q && "$py" -m coverage report || status=$?
exit "$status"
