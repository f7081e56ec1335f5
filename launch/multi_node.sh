#!/usr/bin/env bash
# Multi-node launch: run this once on every node with the same settings and its own NODE_RANK.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash launch/multi_node.sh yaml_configs/gpu_template.yaml
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash launch/multi_node.sh yaml_configs/gpu_template.yaml
# Env (all overridable): NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500),
# GPUS_PER_NODE (the GPU count, else 4 CPU processes), RDZV=c10d for elastic c10d rendezvous at
# MASTER_ADDR:MASTER_PORT (then NODE_RANK is assigned by the rendezvous; RDZV_ID names the job).
source "$(dirname "$0")/common.sh"
CONFIG=${1:?usage: bash launch/multi_node.sh CONFIG [key=value ...]}
shift
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
if [ "$NGPU" -gt 0 ]; then GPUS_PER_NODE=${GPUS_PER_NODE:-$NGPU}; else GPUS_PER_NODE=${GPUS_PER_NODE:-4}; fi
preflight "$CONFIG" "$((NNODES * GPUS_PER_NODE))" "$@"
if [ "${RDZV:-}" = "c10d" ]; then
  where=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-megatron_cispo}")
elif [ -n "${RDZV:-}" ]; then
  echo "RDZV must be empty (static rendezvous) or c10d, got '$RDZV'" >&2
  exit 2
else
  where=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi
exec "$PY" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" "${where[@]}" \
  -m megatron_cispo.train "$CONFIG" "$@"
