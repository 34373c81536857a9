"""Synchronous baseline vs Pipeline RL on the same config, processes and budget, side by side.

    python benchmarks/sync_vs_pipeline.py [--steps N] [--engines E] [--target R] [--out runs/sync_vs_pipeline] [key=value ...]

For each mode it runs `megarl train configs/demo.yaml` with E sampler engines (default 4) and
reports, from the run's metrics.jsonl and timeline: trained completion tokens per second of training
wall time, learner steps per second, sampler and learner busy fractions, the wall time until the
reward (mean over a 20-step window) first reaches the target, and the phase times per learner step.

The bound. From those phase times: a sync step costs its whole cycle -- the generation phase, which
lasts until the batch's longest rollout ends (the tail), then train, then publish -- while a pipeline
step costs only its slower side: the learner (train + publish) or the samplers (the busiest engine's
generating time per step, measured while both sides share the machine). bound = sync cycle / pipeline's
slower side is the steps/s ratio the two modes allow here; ratio_vs_bound = measured steps/s ratio /
bound says how close to that limit the pipeline runs.

It renders OUT/sync_vs_pipeline.png: generated tokens/s over time, one stacked band per engine, sync
and pipeline side by side on one scale (learner training shaded), and OUT/<mode>.png (plot_timeline's
two-panel picture of each run). Ends with one JSON line of the pipeline/sync ratios.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_timeline import learner_busy_fraction, plt, render, sampler_rates  # noqa: E402

from megarl.observe.timeline import load_timeline  # noqa: E402
from megarl.observe.sinks import train_records  # noqa: E402

WINDOW = 20
MODES = ("sync", "pipeline")


def phase_times(run_dir: Path) -> dict:
    """Per learner step, from the timeline: mean wait / train / publish seconds (the learner's spans)
    and the busiest engine's generating seconds (its decode slices), each over the steps trained."""
    timeline = load_timeline(run_dir)
    spans = [e for name, evs in timeline.items() if name.startswith("learner0") for e in evs]
    steps = sum(e["kind"] == "train" for e in spans)
    per_step = {kind: sum(e["end"] - e["start"] for e in spans if e["kind"] == kind) / steps
                for kind in ("wait", "train", "publish")}
    generating = [sum(e["end"] - e["start"] for e in evs if e["kind"] == "decode")
                  for name, evs in timeline.items() if name.startswith("sampler")]
    return {**{f"{k}_s": round(v, 4) for k, v in per_step.items()},
            "cycle_s": round(sum(per_step.values()), 4),
            "generate_s": round(max(generating) / steps, 4), "engines": len(generating)}


def summarise(run_dir: Path, target: float, wall_s: float) -> dict:
    rows = train_records([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])
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
            "learner_busy_frac": round(learner_busy_fraction(run_dir), 3), "steps": len(rows),
            "wall_s": round(wall_s, 1), "train_wall_s": round(train_wall, 1),
            "tokens_per_s": round(sum(r["num_tokens"] for r in rows) / train_wall, 1),
            "steps_per_s": round(len(rows) / train_wall, 3),
            "final_reward": round(sum(r["reward_mean"] for r in rows[-WINDOW:]) / min(WINDOW, len(rows)), 3),
            "time_to_target_s": None if reached is None else round(reached, 1),
            "phases": phase_times(run_dir)}


def bound(sync: dict, pipeline: dict) -> float:
    """The steps/s ratio the measured phases allow: the sync cycle over the pipeline's slower side."""
    p = pipeline["phases"]
    return sync["phases"]["cycle_s"] / max(p["train_s"] + p["publish_s"], p["generate_s"])


def ratios(sync: dict, pipeline: dict) -> dict:
    steps_ratio = pipeline["steps_per_s"] / sync["steps_per_s"]
    limit = bound(sync, pipeline)
    return {"tokens_per_s_ratio": round(pipeline["tokens_per_s"] / sync["tokens_per_s"], 3),
            "steps_per_s_ratio": round(steps_ratio, 3),
            "time_to_target_ratio": (round(sync["time_to_target_s"] / pipeline["time_to_target_s"], 3)
                                     if sync["time_to_target_s"] and pipeline["time_to_target_s"] else None),
            "bound": round(limit, 3), "ratio_vs_bound": round(steps_ratio / limit, 3)}


