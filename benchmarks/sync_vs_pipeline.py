"""Synchronous baseline vs Pipeline RL on the same config, processes and budget, side by side.

    python benchmarks/sync_vs_pipeline.py [--steps N] [--target R] [--out runs/sync_vs_pipeline] [key=value ...]

For each mode it runs `megarl train configs/demo.yaml` and reports, from the run's metrics.jsonl and
timeline: trained completion tokens per second of training wall time, learner steps per second,
sampler and learner busy fractions, and the wall time until the reward (mean over a 20-step
window) first reaches the target; it renders OUT/<mode>.png (generated tokens/s over time, learner
training shaded). Ends with one JSON line of the pipeline/sync ratios.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_timeline import learner_busy_fraction, render  # noqa: E402

WINDOW = 20


def summarise(run_dir: Path, target: float, wall_s: float) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Per-step wall time: tokens_per_s is num_tokens / (time since the previous step ended).
    step_s = [r["num_tokens"] / r["tokens_per_s"] for r in rows]
    elapsed, reached = 0.0, None
    for i, dt in enumerate(step_s):
        elapsed += dt
        window = rows[max(0, i - WINDOW + 1):i + 1]
        if reached is None and len(window) == WINDOW and sum(r["reward_mean"] for r in window) / WINDOW >= target:
            reached = elapsed
    train_wall = sum(step_s)
    sampler_busy = [v for k, v in rows[-1].items() if k.startswith("sampler") and k.endswith("/busy_frac")]
    return {"sampler_busy_frac": round(sum(sampler_busy) / len(sampler_busy), 3),
            "learner_busy_frac": round(learner_busy_fraction(run_dir), 3),"steps": len(rows), "wall_s": round(wall_s, 1), "train_wall_s": round(train_wall, 1),
            "tokens_per_s": round(sum(r["num_tokens"] for r in rows) / train_wall, 1),
            "steps_per_s": round(len(rows) / train_wall, 3),
            "final_reward": round(sum(r["reward_mean"] for r in rows[-WINDOW:]) / min(WINDOW, len(rows)), 3),
            "time_to_target_s": None if reached is None else round(reached, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--target", type=float, default=0.6)
    parser.add_argument("--out", default="runs/sync_vs_pipeline")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    results = {}
    for mode in ("sync", "pipeline"):
        run_dir = Path(args.out) / mode
        cmd = [sys.executable, "-m", "megarl.cli", "train", "configs/demo.yaml", f"run.dir={run_dir}",
               f"run.steps={args.steps}", "run.progress=false", f"algo.mode={mode}", *args.overrides]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
        results[mode] = summarise(run_dir, args.target, time.perf_counter() - start)
        render(run_dir, Path(args.out) / f"{mode}.png", f"{mode} mode: generated tokens/s (grey: learner training)")
        print(mode, json.dumps(results[mode]), flush=True)
    s, p = results["sync"], results["pipeline"]
    ratios = {"tokens_per_s_ratio": round(p["tokens_per_s"] / s["tokens_per_s"], 3),
              "steps_per_s_ratio": round(p["steps_per_s"] / s["steps_per_s"], 3),
              "time_to_target_ratio": (round(s["time_to_target_s"] / p["time_to_target_s"], 3)
                                       if s["time_to_target_s"] and p["time_to_target_s"] else None)}
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
