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


def render(run_dir: str | Path, out_png: str | Path, title: str, zoom_s: float = 8.0) -> None:
    """Two panels: the whole run in 0.5 s bins, and its first `zoom_s` seconds in 0.05 s bins, where
    the alternation of generation and training (sync) or their overlap (pipeline) is visible."""
    timeline = load_timeline(run_dir)
    t0 = min(e["start"] for evs in timeline.values() for e in evs)
    t1 = max(e["end"] for evs in timeline.values() for e in evs)
    samplers = sorted(name for name in timeline if name.startswith("sampler"))
    train = [e for name, evs in timeline.items() if name.startswith("learner") for e in evs if e["kind"] == "train"]
    fig, axes = plt.subplots(2, 1, figsize=(10, 6))
    for ax, (end, bin_s) in zip(axes, [(t1 - t0, BIN_S), (min(zoom_s, t1 - t0), BIN_S / 10)]):
        edges = np.arange(0.0, end + bin_s, bin_s)
        rates = [sampler_rates(timeline[name], t0, edges) for name in samplers]
        ax.stackplot(edges[:-1], rates, labels=samplers, step="post", alpha=0.8)
        for e in train:
            if e["start"] - t0 < end:
                ax.axvspan(e["start"] - t0, e["end"] - t0, color="grey", alpha=0.25, lw=0)
        ax.set_xlim(0, end)
        ax.set_ylabel("generated tokens/s")
        ax.legend(loc="upper right")
    axes[0].set_title(title)
    axes[1].set_xlabel("time (s); grey = learner training; bottom: the first seconds, finer bins")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    run = sys.argv[1]
    render(run, sys.argv[2] if len(sys.argv) > 2 else Path(run) / "timeline.png", str(run))
