"""Start-up to the first step, part by part: `megarl train` on the demo config, a few times, each part's seconds.

    python benchmarks/startup.py [--repeats 3] [--out /tmp/megarl_startup] [key=value ...]

Runs `megarl train configs/demo.yaml run.steps=3` (plus any overrides) `--repeats` times one after the other and
reads each run's start-up breakdown as benchmarks/vs_trl.py does (`startup_breakdown`: the CLI's checks until its
'launching: torchrun' line, torchrun until the learner process exists, the learner's start-up marks, the first
step), and the sampler's marks. Prints a table of the median and every repeat per part, the wall time from the
command to the end of the first step, and ends with one JSON line (`first_step_s`: the median of that wall time).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from vs_trl import DEMO, startup_breakdown, timed_megarl  # noqa: E402

FIRST_STEP = "until the end of the first step"


def run_once(run_dir: Path, overrides: list[str]) -> dict[str, float]:
    """One `megarl train` of 3 steps: {part: seconds}, the sampler's marks and the wall to the first step's end."""
    from megarl.observe.timeline import STARTUP, load_startup, load_timeline

    cmd = [sys.executable, "-m", "megarl.cli", "train", DEMO, f"run.dir={run_dir}", "run.steps=3",
           "run.progress=false", "run.overwrite=true", *overrides]
    launch, launched_torchrun = timed_megarl(cmd, "megarl run")
    parts = startup_breakdown(run_dir, launch, launched_torchrun)
    for name, marks in load_startup(run_dir).items():
        if name.startswith("sampler"):
            parts.update({f"{name}: {e['kind'][len(STARTUP):]}": round(e["end"] - e["start"], 3) for e in marks})
    publish = next(e for e in load_timeline(run_dir)["learner0"] if e["kind"] == "publish")
    parts[FIRST_STEP] = round(publish["end"] - launch, 3)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="/tmp/megarl_startup")
    parser.add_argument("overrides", nargs="*", help="key=value for the demo config")
    args = parser.parse_args()
    runs = [run_once(Path(args.out) / f"run{i}", args.overrides) for i in range(args.repeats)]
    names = list(dict.fromkeys(name for run in runs for name in run))
    width = max(map(len, names))
    for name in names:
        values = [run[name] for run in runs if name in run]
        print(f"{name:<{width}}  {median(values):7.2f}  ({', '.join(f'{v:.2f}' for v in values)})")
    print(json.dumps({"first_step_s": median(run[FIRST_STEP] for run in runs), "repeats": args.repeats,
                      "parts": {name: median(run[name] for run in runs if name in run) for name in names}}))


if __name__ == "__main__":
    main()
