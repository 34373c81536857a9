"""Draw a run's held-out evaluation curves (megarl/eval/) against step and wall time, train reward beside them.

    python benchmarks/plot_eval.py RUN_DIR [OUT.png]

Left panel: each set's pass@1, pass@k and greedy score per evaluated version (x: optimizer steps trained
when it was published), with the training batches' reward_mean (a 10-step running mean: rollouts up to
max_lag versions old, on training prompts) in grey. Right panel: the same against the run's wall time
(seconds since its first record). Writes RUN_DIR/eval_curves.png unless OUT.png is given; prints one JSON
line with each set's first and last scores.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from megarl.observe.console import eval_set_names  # noqa: E402
from megarl.observe.jsonl import read_jsonl  # noqa: E402
from megarl.observe.sinks import eval_records, train_records  # noqa: E402

SMOOTH = 10


def running_mean(values: list[float], width: int) -> np.ndarray:
    values = np.asarray(values, dtype=float)
    cumulative = np.cumsum(np.insert(values, 0, 0.0))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(0, ends - width)
    return (cumulative[ends] - cumulative[starts]) / (ends - starts)


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(__doc__)
    run_dir = Path(argv[0])
    out = Path(argv[1]) if len(argv) > 1 else run_dir / "eval_curves.png"
    records = read_jsonl(run_dir / "metrics.jsonl")
    train, evals = train_records(records), eval_records(records)
    if not evals:
        sys.exit(f"{run_dir}/metrics.jsonl holds no eval records: run with eval.sets (docs/eval.md)")
    t0 = min(r["time"] for r in records if "time" in r) if any("time" in r for r in records) else None
    fig, axes = plt.subplots(1, 2 if t0 is not None else 1, figsize=(12 if t0 is not None else 6.5, 4.2),
                             squeeze=False)
    summary = {}
    for ax, axis in zip(axes[0], ("step", "time")):
        x_train = ([r["step"] + 1 for r in train] if axis == "step" else [r["time"] - t0 for r in train])
        x_eval = [e["step"] for e in evals] if axis == "step" else [e["time"] - t0 for e in evals]
        ax.plot(x_train, running_mean([r["reward_mean"] for r in train], SMOOTH), color="0.6", lw=1.2,
                label=f"train reward_mean ({SMOOTH}-step mean)")
        for name, color in zip(eval_set_names(evals[-1]), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
            prefix = f"eval/{name}/"
            keys = [k[len(prefix):] for k in evals[-1] if k.startswith(prefix + "pass@")] + ["greedy"]
            for key, style in zip(keys, ("-", "--", ":")):
                ys = [e.get(prefix + key) for e in evals]
                ax.plot(x_eval, ys, style, marker="o", ms=3.5, color=color, label=f"{name} {key}")
                summary[f"{name}/{key}"] = [ys[0], ys[-1]]
        ax.set_xlabel("optimizer steps trained" if axis == "step" else "wall time (s)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("reward / pass rate")
    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{run_dir.name}: held-out evaluation, every score of one policy version")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    print(json.dumps({"evaluations": len(evals), "versions": [e["eval_version"] for e in evals], **summary}))


if __name__ == "__main__":
    main(sys.argv[1:])
