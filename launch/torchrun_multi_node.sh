#!/usr/bin/env bash
# Several nodes: run this same command on every node (one torchrun agent per node, c10d rendezvous).
#   NNODES=2 RDZV_ENDPOINT=node0:29500 launch/torchrun_multi_node.sh CONFIG [key=value ...]
# Environment:
#   NNODES         number of nodes (required)
#   RDZV_ENDPOINT  host:port of the rendezvous; the agent on that host serves it (required)
#   NODE_RANK      this node's rank (default $SLURM_NODEID, else 0); node 0 prints the placement. torchrun's
#                  c10d rendezvous orders the nodes itself (by address, then agent pid; docs/launch.md), so
#                  it is not passed on as --node-rank (which torch ignores for c10d with a warning)
#   NODE_ADDR      this node's address as the other nodes reach it (default: first of `hostname -I`).
#                  torchrun advertises it (--local-addr) and the learner binds its sample queue there
#                  (queue.host); a key=value argument queue.host=... still wins.
#   RDZV_ID        one id shared by every node of the job (default $SLURM_JOB_ID, else "megarl")
#   MEGARL_RUN_SECRET  the run's secret, the same on every node (required; docs/security.md): it authenticates
#                  the sample queue and the store records. Make one per run, e.g.
#                  `python -c 'import secrets; print(secrets.token_hex(32))'`, and give it to each node privately
# Processes per node come from the config: (learner.tp*pp*dp + sampler.num_engines*sampler.tp) / NNODES, which
# must divide evenly (`megarl placement CONFIG --nnodes N` prints which node runs which roles).
set -euo pipefail
config=${1:?usage: NNODES=N RDZV_ENDPOINT=host:port $0 CONFIG [key=value ...]}
shift
: "${MEGARL_RUN_SECRET:?set MEGARL_RUN_SECRET to one secret shared by every node of the run (docs/security.md)}"
: "${NNODES:?set NNODES to the number of nodes}" "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port (e.g. the first node)}"
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
NODE_ADDR=${NODE_ADDR:-$(hostname -I | awk '{print $1}')}
# Processes per node on stdout; the placement table on stderr, kept on node 0 only.
if [ "$NODE_RANK" = 0 ]; then
  nproc=$(python -m megarl.cli placement "$config" "$@" --nnodes "$NNODES" --nproc 2> >(sed 's/^/megarl placement: /' >&2))
else
  nproc=$(python -m megarl.cli placement "$config" "$@" --nnodes "$NNODES" --nproc 2>/dev/null)
fi
restarts=$(python -m megarl.cli placement "$config" "$@" --max-restarts)  # fault.on_failure=restart
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec torchrun --nnodes "$NNODES" --nproc-per-node "$nproc" --max-restarts "$restarts" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-megarl}}" \
  --local-addr "$NODE_ADDR" \
  -m megarl.roles.worker "$config" "queue.host=$NODE_ADDR" "$@"
