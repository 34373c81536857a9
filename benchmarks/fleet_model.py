"""Fleet model: synchronous RL vs Pipeline RL on 8 to 1024 GPUs, predicted by the discrete-event
model in megarl/fleet_model.py, and checked against a measured megarl run.

    python benchmarks/fleet_model.py [--out docs/img] [--seed 0] [--calibrate-from RUN_DIR]

1. The reference picture: synchronous RL on 8 GPUs (H100 serving a 7B model, calibration below)
   peaks near 10k generated tokens/s and decays towards 1k as the long tail finishes, then trains;
   the same fleet split into samplers and learners under Pipeline RL. OUT/fleet_sync_8gpu.png,
   OUT/fleet_pipeline_8gpu.png.
2. Scaling: 8, 16, 64, 256 and 1024 GPUs at a fixed global batch, sync vs pipeline with
   sampler:learner splits 1:1, 3:1, 7:1; the best split per size; what max_lag and the order samplers send
   finished groups in (algo.queue_order) change on 256 GPUs.
   OUT/fleet_scaling.png.
3. With --calibrate-from: the parameters a measured sync run implies (decode step time vs batch,
   train time per token, publish time, hand-off latencies, output lengths), the same two-process
   fleet simulated in both modes, and model vs measured. RUN_DIR is a sync run, or the --out folder
   of benchmarks/sync_vs_pipeline.py (its sync/ calibrates, its pipeline/ is compared too).
Ends with one JSON line of headline ratios.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from megarl.config.schema import STALE_POLICIES  # noqa: E402
from megarl.fleet_model import (  # noqa: E402
    EngineModel, FleetParams, LogNormalLengths, SimResult, calibrate, engine_rates, measured_summary, simulate,
    summarise, train_seconds_per_token)
from megarl.rollout.send_order import ORDERS  # noqa: E402

# An H100 SXM (80 GB, 3.35 TB/s HBM3, 989 dense bf16 TFLOPS) per sampler engine or learner rank, a 7B
# dense model (Qwen2.5-7B-like: 7.6B parameters, 15.2 GB in bf16), long reasoning rollouts. The
# decode line is set so 8 GPUs reproduce the reference chart (docs/fleet_model.md derives every value).
H100_7B = FleetParams(
    engine=EngineModel(step_base_s=0.007, step_per_seq_s=0.00067, max_running=64),  # 49.9 ms at 64: 1.28k tok/s
    lengths=LogNormalLengths(mean=2000, p99=16000, cap=16384),
    batch_samples=512, group_size=8,  # 64 prompts x 8 samples per optimizer step
    prompt_tokens=256,
    train_token_s=1 / 8500,  # 6 x 7.6e9 FLOP per token at ~40% of 989 TFLOPS
    train_step_s=1.0,  # optimizer step + bf16 gradient all-reduce
    publish_bytes=15.2e9, publish_bytes_per_s=40e9, publish_latency_s=0.05,  # 400 Gb/s NIC at 80%
    swap_stall_s=0.1, ingest_s=0.5, log_s=0.2, resume_s=1.0,
    epochs=1, max_lag=8)
SCALING_BATCH = 4096  # 512 prompts x 8: a large-run global batch, the same for every fleet size
SIZES = (8, 16, 64, 256, 1024)
SPLITS = ((1, 1), (3, 1), (7, 1))  # sampler:learner
STEPS, SKIP = 30, 10  # at least this many simulated optimizer steps; the first SKIP are warm-up


def split(gpus: int, ratio: tuple[int, int]) -> tuple[int, int]:
    learners = max(1, round(gpus * ratio[1] / sum(ratio)))
    return gpus - learners, learners


def run_sync(params: FleetParams, gpus: int, steps: int, seed: int) -> SimResult:
    """Synchronous RL as usually deployed: every GPU generates, then every GPU trains."""
    return simulate(params, "sync", gpus, gpus, steps, seed, colocated=True)


def best_split(splits: dict[str, dict]) -> str:
    """The most trained samples/s among the splits that drop < 1% of their samples as too stale
    (dropping biases training towards short rollouts), or among all when none does."""
    fresh = [k for k, s in splits.items() if s["dropped_frac"] < 0.01] or list(splits)
    return max(fresh, key=lambda k: splits[k]["samples_per_s"])


def run_pipeline(params: FleetParams, samplers: int, learners: int, seed: int) -> dict:
    """A pipeline's steady state: it takes a while to reach, because what is dropped or trained
    depends on the longest rollouts, which run for up to cap x step_s(max_running) (~14 minutes here,
    which may be ~50 optimizer steps on a large fleet). Run 3 of those, measure over the last 1.5."""
    longest = params.lengths.cap * params.engine.step_s(params.engine.max_running)
    result = simulate(params, "pipeline", samplers, learners, STEPS, seed, min_time_s=3 * longest)
    warm = next(i for i, r in enumerate(result.steps) if r.end >= 1.5 * longest)
    return summarise(result, max(SKIP, warm))


def fleet_figures(params: FleetParams, gpus: int, seed: int) -> dict:
    """Sync and every split on one fleet: summaries, and the best split."""
    out = {"sync": summarise(run_sync(params, gpus, STEPS, seed), SKIP), "splits": {}}
    for ratio in SPLITS:
        samplers, learners = split(gpus, ratio)
        s = run_pipeline(params, samplers, learners, seed)
        s["speedup"] = s["samples_per_s"] / out["sync"]["samples_per_s"]
        out["splits"][f"{ratio[0]}:{ratio[1]}"] = dict(s, samplers=samplers, learners=learners)
    out["best"] = best_split(out["splits"])
    return out


# ---------------------------------------------------------------------------------------- pictures
def generation_phases(result: SimResult) -> list[tuple[float, float]]:
    """Sync: (start, end) of every generation phase (from the previous publish to the last token)."""
    starts = [0.0] + [r.end for r in result.steps[:-1]]
    trains = [s for kind, s, _ in result.spans if kind == "train"]
    return list(zip(starts, trains))


def render(result: SimResult, until: float, bin_s: float, ymax: float, title: str, out_png: Path) -> None:
    edges = np.arange(0.0, until + bin_s, bin_s)
    rates = engine_rates(result, edges)
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.stackplot(edges[:-1], rates, labels=[f"GPU {i}" for i in range(len(rates))], step="post", alpha=0.85)
    for kind, start, end in result.spans:
        if kind == "train" and start < until:
            ax.axvspan(start, end, color="grey", alpha=0.25 if result.mode == "sync" else 0.12, lw=0)
    ax.set_xlim(0, until)
    ax.set_ylim(0, ymax)
    ax.set_xlabel(f"time (s); grey: learner training; {bin_s:.0f} s bins")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def reference_picture(out: Path, seed: int) -> dict:
    params = H100_7B
    sync = run_sync(params, 8, 3, seed)
    phases = generation_phases(sync)
    edges = np.arange(0.0, sync.steps[-1].end + 5.0, 5.0)
    total = engine_rates(sync, edges).sum(0)
    mids = (edges[:-1] + edges[1:]) / 2
    peak, below_1k, tail, end = [], [], [], []
    for start, stop in phases:
        inside = (mids > start) & (mids < stop)
        frac = (mids - start) / (stop - start)
        peak.append(total[inside].max())
        below_1k.append(frac[inside & (total < 1000)].min())
        tail.append(total[inside & (frac > 0.75)].mean())  # the last quarter of the phase
        end.append(total[inside & (frac > 0.95)].mean())
    sync_sum = summarise(sync)
    train = np.mean([e - s for kind, s, e in sync.spans if kind == "train"])
    print(f"== 8 GPUs, sync (B={params.batch_samples}, {params.engine.max_running} running/GPU): "
          f"generation phases {[round(b - a) for a, b in phases]} s, then training {train:.0f} s + publish "
          f"{params.publish_s(8):.1f} s")
    print(f"   generated tokens/s: peak {np.mean(peak):,.0f}; below 1,000 from {100 * np.mean(below_1k):.0f}% of the "
          f"phase on; last quarter {np.mean(tail):,.0f}, last 5% {np.mean(end):,.0f}; training 0")
    print(f"   sampler token utilisation {sync_sum['sampler_token_util']:.2f}, GPU busy (decoding with >= 1 request "
          f"or training) {sync_sum['gpu_busy']:.2f}")
    ymax = 1.1 * max(peak)
    render(sync, sync.steps[-1].end, 5.0, ymax, "Synchronous RL, 8 GPUs (model): generated tokens/s per GPU",
           out / "fleet_sync_8gpu.png")
    figures = fleet_figures(params, 8, seed)
    best = figures["splits"][figures["best"]]
    pipe = simulate(params, "pipeline", best["samplers"], best["learners"], 12, seed)
    render(pipe, sync.steps[-1].end, 5.0, ymax, f"Pipeline RL, 8 GPUs = {best['samplers']} samplers + "
           f"{best['learners']} learners (model): generated tokens/s per sampler GPU", out / "fleet_pipeline_8gpu.png")
    print_table({8: figures}, params.batch_samples)
    return {"sync_peak_tok_s": float(np.mean(peak)), "sync_last_quarter_tok_s": float(np.mean(tail)),
            "sync_phase_frac_above_1k": float(np.mean(below_1k)),
            "speedup": best["speedup"], "best_split": figures["best"]}


# ---------------------------------------------------------------------------------------- scaling
def print_table(rows: dict[int, dict], batch: int) -> None:
    print(f"   B={batch} samples/step | sync: step s, samples/s, GPU busy, sampler token util | pipeline split: "
          "S+L, step s, samples/s, speedup, sampler busy, sampler token util, learner busy, lag mean/max, dropped")
    for gpus, f in rows.items():
        s = f["sync"]
        print(f"   {gpus:5d} GPUs  sync: {s['step_s']:7.1f} s {s['samples_per_s']:8.2f}/s busy {s['gpu_busy']:.2f} "
              f"util {s['sampler_token_util']:.2f}")
        for name, p in f["splits"].items():
            mark = " <- best" if name == f["best"] else ""
            print(f"         {name:>4} {p['samplers']:4d}+{p['learners']:<4d} {p['step_s']:7.1f} s "
                  f"{p['samples_per_s']:8.2f}/s {p['speedup']:5.2f}x  sampler {p['sampler_busy']:.2f} "
                  f"util {p['sampler_token_util']:.2f}  learner {p['learner_busy']:.2f}  lag {p['lag_mean']:.1f}/"
                  f"{p['lag_max']:.0f}  dropped {100 * p['dropped_frac']:.1f}%{mark}")


def scaling(out: Path, seed: int) -> dict:
    params = dataclasses.replace(H100_7B, batch_samples=SCALING_BATCH)
    rows = {gpus: fleet_figures(params, gpus, seed) for gpus in SIZES}
    print(f"== Scaling at a fixed global batch (max_lag {params.max_lag})")
    print_table(rows, SCALING_BATCH)
    gpus = 256  # the largest fleets behave alike; this one is 4x cheaper to simulate than 1024
    samplers, learners = split(gpus, SPLITS[1])
    sync = rows[gpus]["sync"]["samples_per_s"]
    print(f"== {gpus} GPUs, {samplers}+{learners}: max_lag against dropped (too stale) groups and speed")
    for lag in (4, 8, 16, 32):
        s = run_pipeline(dataclasses.replace(params, max_lag=lag), samplers, learners, seed)
        print(f"   max_lag {lag:2d}: {speed_line(s, sync)}")
    print(f"== {gpus} GPUs, {samplers}+{learners}: the order samplers send finished groups in (algo.queue_order)")
    orders = {}
    for (lag, order), s in lag_sweep(params, "queue_order", ORDERS, samplers, learners, seed).items():
        orders[f"max_lag {lag} {order}"] = s["samples_per_s"] / sync
        print(f"   max_lag {lag:2d}, {order:8s}: {speed_line(s, sync)}")
    print(f"== {gpus} GPUs, {samplers}+{learners}: what the learner does with stale tokens (algo.stale)")
    stale = {}
    for (lag, policy), s in lag_sweep(params, "stale", STALE_POLICIES, samplers, learners, seed).items():
        stale[f"max_lag {lag} {policy}"] = {"samples_vs_sync": s["samples_per_s"] / sync,
                                            "trained_tokens_per_s": s["trained_tokens_per_s"],
                                            "dropped_frac": s["dropped_frac"], "masked_token_frac": s["masked_token_frac"]}
        print(f"   max_lag {lag:2d}, {policy:11s}: {s['samples_per_s']:7.1f} samples/s ({s['samples_per_s'] / sync:.2f}x "
              f"sync), {s['trained_tokens_per_s']:8.0f} trained tokens/s, lag mean {s['lag_mean']:.1f}, "
              f"dropped {100 * s['dropped_frac']:.1f}% of samples, masked {100 * s['masked_token_frac']:.1f}% of tokens")
    plot_scaling(rows, out / "fleet_scaling.png")
    return {**{str(g): {"best_split": f["best"], "speedup": f["splits"][f["best"]]["speedup"]} for g, f in rows.items()},
            "queue_order_256": orders, "stale_256": stale}


def speed_line(s: dict, sync: float) -> str:
    """A pipeline run's speed against sync's, its sampler use, lag and drops: the max_lag and queue-order tables."""
    return (f"{s['samples_per_s']:7.1f} samples/s ({s['samples_per_s'] / sync:.2f}x sync), sampler token util "
            f"{s['sampler_token_util']:.2f}, lag mean {s['lag_mean']:.1f}, dropped {100 * s['dropped_frac']:.1f}%")


def lag_sweep(params: FleetParams, field: str, values, samplers: int, learners: int, seed: int) -> dict:
    """{(max_lag, value): the pipeline's summary} with FleetParams.`field` set to each value, at max_lag 4 and 8."""
    return {(lag, value): run_pipeline(dataclasses.replace(params, max_lag=lag, **{field: value}), samplers, learners, seed)
            for lag in (4, 8) for value in values}


def plot_scaling(rows: dict[int, dict], out_png: Path) -> None:
    sizes = list(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in rows[sizes[0]]["splits"]:
        left.plot(sizes, [rows[g]["splits"][name]["speedup"] for g in sizes], "o-", label=f"pipeline {name}")
    left.axhline(1.0, color="grey", lw=1)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(g) for g in sizes])
    left.set_xlabel("GPUs")
    left.set_ylabel("trained samples/s, pipeline / sync")
    left.set_title(f"Speedup at a fixed batch of {SCALING_BATCH} samples")
    left.legend()
    best = [rows[g]["splits"][rows[g]["best"]] for g in sizes]
    right.plot(sizes, [rows[g]["sync"]["sampler_token_util"] for g in sizes], "s--", label="sync: sampler token util")
    right.plot(sizes, [b["sampler_token_util"] for b in best], "o-", label="pipeline (best split): sampler token util")
    right.plot(sizes, [b["learner_busy"] for b in best], "o-", label="pipeline (best split): learner busy")
    right.plot(sizes, [b["dropped_frac"] for b in best], "x:", label="pipeline (best split): dropped")
    right.set_ylim(0, 1.05)
    right.set_xlabel("GPUs")
    right.set_title("Utilisation")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------- calibration
