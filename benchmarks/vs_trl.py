"""megarl vs Hugging Face TRL's GRPOTrainer: the same model, task, reward and hyperparameters on the same cores.

    python benchmarks/vs_trl.py [--steps 200] [--out runs/vs_trl] [--repeats 1] [--trl-threads 2] [key=value ...]
    python benchmarks/vs_trl.py --repeats 3     # three rounds (seeds 0, 1, 2): the median ratios and each round's
    python benchmarks/vs_trl.py --dry-run      # the settings table and the plan; runs nothing
    python benchmarks/vs_trl.py --out runs/vs_trl_wide model.path=embedded:tiny-qwen2-count-wide   # 7x larger model
    python benchmarks/vs_trl.py --shape qwen3-0.6b [--steps 3]   # random weights at Qwen3-0.6B's shape
    python benchmarks/vs_trl.py --with-eval [--steps 200] [--repeats 1]  # megarl only: held-out evaluation on vs off

Runs, one after the other: `megarl train configs/demo.yaml` in pipeline mode, the same in sync mode, and TRL
1.16.0's GRPOTrainer in its own cached environment (benchmarks/trl_env.py, built once: TRL is never installed
into megarl's environment) through benchmarks/trl_grpo_worker.py. Both sides load the same HF model directory
(the embedded demo model, resolved by megarl), draw prompts from the same stream (megarl's prompt_rng, sampler 0)
and score completions with the same function (CountTask.reward). The demo's settings are mapped onto GRPOConfig
(`trl_settings`); the printed table names every setting and whether it matches. Two megarl settings are moved to
TRL's, since TRL cannot be changed: the advantage epsilon (TRL hard-codes 1e-4) and no held-out evaluation.

Reported per run: the time to each reward threshold of the rolling 10-step mean reward, in training time (from
the first step's start: megarl's first wait, TRL's on_train_begin) and in wall time (from the moment the command
was started, start-up included), completion tokens per second of training time, the megarl start-up breakdown
(megarl/observe/startup.py's marks in the run's timeline), and the learner's per-step phases. Draws
OUT/vs_trl.png (reward vs training time and vs wall time) and keeps everything in OUT/results.json. Ends with one JSON line:
`time_to_target_ratio_vs_trl`, `wall_to_target_ratio_vs_trl`, `tokens_per_s_ratio_vs_trl` (TRL / megarl pipeline:
> 1 means megarl is faster), and the same for sync. Where each side's training time went is in the summaries: TRL's
share spent generating (`generate_frac`, its `_generate` timed), megarl's learner and sampler busy shares.
One run of each moves by tens of percent from seed to seed (the steps to the target vary): `--repeats N` runs N
rounds, round i with run seed run.seed + i on both sides (megarl's run.seed, TRL's seed and the prompt stream), into
OUT/round{i}, and the JSON line then holds each ratio's median over the rounds, its range, and every round.

`--shape qwen3-0.6b` (benchmarks/shapes.py) runs megarl pipeline and TRL on random weights at Qwen3-0.6B's shape,
built locally, with the same prompts and reward and smaller batches (shapes.SHAPE_OVERRIDES) for `--steps` steps
(3 by default). Random weights never reach a reward threshold, so it reports trained completion tokens per second,
the step time split (megarl: the learner's wait / train / publish and the samplers' generating time, which runs
beside them; TRL: generate / train, taking turns) and each process's peak RSS (benchmarks/peak_rss.py), with
ratios in the JSON line. Every run also records its processes' peak RSS.
`--with-eval` runs megarl pipeline on the demo with its held-out evaluation on and off (no TRL) and reports what
evaluation costs the learner: the time to the target and to the last step in each, the extra queue wait after each
evaluation over the run's typical wait, and the wait for the final evaluation after the last step, with the load
average around each run. With `--repeats N` it runs N such pairs (seeds run.seed + i, evaluation on first in even
pairs, off first in odd ones) and adds the medians over the pairs and their ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

WINDOW = 10  # steps in the rolling mean the thresholds are read on
THRESHOLDS = (0.7, 0.8, 0.9)
TARGET = 0.9
DEMO = "configs/demo.yaml"
# What the comparison changes in the demo config, to match what TRL cannot change or does not do.
MEGARL_OVERRIDES = ("eval.sets=[]", "algo.advantage.eps=1e-4")
EVAL_OFF = "eval.sets=[]"
AFTER_EVAL_STEPS = 8  # steps after an evaluation whose queue wait counts as its cost (the demo's queue refills by then)


def trl_settings(cfg, steps: int, seed: int, trl_threads: int) -> tuple[dict, list[tuple[str, str, str, bool]]]:
    """(GRPOConfig kwargs, the settings table) for megarl config `cfg` and TRL's torch threads. A table row is (setting, megarl's value,
    TRL's value, whether they match); TRL's value is what the kwargs give, or what TRL does when it has no such
    setting."""
    algo, loss, adv, lc, sp = cfg.algo, cfg.algo.loss, cfg.algo.advantage, cfg.learner, cfg.sampling
    batch = algo.prompts_per_step * algo.group_size
    micro_steps = max(1, batch // lc.micro_batch_size)
    kwargs = {
        "output_dir": "", "seed": seed, "max_steps": steps, "use_cpu": True, "bf16": False, "fp16": False,
        "num_generations": algo.group_size, "per_device_train_batch_size": lc.micro_batch_size,
        "gradient_accumulation_steps": micro_steps, "steps_per_generation": micro_steps, "num_iterations": 1,
        "max_completion_length": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
        "top_k": sp.top_k, "learning_rate": lc.lr, "lr_scheduler_type": "constant", "warmup_steps": 0,
        "weight_decay": lc.weight_decay, "adam_beta1": lc.adam_beta1, "adam_beta2": lc.adam_beta2,
        "max_grad_norm": lc.grad_clip, "beta": 0.0, "epsilon": loss.eps_low, "epsilon_high": loss.eps_high,
        "loss_type": "grpo", "scale_rewards": "group", "mask_truncated_completions": adv.drop_truncated,
        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
    }
    rows = [
        ("model", cfg.model.path, "same HF directory", True),
        ("task, prompts, reward", f"{cfg.task.name}: prompt_rng stream, CountTask.reward", "same prompts (TRL's "
         "sampler reorders them), same function", True),
        ("group size", str(algo.group_size), f"num_generations={kwargs['num_generations']}", True),
        ("samples per optimizer step", str(batch), f"per_device_train_batch_size {lc.micro_batch_size} x "
         f"gradient_accumulation_steps {micro_steps}", lc.micro_batch_size * micro_steps == batch),
        ("optimizer steps per batch", str(algo.sync_epochs if algo.mode == "sync" else 1),
         f"steps_per_generation={micro_steps} micro-batches, num_iterations=1", True),
        ("micro-batch rows", str(lc.micro_batch_size), str(kwargs["per_device_train_batch_size"]), True),
        ("max new tokens", str(sp.max_new_tokens), f"max_completion_length={sp.max_new_tokens}", True),
        ("temperature / top-p / top-k", f"{sp.temperature} / {sp.top_p} / {sp.top_k}",
         f"{sp.temperature} / {sp.top_p} / {sp.top_k}", True),
        ("learning rate, schedule", f"{lc.lr}, constant", f"{lc.lr}, lr_scheduler_type=constant, warmup 0", True),
        ("Adam betas, weight decay", f"{lc.adam_beta1}, {lc.adam_beta2}, {lc.weight_decay}",
         f"{lc.adam_beta1}, {lc.adam_beta2}, {lc.weight_decay} (adamw_torch)", True),
        ("gradient clipping", f"{lc.grad_clip} (off)" if not lc.grad_clip else str(lc.grad_clip),
         f"max_grad_norm={lc.grad_clip}", True),
        ("KL to a reference", f"kl_coef {loss.kl_coef}", "beta=0.0", loss.kl_coef == 0.0),
        ("clip eps low / high", f"{loss.eps_low} / {loss.eps_high}", f"epsilon={loss.eps_low}, "
         f"epsilon_high={loss.eps_high}", True),
        ("loss aggregation", loss.aggregation, "loss_type=grpo (per-sequence mean, then over sequences)",
         loss.aggregation == "seq_mean"),
        ("advantage", f"{adv.estimator}, std_normalize={adv.std_normalize} (unbiased std)",
         "scale_rewards=group (unbiased std)", adv.estimator == "grpo" and adv.std_normalize),
        ("advantage epsilon", str(adv.eps), "1e-4 (hard-coded)", adv.eps == 1e-4),
        ("truncated completions", f"drop_truncated={adv.drop_truncated}",
         f"mask_truncated_completions={adv.drop_truncated}", True),
        ("precision", "fp32", "fp32 (bf16=False, fp16=False)", True),
        ("held-out evaluation", "off" if not cfg.eval.sets else f"{len(cfg.eval.sets)} set(s)", "none",
         not cfg.eval.sets),
        ("generation", f"{algo.mode}: built-in engine, continuous batching, own process", "HF generate over one "
         "fixed batch, same process as training", False),
        ("importance ratio denominator", "behaviour log-prob recorded per token" + (
            f" (tokens up to max_lag {algo.max_lag} versions old)" if algo.mode == "pipeline" else ""),
         "always 1 (on-policy; num_iterations=1 reuses the current log-probs)", algo.mode == "sync"),
        ("positions the learner computes", "packed rows, " + ("each distinct prefix once (a group's prompt and "
         "common tokens)" if lc.share_prefixes else "each row's own") if lc.pack_sequences else "rows, cut by length",
         "every row, padded to the batch's longest", False),
        ("torch threads", f"{lc.threads} learner + {cfg.sampler.threads} x {cfg.sampler.num_engines} sampler",
         f"{trl_threads} (--trl-threads)", trl_threads == lc.threads + cfg.sampler.threads * cfg.sampler.num_engines),
    ]
    return kwargs, rows


def format_settings(rows) -> str:
    widths = [max(len(str(r[i])) for r in rows + [("setting", "megarl", "TRL GRPOTrainer")]) for i in range(3)]
    line = lambda a, b, c, d: f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}"  # noqa: E731
    return "\n".join([line("setting", "megarl", "TRL GRPOTrainer", "match")] +
                     [line(s, m, t, "yes" if ok else "NO") for s, m, t, ok in rows])


def demo_prompts(cfg, n: int) -> list[dict]:
    """The first n prompts of the stream megarl's sampler 0 draws (group k from prompt_rng(seed, 0, k))."""
    from megarl.rollout.tasks import prompt_rng, task_from_config

    task = task_from_config(cfg.task)
    prompts = [task.sample_prompts(prompt_rng(cfg.run.seed, 0, k), 1)[0] for k in range(n)]
    return [{"prompt": p.text, "answer": p.answer} for p in prompts]


