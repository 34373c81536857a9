"""The comparisons that run `megarl train configs/demo.yaml` (or --config) once per arm (same seed, same budget) share
this: the command line (--config, --steps, --out, --only, key=value overrides for every arm), one run per arm, a failed arm
reported with its stderr tail and left out (None) rather than ending the comparison.
Used by benchmarks/objectives.py, benchmarks/critic.py and benchmarks/overlong.py."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Callable


def run_arms(arms: dict[str, list[str]], summarize: Callable[[Path], dict], report: Callable[[str, list, dict], None],
             default_out: str, argv: list[str] | None = None,
             default_config: str = "configs/demo.yaml") -> dict[str, dict | None]:
    """{arm: summarize(its run dir), or None if its run failed}; `report(arm, its overrides, summary)` as each ends."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=default_config, help="the run config every arm starts from")
    parser.add_argument("--steps", type=int, default=None, help="override run.steps")
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--only", nargs="*", default=None, help=f"arms to run, of {sorted(arms)}")
    parser.add_argument("overrides", nargs="*", help="key=value, for every arm")
    args = parser.parse_args(argv)
    results = {}
    for name, extra in arms.items():
        if args.only and name not in args.only:
            continue
        run_dir = Path(args.out) / name
        cmd = [sys.executable, "-m", "megarl.cli", "train", args.config, f"run.dir={run_dir}",
               "run.overwrite=true", "run.progress=false", *extra, *args.overrides,
               *([f"run.steps={args.steps}"] if args.steps else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: FAILED\n{proc.stderr[-2000:]}", flush=True)
            results[name] = None
            continue
        results[name] = summarize(run_dir)
        report(name, extra, results[name])
    return results
