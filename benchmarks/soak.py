"""Soak: the demo for a long time under fault.on_failure=restart, with a sampler killed mid-run.

    python benchmarks/soak.py --minutes 32 --kill-at 12 --out runs/soak

Starts `megarl train configs/demo.yaml` with an unbounded step count, checkpoints every
`--checkpoint-every` steps, samples the resident memory (VmRSS) of every process of the run every
`--sample-s` seconds, SIGKILLs the sampler (rank 1) at `--kill-at` minutes (torchrun restarts every
process and the learner resumes from its last checkpoint), and at `--minutes` stops the run with
SIGTERM to torchrun. It then checks that no process of the run is left, and reports:
  * memory: total RSS of the workers at the first sample after warm-up of each attempt and at its end,
    and the growth in between (bound: --max-growth, default 15%);
  * what the restart cost (the `restarts` / `redone_steps` metrics) and the run's drop counters;
  * reward at the start and the end.
Ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_processes(run_dir: Path) -> dict[int, dict]:
    """pid -> {rank, rss_mb} of every process whose command line holds the run directory."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            args = (proc / "cmdline").read_bytes()
            if str(run_dir).encode() not in args:
                continue
            env = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
            rss = next(int(line.split()[1]) for line in (proc / "status").read_text().splitlines()
                       if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
        rank = int(env[b"RANK"]) if b"megarl.roles.worker" in args and b"RANK" in env else None
        found[int(proc.name)] = {"rank": rank, "rss_mb": rss / 1024}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=32.0)
    parser.add_argument("--kill-at", type=float, default=12.0, help="minutes after start: SIGKILL the sampler")
    parser.add_argument("--warmup", type=float, default=3.0, help="minutes after each (re)start before memory counts")
    parser.add_argument("--sample-s", type=float, default=20.0)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--max-growth", type=float, default=0.15)
    parser.add_argument("--out", default="runs/soak")
    parser.add_argument("overrides", nargs="*", help="extra key=value for megarl train")
    args = parser.parse_args()

    run_dir = Path(args.out).resolve()
    if run_dir.exists():
        sys.exit(f"{run_dir} exists; pick another --out")
    cmd = [sys.executable, "-m", "megarl.cli", "train", str(REPO / "configs" / "demo.yaml"), f"run.dir={run_dir}",
           "run.steps=100000000", "run.log_rollouts=false", "fault.on_failure=restart", "fault.max_restarts=3",
           f"checkpoint.every_steps={args.checkpoint_every}", "checkpoint.keep=2", *args.overrides]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")  # the run's console output
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    start = time.monotonic()
    samples, killed_at, attempt_start = [], None, start
    while time.monotonic() - start < args.minutes * 60:
        time.sleep(args.sample_s)
        assert proc.poll() is None, f"the run ended early (exit {proc.returncode}); see {log.name}"
        procs = run_processes(run_dir)
        workers = {p["rank"]: p["rss_mb"] for p in procs.values() if p["rank"] is not None}
        minute = (time.monotonic() - start) / 60
        samples.append({"minute": minute, "attempt": 0 if killed_at is None else 1,
                        "workers_rss_mb": sum(workers.values()), "per_rank_mb": workers, "processes": len(procs)})
        print(f"[soak] {minute:5.1f} min  workers RSS {sum(workers.values()):7.1f} MB  "
              f"{ {r: round(m) for r, m in sorted(workers.items())} }", flush=True)
        if killed_at is None and minute >= args.kill_at and 1 in workers:
            sampler = next(pid for pid, p in procs.items() if p["rank"] == 1)
            os.kill(sampler, signal.SIGKILL)
            killed_at, attempt_start = minute, time.monotonic()
            print(f"[soak] {minute:5.1f} min  SIGKILL sampler rank 1 (pid {sampler})", flush=True)
    os.killpg(proc.pid, signal.SIGTERM)  # torchrun's agent forwards it to every worker
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    time.sleep(5)
    leaked = run_processes(run_dir)

    metrics = [r for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()) if "kind" not in r]  # eval records: docs/eval.md
    growth = {}
    for attempt in (0, 1):
        seg = [s for s in samples if s["attempt"] == attempt
               and s["minute"] >= (args.warmup if attempt == 0 else killed_at + args.warmup)]
        if len(seg) >= 2:
            growth[attempt] = {"from_mb": seg[0]["workers_rss_mb"], "to_mb": seg[-1]["workers_rss_mb"],
                               "growth": seg[-1]["workers_rss_mb"] / seg[0]["workers_rss_mb"] - 1,
                               "minutes": seg[-1]["minute"] - seg[0]["minute"]}
    last = metrics[-1]
    tenth = max(1, len(metrics) // 10)
    report = {
        "minutes": args.minutes, "steps": len(metrics), "killed_sampler_at_min": killed_at,
        "restarts": last.get("restarts", 0.0), "redone_steps": max((m.get("redone_steps", 0.0) for m in metrics), default=0),
        "dropped_stale_groups_total": last.get("dropped/stale_groups_total", 0.0),
        "reward_first10pct": sum(m["reward_mean"] for m in metrics[:tenth]) / tenth,
        "reward_last10pct": sum(m["reward_mean"] for m in metrics[-tenth:]) / tenth,
        "memory": growth, "max_growth_allowed": args.max_growth,
        "memory_within_bound": all(g["growth"] <= args.max_growth for g in growth.values()),
        "leaked_processes": len(leaked),
    }
    print(json.dumps(report))
    (run_dir / "soak_report.json").write_text(json.dumps({**report, "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