def rolling(values: list[float], window: int = WINDOW) -> list[float]:
    """The mean of each value and the (window - 1) before it (fewer at the start)."""
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def curve_summary(curve: dict) -> dict:
    """From one run's curve {"train_s", "wall_s", "reward", "tokens": per step}: the step, training time and
    wall time at which the rolling WINDOW-step reward first reached each threshold (None: never), and the
    completion tokens per second of training time."""
    smooth = rolling(curve["reward"])
    reached = {}
    for threshold in THRESHOLDS:
        i = next((i for i, r in enumerate(smooth) if i + 1 >= WINDOW and r >= threshold), None)
        reached[str(threshold)] = None if i is None else {"step": i + 1, "train_s": round(curve["train_s"][i], 2),
                                                          "wall_s": round(curve["wall_s"][i], 2)}
    summary = {"steps": len(smooth), "reached": reached, "final_reward": round(smooth[-1], 3) if smooth else None,
               "tokens_per_s": round(sum(curve["tokens"]) / curve["train_s"][-1], 3) if smooth else None,
               "train_s": round(curve["train_s"][-1], 2) if smooth else None}
    # Where the training time went: the share of it spent generating (TRL: one process, so generation and
    # training take turns) or each role's busy share (megarl: sampler and learner run at once).
    for share, key in (("generate_frac", "generate_s"), ("learner_busy_frac", "learner_s")):
        if smooth and curve.get(key):
            summary[share] = round(sum(curve[key]) / curve["train_s"][-1], 3)
    if smooth and curve.get("sampler_busy_frac") and curve["sampler_busy_frac"][-1] is not None:
        summary["sampler_busy_frac"] = round(curve["sampler_busy_frac"][-1], 3)
    return summary


