"""Render a run's timeline as the picture Pipeline RL is argued with: generated tokens/s over time,
stacked per sampler, with the learner's training spans shaded.

    python benchmarks/plot_timeline.py RUN_DIR [OUT.png]
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from megarl.observe.timeline import load_timeline  # noqa: E402

BIN_S = 0.5


def sampler_rates(events: list[dict], t0: float, edges: np.ndarray) -> np.ndarray:
    """tokens/s per bin; a slice's tokens are spread evenly over the slice's time."""
    tokens = np.zeros(len(edges) - 1)
    for e in events:
        if e["kind"] != "decode":
            continue
        start, end = e["start"] - t0, max(e["end"] - t0, e["start"] - t0 + 1e-6)
        overlap = np.clip(np.minimum(edges[1:], end) - np.maximum(edges[:-1], start), 0, None)
        tokens += e["tokens"] * overlap / (end - start)
    return tokens / np.diff(edges)


def learner_busy_fraction(run_dir: str | Path) -> float:
    """Share of the learner's wall time (first wait to last publish) spent training or publishing."""
    spans = [e for name, evs in load_timeline(run_dir).items() if name.startswith("learner") for e in evs]
    if not spans:
        return float("nan")
    wall = max(e["end"] for e in spans) - min(e["start"] for e in spans)
    return sum(e["end"] - e["start"] for e in spans if e["kind"] != "wait") / wall


def render(run_dir: str | Path, out_png: str | Path, title: str) -> None:
    timeline = load_timeline(run_dir)
    t0 = min(e["start"] for evs in timeline.values() for e in evs)
    t1 = max(e["end"] for evs in timeline.values() for e in evs)
    edges = np.arange(0.0, t1 - t0 + BIN_S, BIN_S)
    samplers = sorted(name for name in timeline if name.startswith("sampler"))
    rates = [sampler_rates(timeline[name], t0, edges) for name in samplers]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.stackplot(edges[:-1], rates, labels=samplers, step="post", alpha=0.8)
    for name in timeline:
        if name.startswith("learner"):
            for e in timeline[name]:
                if e["kind"] == "train":
                    ax.axvspan(e["start"] - t0, e["end"] - t0, color="grey", alpha=0.15, lw=0)
    ax.set_xlabel("time (s); grey = learner training")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    run = sys.argv[1]
    render(run, sys.argv[2] if len(sys.argv) > 2 else Path(run) / "timeline.png", str(run))
