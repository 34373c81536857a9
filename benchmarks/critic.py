"""GRPO against PPO with a learned critic (GAE), with on-policy (`gae`) and off-policy (`vtrace`) value targets, on
the demo at its max_lag 3: runs `megarl train configs/demo.yaml` once per arm (same seed, same budget) and reports
the reward over the first and last 10% of steps and the critic's explained variance (docs/algorithms.md).

    python benchmarks/critic.py [--steps N] [--out runs/critic] [--only ARM ...] [key=value ...]

Ends with one JSON line {arm: {steps, reward_first10, reward_last10, explained_var_last10, lag3_explained_var_last10,
heldout_reward_final, step_time_s}}.
About (steps / 100) minutes per arm on 2 busy CPU cores.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ARMS = {
    "grpo": [],
    "gae": ["algo.advantage.estimator=gae", "algo.critic.target=gae"],
    "gae_vtrace": ["algo.advantage.estimator=gae", "algo.critic.target=vtrace"],
}


def summary(run_dir: Path) -> dict:
    """Means over the first and last 10% of the run's training steps (eval records left out)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in records if "kind" not in r]
    evals = [r for r in records if r.get("kind") == "eval"]  # held-out evaluation (docs/eval.md)
    k = max(1, len(rows) // 10)

    def mean(key, seg):
        values = [r[key] for r in seg if key in r]
        return round(sum(values) / len(values), 3) if values else None

    return {"steps": len(rows), "reward_first10": mean("reward_mean", rows[:k]),
            "reward_last10": mean("reward_mean", rows[-k:]),
            "explained_var_last10": mean("critic/explained_var", rows[-k:]),
            "lag3_explained_var_last10": mean("lag3/critic_explained_var", rows[-k:]),
            "heldout_reward_final": evals[-1].get("eval/heldout/reward_mean") if evals else None,
            "step_time_s": mean("step_time_s", rows)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=None, help="override run.steps")
    parser.add_argument("--out", default="runs/critic")
    parser.add_argument("--only", nargs="*", default=None, help="arm names to run")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    results = {}
    for name, extra in ARMS.items():
        if args.only and name not in args.only:
            continue
        run_dir = Path(args.out) / name
        cmd = [sys.executable, "-m", "megarl.cli", "train", "configs/demo.yaml", f"run.dir={run_dir}",
               "run.overwrite=true", "run.progress=false", *extra, *args.overrides,
               *([f"run.steps={args.steps}"] if args.steps else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: FAILED\n{proc.stderr[-2000:]}", flush=True)
            results[name] = None
            continue
        results[name] = summary(run_dir)
        print(f"{name:12s} {results[name]}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