def ratios(megarl: dict, trl: dict, target: float = TARGET) -> dict:
    """TRL's time / megarl's (> 1: megarl sooner) to the target, in training and wall time; megarl's tokens/s
    over TRL's. None where either never reached the target."""
    m, t = megarl["reached"].get(str(target)), trl["reached"].get(str(target))
    both = m is not None and t is not None
    return {"time_to_target_ratio_vs_trl": round(t["train_s"] / m["train_s"], 3) if both else None,
            "wall_to_target_ratio_vs_trl": round(t["wall_s"] / m["wall_s"], 3) if both else None,
            "tokens_per_s_ratio_vs_trl": round(megarl["tokens_per_s"] / trl["tokens_per_s"], 3)}


def megarl_curve(run_dir: Path, launch_time: float) -> dict:
    """Per step from metrics.jsonl: training time since the first step began (its wait included: the
    samplers' first generation), wall time since the command started, reward, completion tokens."""
    from megarl.observe.sinks import train_records

    rows = train_records([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])
    first_start = rows[0]["time"] - rows[0]["num_tokens"] / rows[0]["tokens_per_s"]
    train_s = [r["time"] - first_start for r in rows]
    busy = [[v for k, v in r.items() if k.endswith("/busy_frac")] for r in rows]  # each sampler's, per step
    return {"train_s": train_s, "wall_s": [r["time"] - launch_time for r in rows],
            "reward": [r["reward_mean"] for r in rows], "tokens": [r["num_tokens"] for r in rows],
            "learner_s": [r["train_s"] for r in rows], "wait_s": [r.get("queue_wait_s", 0.0) for r in rows],
            "publish_s": [r.get("publish_s", 0.0) for r in rows],
            # the samplers' mean share of their time spent decoding, since each started (a running count)
            "sampler_busy_frac": [sum(b) / len(b) if b else None for b in busy]}


def trl_curve(log: list[dict], launch_time: float) -> dict:
    steps = [r for r in log if "step" in r]
    begin = next(r for r in log if r.get("kind") == "startup")["train_begin"] + launch_time
    return {"train_s": [r["time"] - begin for r in steps], "wall_s": [r["time"] - launch_time for r in steps],
            "reward": [r["reward"] for r in steps], "tokens": [r["completion_tokens"] for r in steps],
            "generate_s": [r.get("generate_s", 0.0) for r in steps]}


