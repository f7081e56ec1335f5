#!/usr/bin/env bash
# One node, one process per GPU (or NPROC CPU processes over gloo when there is no GPU).
#   bash launch/single_node.sh yaml_configs/demo_cpu.yaml loss.cispo.anchor=old
#   NPROC=8 bash launch/single_node.sh yaml_configs/gpu_template.yaml run.steps=100
# Env: NPROC (default: the GPU count, else 4), MASTER_PORT (default 29500), PY (python to use).
source "$(dirname "$0")/common.sh"
CONFIG=${1:?usage: bash launch/single_node.sh CONFIG [key=value ...]}
shift
if [ "$NGPU" -gt 0 ]; then NPROC=${NPROC:-$NGPU}; else NPROC=${NPROC:-4}; fi
MASTER_PORT=${MASTER_PORT:-29500}
check_launch_env NPROC MASTER_PORT
run_torchrun "the single-node rendezvous at 127.0.0.1:$MASTER_PORT did not complete" "$NPROC" \
  --nnodes 1 --nproc-per-node "$NPROC" --master-addr 127.0.0.1 --master-port "$MASTER_PORT" \
  -m megatron_cispo.train "$CONFIG" "$@"