CALIBRATION_SEEDS = 5  # a measured run is one draw of lengths and train times; average the model over a few


def mean_summary(params: FleetParams, mode: str, samplers: int, learners: int, steps: int, seed: int) -> dict:
    runs = [summarise(simulate(params, mode, samplers, learners, steps, seed + i)) for i in range(CALIBRATION_SEEDS)]
    return {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}


def calibration(run_dir: Path, seed: int) -> dict:
    sync_dir = run_dir / "sync" if (run_dir / "sync").is_dir() else run_dir
    pipeline_dir = run_dir / "pipeline" if (run_dir / "pipeline").is_dir() else None
    cal = calibrate(sync_dir)
    S, L, steps = cal.samplers, cal.learners, cal.steps
    print(f"== Calibration from {sync_dir} ({S} sampler + {L} learner processes, {steps} steps)")
    print("   " + ", ".join(f"{k} {v:.4g}" for k, v in cal.report.items()))
    model = {mode: mean_summary(cal.params, mode, S, L, steps, seed) for mode in ("sync", "pipeline")}
    measured = {"sync": measured_summary(sync_dir)}
    if pipeline_dir is not None:
        measured["pipeline"] = measured_summary(pipeline_dir)
    keys = ("steps_per_s", "trained_tokens_per_s", "sampler_busy", "learner_busy")
    print(f"   {'model / measured':18s}" + "".join(f"{k:>24s}" for k in keys))
    for mode, m in model.items():
        cells = (f"{m[k]:.3f} / " + (f"{measured[mode][k]:.3f}" if mode in measured else "-") for k in keys)
        print(f"   {mode:18s}" + "".join(f"{c:>24s}" for c in cells))
    ratio = {"model_steps_ratio": model["pipeline"]["steps_per_s"] / model["sync"]["steps_per_s"]}
    if pipeline_dir is None:
        return ratio
    ms, mp = measured["sync"], measured["pipeline"]
    ratio["measured_steps_ratio"] = mp["steps_per_s"] / ms["steps_per_s"]
    tokens = model["pipeline"]["trained_tokens_per_s"] / model["sync"]["trained_tokens_per_s"]
    print(f"   pipeline/sync steps/s: model {ratio['model_steps_ratio']:.2f}, measured "
          f"{ratio['measured_steps_ratio']:.2f}; tokens/s: model {tokens:.2f}, measured "
          f"{mp['trained_tokens_per_s'] / ms['trained_tokens_per_s']:.2f} (mean length: sync run "
          f"{ms['length_mean']:.1f}, pipeline run {mp['length_mean']:.1f})")
    # The two processes share the cores: when both run at once each is slower than alone, as it was
    # in the sync run the model was calibrated on. Put the pipeline run's own measured speeds in.
    per_token = train_seconds_per_token(pipeline_dir)
    slow_train = per_token.mean() * L / cal.params.train_token_s
    slow_decode = ms["decode_tokens_per_busy_s"] / mp["decode_tokens_per_busy_s"]
    engine = cal.params.engine
    contended = dataclasses.replace(
        cal.params, train_token_s=cal.params.train_token_s * slow_train, log_s=mp["log_s"],
        train_jitter=tuple((per_token / per_token.mean()).tolist()),
        engine=EngineModel(engine.step_base_s * slow_decode, engine.step_per_seq_s * slow_decode, engine.max_running))
    c = mean_summary(contended, "pipeline", S, L, steps, seed)
    ratio["model_contended_steps_ratio"] = c["steps_per_s"] / model["sync"]["steps_per_s"]
    spread = per_token.std() / per_token.mean()
    print(f"   the pipeline run measured train {slow_train:.2f}x slower (spread {spread:.2f}), "
          f"decode {slow_decode:.2f}x slower, bookkeeping {1e3 * mp['log_s']:.0f} ms/step (sync run "
          f"{1e3 * ms['log_s']:.0f}).\n   With those speeds the model's pipeline: steps/s {c['steps_per_s']:.3f} "
          f"(ratio {ratio['model_contended_steps_ratio']:.2f}), sampler busy {c['sampler_busy']:.3f}, "
          f"learner busy {c['learner_busy']:.3f}")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="docs/img")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calibrate-from", type=Path, default=None, metavar="RUN_DIR")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    headline = {"reference_8gpu": reference_picture(out, args.seed), "scaling": scaling(out, args.seed)}
    if args.calibrate_from is not None:
        headline["calibration"] = calibration(args.calibrate_from, args.seed)
    print(json.dumps(_rounded(headline)))


def _rounded(value):
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return round(value, 3) if isinstance(value, float) and math.isfinite(value) else value


if __name__ == "__main__":
    main()