def render_side_by_side(run_dirs: dict[str, Path], out_png: Path, seconds: float = 4.0, bin_s: float = 0.05) -> None:
    """Generated tokens/s over the first `seconds` of training (or the shorter run), one stacked band per
    engine, sync left and pipeline right on one y scale (cut at 1.2x the 98th percentile, so the
    first bin's prompt prefill does not flatten the rest); grey = the learner training."""
    timelines = {mode: load_timeline(run_dir) for mode, run_dir in run_dirs.items()}
    seconds = min([seconds] + [max(e["end"] for e in t["learner0"]) - min(e["start"] for e in t["learner0"])
                               for t in timelines.values()])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), sharey=True)
    top = 0.0
    for ax, (mode, timeline) in zip(axes, timelines.items()):
        learner = timeline["learner0"]
        t0 = min(e["start"] for e in learner)  # the first step's wait: generation starts there
        edges = np.arange(0.0, seconds + bin_s, bin_s)
        samplers = sorted((n for n in timeline if n.startswith("sampler")), key=lambda n: int(n[len("sampler"):]))
        rates = [sampler_rates(timeline[name], t0, edges) for name in samplers]
        ax.stackplot(edges[:-1], rates, labels=[f"engine {i} ({n})" for i, n in enumerate(samplers)],
                     step="post", alpha=0.85)
        top = max(top, float(np.percentile(np.sum(rates, axis=0), 98)))
        for e in learner:
            if e["kind"] == "train" and e["start"] - t0 < seconds:
                ax.axvspan(e["start"] - t0, e["end"] - t0, color="grey", alpha=0.3, lw=0)
        steps = sum(e["kind"] == "train" and e["end"] - t0 <= seconds for e in learner)
        ax.set_title(f"{mode}: {steps} learner steps in the first {seconds:.1f} s")
        ax.set_xlim(0, seconds)
        ax.set_xlabel("time since the first step began (s); grey = learner training")
    axes[0].set_ylim(0, 1.2 * top)
    axes[0].set_ylabel("generated tokens/s (stacked per engine)")
    axes[1].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--engines", type=int, default=4, help="sampler engines (one process each)")
    parser.add_argument("--target", type=float, default=0.6)
    parser.add_argument("--out", default="runs/sync_vs_pipeline")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    results, run_dirs = {}, {}
    for mode in MODES:
        run_dirs[mode] = run_dir = Path(args.out) / mode
        cmd = [sys.executable, "-m", "megarl.cli", "train", "configs/demo.yaml", f"run.dir={run_dir}",
               f"run.steps={args.steps}", "run.progress=false", "run.overwrite=true", f"algo.mode={mode}",
               f"sampler.num_engines={args.engines}", *args.overrides]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
        results[mode] = summarise(run_dir, args.target, time.perf_counter() - start)
        render(run_dir, Path(args.out) / f"{mode}.png", f"{mode} mode: generated tokens/s (grey: learner training)")
        print(mode, json.dumps(results[mode]), flush=True)
    render_side_by_side(run_dirs, Path(args.out) / "sync_vs_pipeline.png")
    s, p = results["sync"]["phases"], results["pipeline"]["phases"]
    print(f"bound: sync cycle {s['cycle_s'] * 1e3:.0f} ms (generate incl. tail {s['wait_s'] * 1e3:.0f} + train "
          f"{s['train_s'] * 1e3:.0f} + publish {s['publish_s'] * 1e3:.0f}) over the pipeline's slower side "
          f"max(learner {(p['train_s'] + p['publish_s']) * 1e3:.0f}, busiest engine {p['generate_s'] * 1e3:.0f}) ms")
    print(json.dumps(ratios(results["sync"], results["pipeline"])))


if __name__ == "__main__":
    main()
