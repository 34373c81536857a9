# Sourced by launch/slurm_*.sbatch (bash, inside the batch job, from the repository root).
# Where things go:
#   run outputs (run.dir: config.yaml, metrics, rollouts, tensorboard, timeline, checkpoints) -- shared
#     storage: a relative run.dir is relative to the repository root the job was submitted from;
#   the job's log -- the sbatch --output file (%x-%j.out in the submit directory), one line per worker
#     line, prefixed by the node's task number (srun --label) in multi-node jobs;
#   caches and the model the workers load -- node-local scratch: $SLURM_TMPDIR where the site sets it,
#     else /tmp/megarl-$SLURM_JOB_ID (removed when the job ends). The model directory the config names
#     (the embedded default is built first, into model.cache_dir) is copied there on every node, so
#     every node starts from the same weights without all of them reading one shared file system.

megarl_local=${SLURM_TMPDIR:-/tmp/megarl-${SLURM_JOB_ID:?not inside a SLURM job}}
export HF_HOME=$megarl_local/hf TRITON_CACHE_DIR=$megarl_local/triton TORCH_EXTENSIONS_DIR=$megarl_local/torch_extensions
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The run's secret (docs/security.md): made here once per job, srun hands the environment to every node's tasks.
MEGARL_RUN_SECRET=${MEGARL_RUN_SECRET:-$(python -c 'import secrets; print(secrets.token_hex(32))')}
export MEGARL_RUN_SECRET
if [ -z "${SLURM_TMPDIR:-}" ]; then
  # Our own scratch directory: remove it from every node when the batch script exits.
  trap 'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 rm -rf "$megarl_local"' EXIT
fi

# megarl_prepare CONFIG [key=value ...]: check everything `megarl train` checks (config, topology over the
# job's nodes, model directory, task, reward sandbox) before any worker starts -- one Python start, the
# embedded model built if needed -- then stage the model on every node. Sets megarl_model (the node-local
# model directory), megarl_nproc (processes per node) and megarl_stop_timeout (fault.stop_timeout_s).
megarl_prepare() {
  local report source
  report=$(python -m megarl.cli train "$@" --dry-run --nnodes "$SLURM_JOB_NUM_NODES")
  echo "$report"
  source=$(sed -n 's/^megarl: model \(.*\); run dir .*/\1/p' <<<"$report")
  local world
  read -r world megarl_stop_timeout < <(python -c 'import sys; from megarl.config.load import load_config, world_size_for
cfg = load_config(sys.argv[1], sys.argv[2:]); print(world_size_for(cfg), cfg.fault.stop_timeout_s)' "$@")
  megarl_nproc=$(( world / SLURM_JOB_NUM_NODES ))
  megarl_stage_model "$source"
}

# megarl_stage_model SOURCE: copy the model directory SOURCE to node-local scratch on every node of the job;
# sets megarl_model (that copy's path, the same on every node).
megarl_stage_model() {
  megarl_model=$megarl_local/model
  # Copy to a fresh directory, then rename it into place (atomic): where nodes share the scratch file
  # system, the first node's rename wins and the others drop their identical copy, instead of one
  # node's rm -rf racing another's cp -r.
  srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 bash -c \
    'mkdir -p "$1" && copy=$(mktemp -d "$1/.model.XXXXXX") && cp -r "$3/." "$copy" &&
     { mv -T "$copy" "$2" 2>/dev/null || { [ -f "$2/config.json" ] && rm -rf "$copy"; }; }' \
    stage "$megarl_local" "$megarl_model" "$1"
}

# megarl_run_step COMMAND...: run the job step (srun ...) in the background and wait for it, passing a stop
# signal that reaches the batch shell (scancel --batch, sbatch --signal=B:TERM@120 or B:USR1@120, a
# preemption's SIGTERM) on to srun as SIGTERM; srun hands it to torchrun, which hands it to every worker,
# and the run stops at its next step boundary (checkpointing if fault.checkpoint_on_signal). A foreground
# srun would not see it: bash runs traps only once its foreground command has ended. Returns the step's
# exit status, or 128 + 15 after a stop (torchrun itself exits 1 on a signal); megarl_step_status is the step's own
# exit status in both cases.
megarl_run_step() {
  local step rc=0 stopped=
  "$@" &
  step=$!
  trap 'stopped=1; kill -TERM "$step" 2>/dev/null || true' TERM INT HUP USR1
  while kill -0 "$step" 2>/dev/null; do
    wait "$step" || true  # returns early when a trapped signal arrives; the step is still stopping then
  done
  wait "$step" || rc=$?
  megarl_step_status=$rc
  trap - TERM INT HUP USR1
  if [ -n "$stopped" ]; then
    echo "megarl: the job step was stopped by a signal to the batch script (exit status 143)" >&2
    rc=143
  fi
  return "$rc"
}
