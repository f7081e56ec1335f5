#!/usr/bin/env bash
# The README's main command: fully-async CISPO on a real megatron-core GPT, both anchors, same seed.
#   bash launch/demo.sh                          # CPU: 4 gloo processes (TP=2 x DP=2), ~2 minutes
#   STEPS=30 OUT=runs/demo_short bash launch/demo.sh run.seed=7   # extra args are config overrides
# Sets up ./.venv on first use, runs yaml_configs/cispo_rollout.yaml and cispo_old.yaml, then prints
# the comparison table and writes OUT/comparison.png (each run also has its own metrics.png).
# On a GPU machine it uses one process per GPU (TP=2 when the GPU count is even, else TP=1).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash launch/setup_env.sh
source launch/common.sh
OUT=${OUT:-runs/demo}
extra=()
if [ -n "${STEPS:-}" ]; then extra+=("run.steps=$STEPS"); fi
if [ "$NGPU" -gt 0 ]; then
  export NPROC=${NPROC:-$NGPU}
  if [ $((NPROC % 2)) -ne 0 ]; then extra+=("parallelism.tp=1"); fi
fi
for anchor in rollout old; do
  # A rerun moves the previous demo's files to $OUT/$anchor/previous_<time>/ (nothing is deleted).
  bash launch/single_node.sh "yaml_configs/cispo_$anchor.yaml" "run.run_dir=$OUT/$anchor" run.overwrite=true \
    "${extra[@]}" "$@"
done
"$PY" -m megatron_cispo.demo.report "$OUT/rollout" "$OUT/old" --png "$OUT/comparison.png" --strict
echo "demo wall time: $(( $(date +%s) - start ))s (outputs in $OUT/)"
