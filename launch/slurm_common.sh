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
if [ -z "${SLURM_TMPDIR:-}" ]; then
  # Our own scratch directory: remove it from every node when the batch script exits.
  trap 'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 rm -rf "$megarl_local"' EXIT
fi

# megarl_prepare CONFIG [key=value ...]: check everything `megarl train` checks (config, topology over the
# job's nodes, model directory, task, reward sandbox) before any worker starts -- one Python start, the
# embedded model built if needed -- then stage the model on every node. Sets megarl_model (the node-local
# model directory) and megarl_nproc (processes per node).
megarl_prepare() {
  local report source
  report=$(python -m megarl.cli train "$@" --dry-run --nnodes "$SLURM_JOB_NUM_NODES")
  echo "$report"
  source=$(sed -n 's/^megarl: model \(.*\); run dir .*/\1/p' <<<"$report")
  megarl_nproc=$(( $(python -c 'import sys; from megarl.config.load import load_config, world_size_for
print(world_size_for(load_config(sys.argv[1], sys.argv[2:])))' "$@") / SLURM_JOB_NUM_NODES ))
  megarl_model=$megarl_local/model
  # Copy to a fresh directory, then rename it into place (atomic): where nodes share the scratch file
  # system, the first node's rename wins and the others drop their identical copy, instead of one
  # node's rm -rf racing another's cp -r.
  srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 bash -c \
    'mkdir -p "$1" && copy=$(mktemp -d "$1/.model.XXXXXX") && cp -r "$3/." "$copy" &&
     { mv -T "$copy" "$2" 2>/dev/null || { [ -f "$2/config.json" ] && rm -rf "$copy"; }; }' \
    stage "$megarl_local" "$megarl_model" "$source"
}
