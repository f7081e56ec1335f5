#!/usr/bin/env bash
# The real run: CISPO on a warm-started Qwen2-architecture model with vLLM rollouts, prompts from a file, an
# exact-match reward and a held-out evaluation, both anchors, same seed (README, second command).
#   bash launch/demo_vllm.sh                      # CPU: 2 gloo processes + vLLM's own process
#   SEEDS="1 2 3" bash launch/demo_vllm.sh        # each anchor per seed: the eval gain's mean, min and max
#   STEPS=10 OUT=runs/demo_vllm_short bash launch/demo_vllm.sh run.seed=7   # extra args are config overrides
# Installs vLLM's CPU build into ./.venv on first use (VLLM=1 launch/setup_env.sh: lean, torch kept),
# makes the warm start once (a tiny Qwen2, vocabulary 16: the task's digits, <bos>, <sep>, +, <eos> and 2
# spare; hidden 128, 2 heads of 64; PRETRAIN_STEPS supervised steps on the task's training rows, default 600,
# which leaves it solving about 45% of the held-out prompts), runs yaml_configs/vllm_qwen2_tiny.yaml with
# loss.cispo.anchor rollout, then old, and prints the comparison table (held-out accuracy first and last)
# and writes OUT/comparison.png. HF_MODEL=DIR trains another model directory of a supported family instead.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
VLLM=1 bash launch/setup_env.sh
source launch/common.sh
OUT=${OUT:-runs/demo_vllm}
MODEL=${HF_MODEL:-runs/models/warm_qwen2_add2}
if [ ! -f "$MODEL/config.json" ]; then
  "$PY" -m megatron_cispo.tools.make_tiny_hf --family qwen2 --vocab 16 --hidden 128 --heads 2 --kv-heads 2 \
    --pretrain yaml_configs/data/add2/train.jsonl --pretrain-steps "${PRETRAIN_STEPS:-600}" "$MODEL"
fi
extra=("model.hf_path=$MODEL")
if [ -n "${STEPS:-}" ]; then extra+=("run.steps=$STEPS"); fi
export NPROC=${NPROC:-2}
run_pair() {  # DIR SEED_ARGS...: both anchors into DIR/rollout and DIR/old
  local dir=$1 anchor
  shift
  for anchor in rollout old; do
    # A rerun moves the previous demo's files to $dir/$anchor/previous_<time>/ (nothing is deleted).
    bash launch/single_node.sh yaml_configs/vllm_qwen2_tiny.yaml "loss.cispo.anchor=$anchor" \
      "run.run_dir=$dir/$anchor" "run.name=vllm:cispo:$anchor" run.overwrite=true "${extra[@]}" "$@"
  done
}
if [ -z "${SEEDS:-}" ]; then
  run_pair "$OUT" "$@"
  "$PY" -m megatron_cispo.demo.report "$OUT/rollout" "$OUT/old" --png "$OUT/comparison.png"
else
  dirs=()
  for seed in $SEEDS; do
    [[ $seed =~ ^[0-9]{1,9}$ ]] || launch_fail SEEDS "$SEEDS" "seeds: non-negative integers separated by spaces"
    run_pair "$OUT/seed_$seed" "$@" "run.seed=$seed"
    dirs+=("$OUT/seed_$seed/rollout" "$OUT/seed_$seed/old")
  done
  "$PY" -m megatron_cispo.demo.report --seeds "${dirs[@]}" --png "$OUT/seeds.png"
fi
echo "demo wall time: $(( $(date +%s) - start ))s (outputs in $OUT/)"
