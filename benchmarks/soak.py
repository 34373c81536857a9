"""Soak: a long run whose samplers are killed, added and removed (fault.on_failure=replace), against the same run
undisturbed.

    python benchmarks/soak.py --minutes 30 --kill-every-s 300 --out runs/soak

Runs `megarl train CONFIG` (configs/demo.yaml, `sampler.num_engines=--engines`, an unbounded step count, no eval
sets: `megarl samplers add` refuses them) twice, one after the other, for `--minutes` each from launch:
  1. undisturbed (`OUT/baseline`);
  2. disturbed (`OUT/faults`): every `--kill-every-s` seconds one live sampler process (not its keeper) is
     SIGKILLed, the ranks in turn; at `--add-at` of the time `megarl samplers add` starts one more sampler, and at
     `--remove-at` `megarl samplers remove` drains that added one (asked again every 10 s while the learner refuses
     it: not a member yet, or being replaced), so both runs end with the same fleet.
Each run ends with SIGTERM to `megarl train`; then no process holding its run dir may be left. Steps per minute
are counted from the first logged step to the stop (start-up excluded). Printed: both rates and
their ratio, every fault and membership line of the run's console, the metrics `samplers/replaced`,
`samplers/rollouts_lost`, `samplers/alive` at the end, the longest gap between two steps, workers' memory, the
machine's load average; the last line is one JSON object
(also in OUT/soak_report.json). Each run's console is in OUT/<run>.log.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REMOVE_RETRY_S = 10.0  # a refused `megarl samplers remove` is asked again this much later
INCARNATION_ENV = b"MEGARL_SAMPLER_INCARNATION"  # megarl.distributed.membership.INCARNATION_ENV
# The run's console lines that report a sampler's fault, replacement, join, addition or removal.
EVENT_MARKS = ("megarl: sampler ", "megarl samplers ", "megarl: publish epoch", "megarl: weight publish failed",
               "megarl: the run failed", "megarl: stopped by")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="wall time of each run, from its launch")
    parser.add_argument("--kill-every-s", type=float, default=300.0, help="SIGKILL a sampler this often")
    parser.add_argument("--engines", type=int, default=2, help="sampler.num_engines of both runs")
    parser.add_argument("--add-at", type=float, default=0.3, help="share of --minutes: `megarl samplers add`")
    parser.add_argument("--remove-at", type=float, default=0.7,
                        help="share of --minutes: `megarl samplers remove` of the added sampler")
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    parser.add_argument("--skip-baseline", action="store_true", help="the disturbed run only (no ratio)")
    parser.add_argument("--out", default="runs/soak")
    parser.add_argument("overrides", nargs="*", help="extra key=value for both runs")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.kill_every_s <= 0 or args.engines < 2:
        parser.error("--minutes and --kill-every-s must be > 0 and --engines >= 2 (a killed sampler leaves others)")
    if not 0 < args.add_at < args.remove_at < 1:
        parser.error("need 0 < --add-at < --remove-at < 1")
    return args


def train_command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The `megarl train` command of one run: unbounded, replace, enough replacements per hour for the kills."""
    kills_per_hour = math.ceil(3600 / args.kill_every_s)
    return [sys.executable, "-m", "megarl.cli", "train", args.config, f"run.dir={run_dir}", "run.steps=100000000",
            "run.log_rollouts=false", "eval.sets=[]", "fault.on_failure=replace",
            f"sampler.num_engines={args.engines}", f"fault.max_sampler_restarts_per_hour={max(6, kills_per_hour)}",
            *args.overrides]


def run_processes(run_dir: Path) -> dict[int, dict]:
    """pid -> {rank, incarnation (None for a keeper, a learner or a launcher), rss_mb} of every process whose command
    line holds the run directory (an added sampler's holds RUN_DIR/config.yaml)."""
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
        worker = b"megarl.roles.worker" in args and b"RANK" in env
        found[int(proc.name)] = {"rank": int(env[b"RANK"]) if worker else None, "rss_mb": rss / 1024,
                                 "incarnation": int(env[INCARNATION_ENV]) if INCARNATION_ENV in env else None}
    return found


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip()) if "kind" not in r]


def steps_per_minute(records: list[dict], stopped_at: float) -> float:
    """Steps logged per minute from the first logged step to `stopped_at` (wall time.time())."""
    if not records or stopped_at <= records[0]["time"]:
        return 0.0
    return (len(records) - 1) / ((stopped_at - records[0]["time"]) / 60)


def longest_gap_s(records: list[dict]) -> float:
    """The longest wall time between two consecutive logged steps: the learner's longest stall."""
    return max((b["time"] - a["time"] for a, b in zip(records, records[1:])), default=0.0)


def summary(baseline: dict | None, faults: dict) -> dict:
    """The report's JSON line: both runs' rates, their ratio (disturbed / undisturbed) and the disturbed run's counts."""
    rate = baseline["steps_per_min"] if baseline else None
    return {"baseline_steps_per_min": rate, "faults_steps_per_min": faults["steps_per_min"],
            "ratio": faults["steps_per_min"] / rate if rate else None, "kills": len(faults["kills"]),
            "replaced": faults["replaced"], "rollouts_lost": faults["rollouts_lost"], "alive_at_end": faults["alive"],
            "longest_gap_s": {"baseline": baseline["longest_gap_s"] if baseline else None,
                              "faults": faults["longest_gap_s"]},
            "steps": {"baseline": baseline["steps"] if baseline else None, "faults": faults["steps"]},
            "leaked_processes": (baseline["leaked"] if baseline else 0) + faults["leaked"],
            "load_mean": {"baseline": baseline["load_mean"] if baseline else None, "faults": faults["load_mean"]},
            "events": len(faults["events"])}


