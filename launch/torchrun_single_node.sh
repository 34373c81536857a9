#!/usr/bin/env bash
# One node, every role in one torchrun launch: the raw equivalent of `megarl train CONFIG ...`.
#   launch/torchrun_single_node.sh configs/demo.yaml [key=value ...]
# The number of processes is read from the config (learner.tp*pp*dp + sampler.num_engines*sampler.tp).
set -euo pipefail
config=${1:?usage: $0 CONFIG [key=value ...]}
shift
read -r nproc stop_timeout < <(python -c 'import sys; from megarl.config.load import load_config, world_size_for
cfg = load_config(sys.argv[1], sys.argv[2:]); print(world_size_for(cfg), cfg.fault.stop_timeout_s)' "$config" "$@")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
restarts=$(python -m megarl.cli placement "$config" "$@" --max-restarts)  # fault.on_failure=restart
# SIGTERM/SIGINT/SIGHUP stop every worker at a step boundary (after fault.stop_timeout_s torchrun kills them), then
# this exits 128 + the signal (143 for SIGTERM) without a traceback.
# torchrun runs through megarl.distributed.local_launch: its store listens on 127.0.0.1 only, and it sets a fresh
# MEGARL_RUN_SECRET unless the environment has one (docs/security.md).
exec python -m megarl.distributed.local_launch --nproc-per-node "$nproc" --max-restarts "$restarts" \
  --shutdown-timeout "$stop_timeout" -m megarl.roles.worker "$config" "$@"
