#!/usr/bin/env bash
# The real run: CISPO on a Qwen2-architecture model with vLLM rollouts, prompts from a file and an
# exact-match reward, both anchors, same seed (README, second command).
#   bash launch/demo_vllm.sh                      # CPU: 2 gloo processes + vLLM's own process
#   STEPS=10 OUT=runs/demo_vllm_short bash launch/demo_vllm.sh run.seed=7   # extra args are config overrides
# Installs vLLM's CPU build into ./.venv on first use (VLLM=1 launch/setup_env.sh: lean, torch kept),
# makes the tiny random Qwen2 (vocabulary 16: the task's digits, <bos>, <sep>, +, <eos> and 2 spare; head_dim
# 32, the smallest vLLM's CPU attention has a kernel for),
# runs yaml_configs/vllm_qwen2_tiny.yaml with loss.cispo.anchor rollout, then old, and prints the
# comparison table (with the measured sampler/trainer mismatch) and writes OUT/comparison.png.
# HF_MODEL=DIR trains another model directory of a supported family instead of the tiny one.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
VLLM=1 bash launch/setup_env.sh
source launch/common.sh
OUT=${OUT:-runs/demo_vllm}
MODEL=${HF_MODEL:-runs/models/tiny_qwen2_v16}
if [ ! -f "$MODEL/config.json" ]; then
  "$PY" -m megatron_cispo.tools.make_tiny_hf --family qwen2 --vocab 16 --heads 2 --kv-heads 2 "$MODEL"
fi
extra=("model.hf_path=$MODEL")
if [ -n "${STEPS:-}" ]; then extra+=("run.steps=$STEPS"); fi
export NPROC=${NPROC:-2}
for anchor in rollout old; do
  # A rerun moves the previous demo's files to $OUT/$anchor/previous_<time>/ (nothing is deleted).
  bash launch/single_node.sh yaml_configs/vllm_qwen2_tiny.yaml "loss.cispo.anchor=$anchor" \
    "run.run_dir=$OUT/$anchor" "run.name=vllm:cispo:$anchor" run.overwrite=true "${extra[@]}" "$@"
done
"$PY" -m megatron_cispo.demo.report "$OUT/rollout" "$OUT/old" --png "$OUT/comparison.png"
echo "demo wall time: $(( $(date +%s) - start ))s (outputs in $OUT/)"
