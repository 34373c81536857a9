"""Does the demo learn with each main objective? Runs `megarl train configs/demo.yaml` once per
objective (same seed, same budget) and prints reward over the first and last 10% of steps.

    python benchmarks/objectives.py [--steps N] [--out runs/objectives] [key=value ...]

Ends with one JSON line {objective: final reward}. Takes about (steps / 150) minutes per objective
on 2 CPU cores.
"""
from __future__ import annotations

import json
from pathlib import Path

from demo_arms import run_arms

OBJECTIVES = {
    "ppo_clip_higher": [],
    "gspo_sequence_ratio": ["algo.loss.ratio_level=sequence", "algo.loss.eps_low=0.0003", "algo.loss.eps_high=0.0004"],
    "decoupled_ppo": ["algo.loss.decoupled=true", "algo.loss.tis_cap=2.0"],
    "tis_pg": ["algo.loss.tis_cap=2.0"],
    "icepop_mask": ["algo.loss.mask_ratio_low=0.5", "algo.loss.mask_ratio_high=2.0"],
    "drgrpo_constant_norm": ["algo.advantage.estimator=drgrpo", "algo.loss.aggregation=constant",
                             "algo.loss.norm_constant=48"],
    "rloo": ["algo.advantage.estimator=rloo", "algo.advantage.std_normalize=false"],
}


def reward_summary(run_dir: Path) -> dict:
    rows = [r for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()) if "kind" not in r]  # eval records: docs/eval.md
    k = max(1, len(rows) // 10)
    mean = lambda seg: sum(r["reward_mean"] for r in seg) / len(seg)
    return {"first10": mean(rows[:k]), "last10": mean(rows[-k:]), "steps": len(rows),
            "multi_version_frac": sum(r["multi_version_frac"] for r in rows) / len(rows)}


def main() -> None:
    def report(name: str, extra: list, s: dict) -> None:
        print(f"{name:24s} reward first10% {s['first10']:.3f}  last10% {s['last10']:.3f}  "
              f"multi-version rollouts {s['multi_version_frac']:.3f}  ({' '.join(extra) or 'defaults'})", flush=True)

    results = run_arms(OBJECTIVES, reward_summary, report, default_out="runs/objectives")
    print(json.dumps({name: None if s is None else round(s["last10"], 3) for name, s in results.items()}))


if __name__ == "__main__":
    main()
