"""What DAPO's soft overlong punishment (`algo.advantage.overlong_buffer`) does to a run whose completions have a
long tail: the arithmetic demo (`configs/arithmetic.yaml`: a geometric run of "thinking" filler, then the answer),
at a tight length limit, once without and once with the shaping, same seed and budget. Prints, per arm, the
reward (the task's: the penalty is not in it), the completion length and the share of samples cut at the length
limit over the first and last 10% of steps, and the share the shaping penalised.

    python benchmarks/overlong.py [--steps N] [--out runs/overlong] [--config configs/arithmetic.yaml] [key=value ...]

Ends with one JSON line {arm: {reward, completion_len, truncated_frac} over the last 10% of steps}. About a minute
per arm for 150 steps on 2 CPU cores.
"""
from __future__ import annotations

import json
from pathlib import Path

from demo_arms import run_arms

# A limit that bites: at 16 tokens ~20% of the warm-started model's completions are cut before their answer (the
# config's 48 cuts ~1%, and RL removes the filler before the shaping has anything to do).
LIMIT, BUFFER = 16, 8
ARMS = {
    "plain": [f"sampling.max_new_tokens={LIMIT}"],
    f"overlong_buffer_{BUFFER}": [f"sampling.max_new_tokens={LIMIT}", f"algo.advantage.overlong_buffer={BUFFER}",
                                  "algo.advantage.overlong_penalty=1.0"],
}


def tenths(rows: list[dict], value) -> tuple[float, float]:
    """Mean of value(row) over the first and the last 10% of the steps."""
    k = max(1, len(rows) // 10)
    mean = lambda seg: sum(value(r) for r in seg) / len(seg)
    return mean(rows[:k]), mean(rows[-k:])


def summarize(run_dir: Path) -> dict:
    rows = [r for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
            if "kind" not in r]  # eval records: docs/eval.md
    return {"steps": len(rows),
            "reward": tenths(rows, lambda r: r["reward_mean"]),
            "completion_len": tenths(rows, lambda r: r["completion_len_mean"]),
            "truncated_frac": tenths(rows, lambda r: r["samples/truncated"] / r["samples/total"]),
            "penalised_frac": sum(r.get("samples/overlong_penalised", 0.0) for r in rows)
            / sum(r["samples/total"] for r in rows)}


def report(name: str, extra: list, s: dict) -> None:
    line = "  ".join(f"{key} {s[key][0]:.3f} -> {s[key][1]:.3f}" for key in ("reward", "completion_len",
                                                                           "truncated_frac"))
    print(f"{name:20s} {s['steps']} steps  {line}  penalised {s['penalised_frac']:.1%}  ({' '.join(extra)})",
          flush=True)


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    results = run_arms(ARMS, summarize, report, default_out="runs/overlong", argv=["--steps", "150", *argv],
                       default_config="configs/arithmetic.yaml")  # a later --steps on the command line wins
    print(json.dumps({name: None if s is None else {key: round(s[key][1], 4) for key in
                                                     ("reward", "completion_len", "truncated_frac")}
                      for name, s in results.items()}))


if __name__ == "__main__":
    main()
