"""Render a run's timeline as the picture Pipeline RL is argued with: generated tokens/s over time,
stacked per sampler, with the learner's training time shown.

    python benchmarks/plot_timeline.py RUN_DIR [OUT.png] [--zoom-start S] [--zoom-s S] [--bins N]

Top panel: the whole run in at most `--bins` time bins (0.5 s each for a short run, wider for a long
one: 1, 2 or 5 x 10^k s), the learner's share of each bin spent training drawn as a line (right axis).
Bottom panel: a zoom window (`--zoom-start`, `--zoom-s`; default the first 8 s) in finer bins (down to
0.05 s), each training span shaded, where the alternation of generation and training (sync) or their
overlap (pipeline) is visible.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from megarl.observe.timeline import load_timeline  # noqa: E402

BIN_S = 0.5  # the finest whole-run bin; a long run's bins widen so that there are at most `bins`
MAX_SPANS = 400  # training spans drawn one by one in the zoom panel; more would be a wall of bars


def nice_bin(seconds: float) -> float:
    """The smallest of 1, 2, 5 x 10^k seconds that is at least `seconds` (bin widths a reader can add up)."""
    scale = 10.0 ** np.floor(np.log10(seconds))
    return next(float(m * scale) for m in (1, 2, 5, 10) if m * scale >= seconds * (1 - 1e-9))


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


def busy_share(spans: list[dict], t0: float, edges: np.ndarray) -> np.ndarray:
    """Share of each bin the spans cover (the learner training: at most 1 per learner process)."""
    covered = np.zeros(len(edges) - 1)
    for e in spans:
        covered += np.clip(np.minimum(edges[1:], e["end"] - t0) - np.maximum(edges[:-1], e["start"] - t0), 0, None)
    return covered / np.diff(edges)


def learner_busy_fraction(run_dir: str | Path) -> float:
    """Share of the learner's wall time (first wait to last publish) spent training or publishing."""
    spans = [e for name, evs in load_timeline(run_dir).items() if name.startswith("learner") for e in evs]
    if not spans:
        return float("nan")
    wall = max(e["end"] for e in spans) - min(e["start"] for e in spans)
    return sum(e["end"] - e["start"] for e in spans if e["kind"] != "wait") / wall


def render(run_dir: str | Path, out_png: str | Path, title: str, zoom_s: float = 8.0, zoom_start: float = 0.0,
           bins: int = 400) -> Path:
    """Draw the two panels (module docstring) into `out_png`; returns it. ValueError naming the directory
    when it holds no timeline."""
    timeline = {name: evs for name, evs in load_timeline(run_dir).items() if evs}
    if not timeline:
        raise ValueError(f"{run_dir} holds no timeline (expected {Path(run_dir) / 'timeline'}/*.jsonl, written by "
                         f"a run with run.timeline=true)")
    t0 = min(e["start"] for evs in timeline.values() for e in evs)
    length = max(e["end"] for evs in timeline.values() for e in evs) - t0
    samplers = sorted(name for name in timeline if name.startswith("sampler"))
    train = [e for name, evs in timeline.items() if name.startswith("learner") for e in evs if e["kind"] == "train"]
    zoom_end = min(zoom_start + zoom_s, length)
    if zoom_start >= length:
        raise ValueError(f"--zoom-start {zoom_start:g}s is past the end of the run ({length:.1f}s)")
    bin_s = nice_bin(max(BIN_S, length / bins))
    zoom_bin_s = nice_bin(max(BIN_S / 10, (zoom_end - zoom_start) / bins))
    fig, (whole, zoom) = plt.subplots(2, 1, figsize=(11, 6.5))
    for ax, start, end, width in ((whole, 0.0, length, bin_s), (zoom, zoom_start, zoom_end, zoom_bin_s)):
        edges = np.arange(start, end + width, width)
        ax.stackplot(edges[:-1], [sampler_rates(timeline[name], t0, edges) for name in samplers], labels=samplers,
                     step="post", alpha=0.8)
        ax.set_xlim(start, end)
        ax.set_ylabel("generated tokens/s")
        ax.legend(loc="upper left", fontsize=8)
    share = whole.twinx()
    edges = np.arange(0.0, length + bin_s, bin_s)
    share.step(edges[:-1], busy_share(train, t0, edges), where="post", color="black", lw=0.8)
    share.set_ylim(0, 1.05)
    share.set_ylabel("learner training share")
    shown = [e for e in train if e["end"] - t0 > zoom_start and e["start"] - t0 < zoom_end][:MAX_SPANS]
    for e in shown:
        zoom.axvspan(max(e["start"] - t0, zoom_start), min(e["end"] - t0, zoom_end), color="grey", alpha=0.25, lw=0)
    whole.axvspan(zoom_start, zoom_end, color="orange", alpha=0.15, lw=0)
    whole.set_title(f"{title}: whole run, {bin_s:g} s bins (black: learner training share; orange: the zoom below)")
    zoom.set_title(f"{zoom_start:g}-{zoom_end:g} s, {zoom_bin_s:g} s bins (grey: learner training)", fontsize=10)
    zoom.set_xlabel("time since the run's first event (s)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return Path(out_png)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run's run.dir (holds timeline/)")
    parser.add_argument("out", nargs="?", help="the PNG to write (default RUN_DIR/timeline.png)")
    parser.add_argument("--zoom-start", type=float, default=0.0, help="start of the zoom panel, seconds (default 0)")
    parser.add_argument("--zoom-s", type=float, default=8.0, help="length of the zoom panel, seconds (default 8)")
    parser.add_argument("--bins", type=int, default=400, help="most bins of the whole-run panel (default 400)")
    args = parser.parse_args(argv)
    if not Path(args.run_dir).is_dir():
        print(f"plot_timeline: {args.run_dir} is not a directory (give a run's run.dir)", file=sys.stderr)
        return 2
    try:
        out = render(args.run_dir, args.out or Path(args.run_dir) / "timeline.png", str(args.run_dir),
                     args.zoom_s, args.zoom_start, args.bins)
    except ValueError as exc:
        print(f"plot_timeline: {exc}", file=sys.stderr)
        return 2
    print(f"plot_timeline: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