def _stop(proc: subprocess.Popen, timeout_s: float = 180) -> None:
    """SIGTERM to `megarl train` (it stops the run at a step boundary); SIGKILL of its group past `timeout_s`."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _say(start: float, line: str) -> None:
    print(f"[soak] {(time.monotonic() - start) / 60:5.1f} min  {line}", flush=True)


def one_run(args: argparse.Namespace, run_dir: Path, disturb: bool) -> dict:
    """Run for --minutes from launch (disturbed: kills, one add, one remove); what it did."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log_path = run_dir.parent / f"{run_dir.name}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(train_command(args, run_dir), stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                            start_new_session=True)
    start = time.monotonic()
    end = start + args.minutes * 60
    kills, rss, load, added, next_kill, turn = [], [], [], None, start + args.kill_every_s, 0
    add_at, remove_at = start + args.add_at * args.minutes * 60, start + args.remove_at * args.minutes * 60
    commands = []
    _say(start, f"{run_dir.name}: {'disturbed' if disturb else 'undisturbed'}, console in {log_path}")
    try:
        while time.monotonic() < end:
            time.sleep(1.0)
            if proc.poll() is not None:
                raise SystemExit(f"[soak] the run ended early (exit {proc.returncode}); see {log_path}")
            now = time.monotonic()
            procs = run_processes(run_dir)
            rss.append(sum(p["rss_mb"] for p in procs.values()))
            load.append(os.getloadavg()[0])
            if not disturb:
                continue
            samplers = sorted((p["rank"], p["incarnation"], pid) for pid, p in procs.items()
                              if p["incarnation"] is not None)
            if now >= next_kill and samplers:
                rank, incarnation, pid = samplers[turn % len(samplers)]
                os.kill(pid, signal.SIGKILL)
                turn, next_kill = turn + 1, now + args.kill_every_s
                kills.append({"minute": (now - start) / 60, "rank": rank, "incarnation": incarnation})
                _say(start, f"SIGKILL sampler rank {rank} incarnation {incarnation} (pid {pid})")
            if added is None and now >= add_at and metrics(run_dir):
                added = subprocess.Popen([sys.executable, "-m", "megarl.cli", "samplers", "add", str(run_dir)],
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                         env=env, start_new_session=True)
                _say(start, "megarl samplers add")
            if added is not None and remove_at is not None and now >= remove_at:
                sampler = str(args.engines)  # the first added one is numbered after the run's own
                done = subprocess.run([sys.executable, "-m", "megarl.cli", "samplers", "remove", str(run_dir),
                                       "--sampler", sampler], capture_output=True, text=True, cwd=REPO, env=env,
                                      timeout=600)
                commands.append((done.stdout + done.stderr).strip())
                # Refused while the added sampler is not a member (not joined yet, or being replaced): again later.
                remove_at = None if done.returncode == 0 else now + REMOVE_RETRY_S
                _say(start, f"megarl samplers remove --sampler {sampler}: exit {done.returncode}")
    finally:
        stopped_at = time.time()
        _stop(proc)
        if added is not None:
            try:
                out, _ = added.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(added.pid, signal.SIGKILL)
                out, _ = added.communicate()
            commands.insert(0, out.strip())
        log.close()
    time.sleep(5)
    leaked = run_processes(run_dir)
    records = metrics(run_dir)
    console = log_path.read_text().splitlines() + [line for out in commands for line in out.splitlines()]
    last = records[-1] if records else {}
    third = max(1, len(rss) // 3)
    return {"steps": len(records), "steps_per_min": steps_per_minute(records, stopped_at), "kills": kills,
            "replaced": last.get("samplers/replaced", 0.0), "rollouts_lost": last.get("samplers/rollouts_lost", 0.0),
            "alive": last.get("samplers/alive", 0.0), "leaked": len(leaked), "exit": proc.returncode,
            "load_mean": sum(load) / max(1, len(load)), "longest_gap_s": longest_gap_s(records),
            "events": [line for line in console if line.startswith(EVENT_MARKS)],
            "rss_mb": {"first_third_mean": sum(rss[:third]) / third, "last_third_mean": sum(rss[-third:]) / third}}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    if out.exists():
        sys.exit(f"{out} exists; pick another --out")
    out.mkdir(parents=True)
    baseline = None if args.skip_baseline else one_run(args, out / "baseline", disturb=False)
    faults = one_run(args, out / "faults", disturb=True)
    for name, run in (("baseline", baseline), ("faults", faults)):
        if run is not None:
            print(f"[soak] {name}: {run['steps']} steps, {run['steps_per_min']:.1f} steps/min, exit {run['exit']}, "
                  f"{run['leaked']} processes left, load average {run['load_mean']:.1f}, longest step gap "
                  f"{run['longest_gap_s']:.1f}s, workers' RSS {run['rss_mb']['first_third_mean']:.0f} -> "
                  f"{run['rss_mb']['last_third_mean']:.0f} MB (first -> last third)")
    print(f"[soak] faults: {len(faults['kills'])} kills; metrics at the end: samplers/replaced {faults['replaced']:.0f}, "
          f"samplers/rollouts_lost {faults['rollouts_lost']:.0f}, samplers/alive {faults['alive']:.0f}")
    for line in faults["events"]:
        print(f"[soak]   {line}")
    report = summary(baseline, faults)
    (out / "soak_report.json").write_text(json.dumps({**report, "baseline": baseline, "faults": faults}, indent=1))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
