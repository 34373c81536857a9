"""GRPO against PPO with a learned critic (GAE), with on-policy (`gae`) and off-policy (`vtrace`) value targets, on
the demo at its max_lag 3: runs `megarl train configs/demo.yaml` once per arm (same seed, same budget) and reports
the reward over the first and last 10% of steps and the critic's explained variance (docs/algorithms.md).

    python benchmarks/critic.py [--steps N] [--out runs/critic] [--only ARM ...] [key=value ...]

Ends with one JSON line {arm: {steps, reward_first10, reward_last10, explained_var_last10, lag3_explained_var_last10,
heldout_reward_final, step_time_s}}.
About (steps / 100) minutes per arm on 2 busy CPU cores.
"""
from __future__ import annotations

import json
from pathlib import Path

from demo_arms import run_arms

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
    results = run_arms(ARMS, summary, lambda name, _, result: print(f"{name:12s} {result}", flush=True),
                       default_out="runs/critic")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
