#!/usr/bin/env bash
# The one script a session lent a GPU runs (one H200, no network, Python 3.12, torch 2.11 cu130; <= 8 min):
# bf16 megatron learner step, built-in engine vs HF generate, learner-vs-engine log-prob parity, MoE routing
# replay (router agreement, log-prob gap, off vs r3), LoRA (adapter-only publish, engine merge, lag-0 gap; also on
# Phi-3, gpt-oss and DeepSeek-V3), a short `megarl train` with learner and sampler on the one GPU, publish bandwidth
# on the device, sequence packing on and off on a long-tailed batch (step time, padding, peak memory), the learner's
# SDPA attention against megatron's unfused one (time, memory, difference), the demo with evaluation every 5 steps
# against none (eval_overlap: the learner's time and waits, the versions applied during each evaluation). Prints one
# JSON line at the end (also $OUT/gpu_check.json when $OUT is set).
# docs/benchmarks.md#the-gpu-check--benchmarksgpu_checksh.
#
#   bash benchmarks/gpu_check.sh --print-wheels       # here: the wheels it needs and the pip download line
#   python benchmarks/gpu_check.py --print-wheels | tail -1 | sh   # here: fetch them into .whl/gpu_check
#   bash benchmarks/gpu_check.sh --dry-run [--no-download]   # here, on CPU: wheel list and sizes, plan,
#                                                            # every check's code on a tiny model
#   bash benchmarks/gpu_check.sh [--wheels DIR]        # there: install the wheels (DIR, or $GPU_CHECK_WHEELS,
#                                                      # default .whl/gpu_check), then run every check
# Other arguments go to benchmarks/gpu_check.py (e.g. --only learner_step e2e_train).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
wheels=${GPU_CHECK_WHEELS:-.whl/gpu_check}
mode=gpu
pass=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels=$2; shift 2 ;;
    --dry-run) mode=dry-run; shift ;;
    --print-wheels) mode=print; shift ;;
    *) pass+=("$1"); shift ;;
  esac
done
python=${PYTHON:-python3}
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

case "$mode" in
  print) exec "$python" benchmarks/gpu_check.py --print-wheels --wheels "$wheels" ;;
  dry-run) exec "$python" benchmarks/gpu_check.py --dry-run --wheels "$wheels" ${pass[@]+"${pass[@]}"} ;;
esac

# The GPU machine: nothing can be fetched there; the wheels travelled with the working tree (device run's carry).
shopt -s nullglob
files=("$wheels"/*.whl)
if [ "${#files[@]}" -eq 0 ]; then
  echo "gpu_check: no wheels in $wheels (fetch them here first: bash benchmarks/gpu_check.sh --print-wheels)" >&2
  exit 2
fi
site=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
start=$SECONDS
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${files[@]}"
echo "gpu_check: installed ${#files[@]} wheels into $site in $((SECONDS - start)) s"
export PYTHONPATH="$repo:$site${PYTHONPATH#"$repo"}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec "$python" benchmarks/gpu_check.py ${pass[@]+"${pass[@]}"}
