#!/usr/bin/env bash
# Multi-node launch: run this once on every node with the same settings and its own NODE_RANK.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash launch/multi_node.sh yaml_configs/gpu_template.yaml
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash launch/multi_node.sh yaml_configs/gpu_template.yaml
# Env: NNODES (1), NODE_RANK (0), MASTER_ADDR (node 0's address; required when NNODES > 1),
# MASTER_PORT (29500), GPUS_PER_NODE (the GPU count, else 4 CPU processes), RDZV_TIMEOUT (600:
# seconds every node waits for the others to join before failing), RDZV=c10d for elastic c10d
# rendezvous at MASTER_ADDR:MASTER_PORT (then NODE_RANK is assigned by the rendezvous; RDZV_ID names
# the job). Bad values fail here in one line with exit code 2, before anything starts.
source "$(dirname "$0")/common.sh"
CONFIG=${1:?usage: bash launch/multi_node.sh CONFIG [key=value ...]}
shift
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-600}
if [ "$NGPU" -gt 0 ]; then GPUS_PER_NODE=${GPUS_PER_NODE:-$NGPU}; else GPUS_PER_NODE=${GPUS_PER_NODE:-4}; fi
if [ -n "${RDZV:-}" ]; then rank=(); else rank=(NODE_RANK); fi  # c10d assigns node ranks itself
check_launch_env RDZV NNODES "${rank[@]}" MASTER_ADDR GPUS_PER_NODE MASTER_PORT RDZV_TIMEOUT
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}  # one node is its own rendezvous
at="$MASTER_ADDR:$MASTER_PORT"
if [ "${RDZV:-}" = c10d ]; then
  where=(--rdzv-backend c10d --rdzv-endpoint "$at" --rdzv-id "${RDZV_ID:-megatron_cispo}"
         --rdzv-conf "join_timeout=$RDZV_TIMEOUT")
  waited="this node waited RDZV_TIMEOUT=$RDZV_TIMEOUT s for NNODES=$NNODES nodes to join the c10d rendezvous at $at;"
  waited+=" start launch/multi_node.sh on every node with the same NNODES, MASTER_ADDR, MASTER_PORT and RDZV_ID"
else
  where=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
         --rdzv-conf "timeout=$RDZV_TIMEOUT")
  if [ "$NODE_RANK" -eq 0 ]; then
    waited="node 0 waited RDZV_TIMEOUT=$RDZV_TIMEOUT s for all NNODES=$NNODES nodes to join at $at;"
    if [ "$NNODES" -eq 2 ]; then others="node 1"; else others="nodes 1..$((NNODES - 1))"; fi
    waited+=" start launch/multi_node.sh on $others with the same NNODES, MASTER_ADDR and MASTER_PORT"
  else
    waited="node $NODE_RANK waited for node 0 at $at and all NNODES=$NNODES nodes to join (RDZV_TIMEOUT=$RDZV_TIMEOUT s);"
    waited+=" start every node with the same NNODES, MASTER_ADDR and MASTER_PORT, node 0 listening there"
  fi
  waited+=", or raise RDZV_TIMEOUT if nodes start further apart"
fi
run_torchrun "$waited" "$((NNODES * GPUS_PER_NODE))" --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" "${where[@]}" \
  -m megatron_cispo.train "$CONFIG" "$@"