def startup_breakdown(run_dir: Path, launch_time: float, launched_torchrun: float | None) -> dict:
    """Seconds of each part from `megarl train` to the end of the first step, from the learner's timeline: the
    command until the learner process exists (the CLI reads the config and starts torchrun, which starts the
    ranks while the CLI checks the run: megarl.distributed.launch_gate), the learner's start-up marks
    (megarl/observe/startup.py; "launch gate" is its wait for the CLI's verdict), then the first step's wait (the
    samplers' start-up and first batch), train and publish. "cli: checks passed" (when its 'launching: torchrun'
    line came, after the command's start) overlaps the learner's parts and is not one of the sequence."""
    from megarl.observe.timeline import STARTUP, load_startup, load_timeline

    events = load_timeline(run_dir)["learner0"]
    marks = load_startup(run_dir)["learner0"]
    first = {kind: next(e for e in events if e["kind"] == kind) for kind in ("wait", "train", "publish")}
    parts = {"cli + torchrun: until the learner process started": marks[0]["start"] - launch_time}
    for e in marks:
        parts[f"learner: {e['kind'][len(STARTUP):]}"] = e["end"] - e["start"]
    parts["gap to the first step"] = first["wait"]["start"] - marks[-1]["end"]
    parts["first step: wait for the first batch"] = first["wait"]["end"] - first["wait"]["start"]
    parts["first step: train"] = first["train"]["end"] - first["train"]["start"]
    parts["first step: publish"] = first["publish"]["end"] - first["publish"]["start"]
    if launched_torchrun is not None:
        parts["(overlapping) cli: checks passed, after the command's start"] = launched_torchrun - launch_time
    return {k: round(v, 3) for k, v in parts.items()}


def learner_phases(run_dir: Path, skip: int = 5) -> dict:
    """Medians over the steps after the first `skip` (warm-up), in ms: the learner's wait for a batch, its
    train step in wall time and in CPU time of its thread (the gap: time the step waited for a core), publish."""
    from statistics import median

    from megarl.observe.sinks import train_records

    rows = train_records([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])[skip:]
    keys = {"wait_ms": "queue_wait_s", "train_ms": "train_s", "train_cpu_ms": "train_cpu_s", "publish_ms": "publish_s"}
    return {name: round(1e3 * median(r[key] for r in rows), 1) for name, key in keys.items()
            if rows and all(key in r for r in rows)}


def megarl_process_label(learners: int):
    """A peak_rss label for `megarl train`'s processes: learner{r} / sampler{i} by torchrun's RANK, else the CLI
    or torchrun itself."""
    def label(pid: int, cmdline: str, environ: dict) -> str | None:
        if "RANK" in environ and "LOCAL_RANK" in environ:
            rank = int(environ["RANK"])
            return f"learner{rank}" if rank < learners else f"sampler{rank - learners}"
        if "torchrun" in cmdline or "torch.distributed.run" in cmdline:
            return "torchrun"
        return "megarl cli" if "megarl.cli" in cmdline else None
    return label


def timed_megarl(cmd: list[str], what: str, learners: int = 1) -> tuple[float, float | None, float, dict]:
    """Run a `megarl` command to its end: (its launch time, when its 'launching: torchrun' line arrived, when it
    ended, each process's peak RSS in MiB); exits naming `what` and the output's tail if it fails."""
    from peak_rss import PeakRss

    launch = time.time()
    launched_torchrun, output = None, []
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with PeakRss(proc.pid, megarl_process_label(learners)) as peaks:
        for line in proc.stdout:  # timestamp the CLI's "launching: torchrun" line as it arrives
            output.append(line)
            if launched_torchrun is None and "launching: torchrun" in line:
                launched_torchrun = time.time()
        code = proc.wait()
    if code != 0:
        sys.exit(f"{what} failed:\n{''.join(output)[-4000:]}")
    return launch, launched_torchrun, time.time(), peaks.by_label()


def run_megarl(mode: str, out: Path, steps: int, overrides: list[str], base: tuple = MEGARL_OVERRIDES,
               name: str | None = None) -> dict:
    """One `megarl train` of the demo config with `base` and `overrides`, into OUT/megarl_{name or mode}."""
    run_dir = out / f"megarl_{name or mode}"
    cmd = [sys.executable, "-m", "megarl.cli", "train", DEMO, f"run.dir={run_dir}", f"run.steps={steps}",
           "run.progress=false", "run.overwrite=true", f"algo.mode={mode}", *base, *overrides]
    launch, launched_torchrun, ended, peaks = timed_megarl(cmd, f"megarl {name or mode} run")
    curve = megarl_curve(run_dir, launch)
    return {"curve": curve, "summary": curve_summary(curve), "command": " ".join(cmd[1:]), "launch": launch, "ended": ended,
            "peak_rss_mb": peaks, "split": time_split(curve), "run_dir": str(run_dir),
            "startup": startup_breakdown(run_dir, launch, launched_torchrun), "phases": learner_phases(run_dir)}


def run_trl(out: Path, model_dir: Path, prompts: list[dict], grpo_config: dict, threads: int) -> dict:
    from trl_env import ensure_env

    python = ensure_env()
    run_dir = out / "trl"
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "steps.jsonl"
    launch = time.time()
    spec = {"model_dir": str(model_dir), "prompts": prompts, "threads": threads, "out": str(log_path),
            "launch_time": launch, "grpo_config": {**grpo_config, "output_dir": str(run_dir / "trainer")}}
    (run_dir / "spec.json").write_text(json.dumps(spec))
    from peak_rss import PeakRss

    with open(run_dir / "stdout.txt", "w") as stdout, open(run_dir / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen([str(python), str(ROOT / "benchmarks" / "trl_grpo_worker.py"), str(run_dir / "spec.json")],
                                stdout=stdout, stderr=stderr, env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
                                                                   "OMP_NUM_THREADS": str(threads),
                                                                   "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        with PeakRss(proc.pid, lambda pid, cmdline, env: "TRL" if "trl_grpo_worker" in cmdline else None) as peaks:
            code = proc.wait()
    if code != 0:
        sys.exit(f"TRL run failed (output in {run_dir}/stdout.txt, stderr.txt):\n"
                 f"{(run_dir / 'stderr.txt').read_text()[-4000:]}")
    log = [json.loads(line) for line in log_path.read_text().splitlines()]
    curve = trl_curve(log, launch)
    startup = next(r for r in log if r.get("kind") == "startup")
    return {"curve": curve, "summary": curve_summary(curve), "peak_rss_mb": peaks.by_label(), "split": time_split(curve),
            "startup": {k: v for k, v in startup.items() if k != "kind"}}


def time_split(curve: dict, skip: int = 1) -> dict:
    """Seconds per step, the mean over the steps after the first `skip` (the first step's wait holds the samplers'
    start-up; all steps where there are no more): the step, and where it went. megarl: the learner's wait for a
    batch, train and publish (they add up to its step), and the samplers' generating time, which runs beside them
    (their busy share times the step); TRL: generate and the rest of the step (train), which take turns."""
    times = curve["train_s"]
    steps = [b - a for a, b in zip([0.0] + times[:-1], times)]
    keep = list(range(skip, len(steps))) if len(steps) > skip else list(range(len(steps)))
    if not keep:
        return {}
    mean = lambda values: round(sum(values[i] for i in keep) / len(keep), 3)  # noqa: E731
    split = {"step_s": mean(steps), "steps_averaged": len(keep)}
    if "learner_s" in curve:
        split.update(wait_s=mean(curve["wait_s"]), train_s=mean(curve["learner_s"]), publish_s=mean(curve["publish_s"]))
        busy = curve.get("sampler_busy_frac") or [None]
        if busy[-1] is not None:
            split["generate_s (samplers, beside the learner)"] = round(busy[-1] * split["step_s"], 3)
    elif "generate_s" in curve:
        split.update(generate_s=mean(curve["generate_s"]),
                     train_s=round(mean(steps) - mean(curve["generate_s"]), 3))
    return split


def plot(results: dict, out_png: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, axis, label in ((axes[0], "train_s", "training time (s): from the first step's start"),
                            (axes[1], "wall_s", "wall time (s): from the command's start, start-up included")):
        for name, result in results.items():
            curve = result["curve"]
            ax.plot(curve[axis], rolling(curve["reward"]), label=f"{name} ({result['summary']['tokens_per_s']:,.0f} tok/s)")
        ax.axhline(TARGET, color="grey", ls="--", lw=0.8)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"reward, rolling {WINDOW}-step mean")
    axes[0].legend(loc="lower right")
    fig.suptitle(f"megarl vs TRL's GRPOTrainer on {model}: same model, task, reward and hyperparameters; same cores")
    axes[0].set_title("against training time")
    axes[1].set_title(f"against wall time (dashed: the target {TARGET})")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def print_results(results: dict, shape: str = "demo") -> None:
    for name, result in results.items():
        print(f"  {name:<16} peak RSS per process (MiB): {result.get('peak_rss_mb')}; per step (s): "
              f"{result.get('split')}")
    if shape != "demo":
        print(f"\n{shape}: random weights never reach a reward threshold; the comparison is trained tokens/s, the "
              f"step time split and peak memory:")
        for name, result in results.items():
            print(f"  {name:<16} {result['summary']['tokens_per_s']:,.3f} trained completion tokens/s over "
                  f"{result['summary']['steps']} steps ({result['summary']['train_s']} s of training)")
        return
    print(f"\ntime to the rolling {WINDOW}-step reward (training time / wall time incl. start-up, step):")
    for name, result in results.items():
        s = result["summary"]
        cells = [f"{t}: " + ("never" if r is None else f"{r['train_s']:.1f} s / {r['wall_s']:.1f} s (step {r['step']})")
                 for t, r in s["reached"].items()]
        shares = "; ".join(f"{k} {s[k]}" for k in ("generate_frac", "learner_busy_frac", "sampler_busy_frac") if k in s)
        print(f"  {name:<16} " + "; ".join(cells) + f"; {s['tokens_per_s']:,.0f} tok/s; final {s['final_reward']}"
              + (f"; {shares}" if shares else ""))
    for name, result in results.items():
        print(f"\nstart-up, {name} (s):")
        for part, seconds in result["startup"].items():
            print(f"  {part:<60} {seconds:8.3f}")
        if "phases" in result:
            print(f"  learner per step after warm-up (median): {result['phases']}")


def shape_overrides(shape: str, model_dir: Path | None) -> list[str]:
    """The megarl overrides that put the demo at `shape` (none for "demo"): its model directory, smaller batches."""
    from shapes import SHAPE_OVERRIDES

    return [] if shape == "demo" else [f"model.path={model_dir}", *SHAPE_OVERRIDES[shape]]


def run_round(args, out: Path, seed: int) -> dict:
    """megarl pipeline, megarl sync and TRL one after the other, all with run seed `seed` (megarl's run.seed; TRL's
    seed and the prompt stream both sides draw): their results, printed, kept in OUT/results.json and drawn."""
    from megarl.config.load import load_config
    from megarl.embedded.registry import resolve_model_path

    shape_dir = None
    if args.shape != "demo":
        from shapes import ensure_shape_model

        shape_dir = ensure_shape_model(args.shape)
    overrides = [*shape_overrides(args.shape, shape_dir), *args.overrides, f"run.seed={seed}"]
    cfg = load_config(str(ROOT / DEMO), [*MEGARL_OVERRIDES, *overrides])
    grpo_config, _ = trl_settings(cfg, args.steps, cfg.run.seed, args.trl_threads)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    results = {}
    for mode in ("pipeline", "sync"):
        if mode not in args.skip:
            results[f"megarl {mode}"] = run_megarl(mode, out, args.steps, overrides)
            print(f"megarl {mode}: {json.dumps(results[f'megarl {mode}']['summary'])}", flush=True)
    if "trl" not in args.skip:
        results["TRL GRPOTrainer"] = run_trl(out, model_dir, demo_prompts(cfg, args.steps * cfg.algo.prompts_per_step),
                                             grpo_config, args.trl_threads)
        print(f"TRL: {json.dumps(results['TRL GRPOTrainer']['summary'])}", flush=True)
    print_results(results, args.shape)
    (out / "results.json").write_text(json.dumps(results))  # curves and all: to re-plot or compare later
    plot(results, out / "vs_trl.png", cfg.model.path)
    print(f"\npicture: {out / 'vs_trl.png'}")
    return results


def shape_line(results: dict, shape: str) -> dict:
    """The JSON line at a real shape: megarl's trained tokens/s over TRL's, each system's tokens/s, step split
    and peak RSS per process."""
    line = {"shape": shape, "note": "random weights: throughput and time split, not time to a target"}
    if "TRL GRPOTrainer" in results and "megarl pipeline" in results:
        line["tokens_per_s_ratio_vs_trl"] = round(results["megarl pipeline"]["summary"]["tokens_per_s"]
                                                  / results["TRL GRPOTrainer"]["summary"]["tokens_per_s"], 3)
    for name, r in results.items():
        line[name] = {"tokens_per_s": r["summary"]["tokens_per_s"], "steps": r["summary"]["steps"],
                      "split": r.get("split"), "peak_rss_mb": r.get("peak_rss_mb")}
    return line


def eval_cost(records: list[dict], after: int = AFTER_EVAL_STEPS) -> dict:
    """What held-out evaluation cost the learner in one run's metrics.jsonl records: the evaluations' count and
    seconds (`eval_s`, spent on the samplers), the learner's extra queue wait in the `after` steps following each
    evaluation over the mean wait of the steps outside those windows (signed: with no cost it is 0 give or take the
    waits' noise), and the wait for evaluations reported after the last step (the final evaluation: the run cannot
    end before it)."""
    from megarl.observe.sinks import eval_records, train_records

    steps, evals = train_records(records), eval_records(records)
    windows = {s for e in evals for s in range(e["step"] + 1, e["step"] + after + 1)}
    outside = [r["queue_wait_s"] for r in steps if r["step"] not in windows] or [0.0]
    base = sum(outside) / len(outside)
    extra = sum(r["queue_wait_s"] - base for r in steps if r["step"] in windows)
    last = steps[-1]["time"] if steps else 0.0
    return {"evaluations": len(evals), "eval_s": round(sum(e.get("eval_s", 0.0) for e in evals), 3),
            "mean_queue_wait_s": round(base, 4), "extra_queue_wait_s": round(extra, 3),
            "final_eval_wait_s": round(max([0.0] + [e["time"] - last for e in evals]), 3)}


def eval_round(args, out: Path, seed: int, on_first: bool) -> dict:
    """One pair: megarl pipeline on the demo with its held-out evaluation on and off (in that order, or off first),
    run seed `seed`: the time to the target and to the last step of each, the end of the command after the last
    step, what evaluation cost the learner, and the load average before and after each run."""
    overrides = [*args.overrides, f"run.seed={seed}"]
    order = ["eval on", "eval off"] if on_first else ["eval off", "eval on"]
    runs, loads = {}, {}
    for name in order:
        before = os.getloadavg()[0]
        runs[name] = (run_megarl("pipeline", out, args.steps, overrides, base=("algo.advantage.eps=1e-4",),
                                 name="pipeline_eval_on") if name == "eval on" else
                      run_megarl("pipeline", out, args.steps, overrides, name="pipeline_eval_off"))
        loads[name] = [round(before, 1), round(os.getloadavg()[0], 1)]
    line = {"seed": seed, "order": order}
    for name, r in runs.items():
        records = [json.loads(x) for x in (Path(r["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        target = r["summary"]["reached"].get(str(TARGET))
        line[name] = {"train_s_to_target": target and target["train_s"], "step_to_target": target and target["step"],
                      "train_s_to_last_step": r["summary"]["train_s"],
                      "end_after_last_step_s": round(r["ended"] - r["launch"] - r["curve"]["wall_s"][-1], 3),
                      "load_average": loads[name], **eval_cost(records)}
    on, off = line["eval on"], line["eval off"]
    if on["train_s_to_target"] and off["train_s_to_target"]:
        line["target_time_ratio_on_over_off"] = round(on["train_s_to_target"] / off["train_s_to_target"], 3)
    line["last_step_time_ratio_on_over_off"] = round(on["train_s_to_last_step"] / off["train_s_to_last_step"], 3)
    line["learner_lost_s"] = round(on["extra_queue_wait_s"] + on["final_eval_wait_s"], 3)
    (out / "results.json").write_text(json.dumps({"runs": runs, "line": line}))
    for name in order:
        print(f"  {name}: {line[name]}", flush=True)
    return line


def run_with_eval(args, out: Path, seed: int) -> dict:
    """`--repeats` pairs (round i: run seed `seed` + i, evaluation on first in even rounds, off first in odd ones, so
    a load that rises or falls during a pair favours neither side): each round's line and, over the rounds, the
    median time to the target and to the last step with evaluation on and off and their ratios (steps to the target
    move by tens of percent from seed to seed and with the timing of the rollouts, so one pair cannot show a 10%
    difference; the medians of alternating pairs can)."""
    rounds = []
    for i in range(args.repeats):
        print(f"\n=== pair {i + 1} of {args.repeats} (run.seed={seed + i}) ===", flush=True)
        rounds.append(eval_round(args, out / f"round{i}" if args.repeats > 1 else out, seed + i, on_first=i % 2 == 0))
    if len(rounds) == 1:
        return rounds[0]
    def median(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 3) if values else None

    line = {f"median_{key}_{side.replace(' ', '_')}": median([r[side][key] for r in rounds])
            for key in ("train_s_to_target", "train_s_to_last_step") for side in ("eval on", "eval off")}
    on, off = line["median_train_s_to_target_eval_on"], line["median_train_s_to_target_eval_off"]
    line["median_target_time_ratio_on_over_off"] = on and off and round(on / off, 3)
    line["median_last_step_time_ratio_on_over_off"] = round(line["median_train_s_to_last_step_eval_on"]
                                                            / line["median_train_s_to_last_step_eval_off"], 3)
    # Each pair's own ratio, its two runs made back to back under about the same load, then their median.
    line["median_pair_target_time_ratio_on_over_off"] = median([r.get("target_time_ratio_on_over_off") for r in rounds])
    line["median_learner_lost_s"] = median([r["learner_lost_s"] for r in rounds])
    return {**line, "rounds": rounds}


def round_ratios(results: dict) -> dict:
    """The JSON line's ratios of one round (TRL / megarl: > 1 means megarl is faster), pipeline and `_sync`."""
    line = {}
    if "TRL GRPOTrainer" in results:
        trl = results["TRL GRPOTrainer"]["summary"]
        for mode in ("pipeline", "sync"):
            if f"megarl {mode}" in results:
                r = ratios(results[f"megarl {mode}"]["summary"], trl)
                line.update(r if mode == "pipeline" else {f"{k}_sync": v for k, v in r.items()})
    return line


def median_ratios(rounds: list[dict]) -> dict:
    """Per ratio, the median over the rounds that reached the target (None: none did), and its range."""
    out = {}
    for key in rounds[0]:
        values = sorted(r[key] for r in rounds if r.get(key) is not None)
        out[key] = round(statistics.median(values), 3) if values else None
        out[f"{key}_range"] = [values[0], values[-1]] if values else None
    return out


def plan(args, model_dir: Path | None) -> dict:
    """What a run of these arguments does, as the dry run prints it."""
    if args.with_eval:
        runs = ["megarl pipeline, held-out evaluation on", "megarl pipeline, evaluation off"]
    else:
        runs = [f"megarl {m}" for m in ("pipeline", "sync") if m not in args.skip] + (
            ["TRL"] if "trl" not in args.skip else [])
    out = {"dry_run": True, "shape": args.shape, "steps": args.steps, "repeats": args.repeats, "runs": runs,
           "with_eval": args.with_eval}
    if args.shape != "demo":
        from shapes import SHAPE_OVERRIDES, parameter_count

        out.update(model_dir=str(model_dir), model_built=(model_dir / "config.json").is_file(),
                   parameters=parameter_count(), megarl_overrides=list(SHAPE_OVERRIDES[args.shape]),
                   reports="trained tokens/s, step time split, peak RSS per process (random weights: no target)")
    elif args.with_eval:
        out["reports"] = ("time to the target and to the last step, eval on / off; extra queue wait after each "
                          "evaluation; final-evaluation wait")
    return out


def print_plan(args, model_dir: Path | None, rows) -> None:
    from trl_env import ENV

    p = plan(args, model_dir)
    print(f"plan: {args.repeats} x ({', '.join(p['runs'])}; {args.steps} steps each)"
          + ("" if args.with_eval or "trl" in args.skip else
             f"; TRL environment {ENV.directory()} {'ready' if ENV.is_ready() else 'to be built (minutes, 1.5 GB)'}"))
    if args.shape != "demo":
        print(f"model: random weights at {args.shape}'s shape, {p['parameters'] / 1e6:.0f}M parameters, "
              f"{p['model_dir']} ({'built' if p['model_built'] else 'built on the first run'}); "
              f"{p['reports']}")
    print(json.dumps({**p, "settings_matched": sum(r[3] for r in rows), "settings": len(rows)}))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the shape's defaults filled in (--steps, --skip); exits naming the flag on a bad one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps of each run (default: 200 for --shape demo, 3 for qwen3-0.6b)")
    parser.add_argument("--shape", default="demo", choices=["demo", "qwen3-0.6b"],
                        help="demo: the embedded demo model, to a reward target; qwen3-0.6b: random weights at "
                             "Qwen3-0.6B's shape, throughput / time split / peak memory (benchmarks/shapes.py)")
    parser.add_argument("--with-eval", action="store_true",
                        help="megarl pipeline on the demo with held-out evaluation on and off (no TRL): what "
                             "evaluation costs the learner")
    parser.add_argument("--out", default="runs/vs_trl")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds, each with the next run seed (run.seed, then +1, ...); the JSON line holds the "
                             "median ratios and each round's")
    parser.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process")
    parser.add_argument("--skip", nargs="*", default=None, choices=["pipeline", "sync", "trl"],
                        help="runs to leave out (default: none; sync at a real shape)")
    parser.add_argument("--dry-run", action="store_true", help="print the settings and the plan; run nothing")
    parser.add_argument("overrides", nargs="*", help="megarl key=value overrides (both megarl runs)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.with_eval and args.shape != "demo":
        parser.error("--with-eval measures the demo's evaluation; drop --shape or --with-eval")
    from shapes import DEFAULT_STEPS

    args.steps = args.steps if args.steps is not None else DEFAULT_STEPS[args.shape]
    if args.skip is None:
        args.skip = [] if args.shape == "demo" else ["sync"]
    return args


def main() -> None:
    args = parse_args()

    from shapes import shape_dir

    from megarl.config.load import load_config

    # At a real shape the model directory may not be built yet: the plan names where it goes.
    planned_dir = None if args.shape == "demo" else shape_dir(args.shape)
    cfg = load_config(str(ROOT / DEMO), [*MEGARL_OVERRIDES, *shape_overrides(args.shape, planned_dir), *args.overrides])
    grpo_config, rows = trl_settings(cfg, args.steps, cfg.run.seed, args.trl_threads)
    print(format_settings(rows))
    print(f"\nGRPOConfig({', '.join(f'{k}={v!r}' for k, v in grpo_config.items() if k != 'output_dir')})")
    print(f"megarl overrides of {DEMO}: {' '.join([*MEGARL_OVERRIDES, *shape_overrides(args.shape, planned_dir)])}")
    if args.dry_run:
        print_plan(args, planned_dir, rows)
        return
    out = ROOT / args.out
    if args.with_eval:
        print(json.dumps({"with_eval": True, **run_with_eval(args, out, cfg.run.seed)}))
        return
    if args.repeats == 1:
        results = run_round(args, out, cfg.run.seed)
        if args.shape != "demo":
            print(json.dumps(shape_line(results, args.shape)))
            return
        print(json.dumps({**round_ratios(results), "summaries": {name: r["summary"] for name, r in results.items()}}))
        return
    rounds = []
    for i in range(args.repeats):
        seed = cfg.run.seed + i
        print(f"\n=== round {i + 1} of {args.repeats} (run.seed={seed}) ===", flush=True)
        results = run_round(args, out / f"round{i}", seed)
        rounds.append({"seed": seed, **round_ratios(results),
                       "summaries": {name: r["summary"] for name, r in results.items()}})
    ratio_rows = [{k: v for k, v in r.items() if k not in ("seed", "summaries")} for r in rounds]
    print("\nratios per round (TRL / megarl pipeline; training time, wall time, tokens/s):")
    for r in rounds:
        print(f"  seed {r['seed']}: " + ", ".join(f"{r.get(k)}" for k in (
            "time_to_target_ratio_vs_trl", "wall_to_target_ratio_vs_trl", "tokens_per_s_ratio_vs_trl")))
    print(json.dumps({**median_ratios(ratio_rows), "rounds": rounds}))


if __name__ == "__main__":
    main()
