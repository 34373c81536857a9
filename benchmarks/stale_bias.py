"""Does dropping stale groups bias the reward megarl reports? The time to the reward target, again, with each
training window reweighted to the prompts the sampler draws.

    python benchmarks/stale_bias.py RUN_DIR [RUN_DIR ...]      # vs_trl.py outputs (OUT or OUT/roundK)

A group whose oldest token is more than `max_lag` versions old is dropped at the learner's intake
(`algo.stale=drop_group`, the default). Long completions take longest, so the groups dropped are mostly long-prompt
ones (the count task: the prompt sets the run's length), and the trained batches hold fewer hard prompts than the
sampler drew: their mean reward, which `vs_trl.py` times, can run ahead of the policy's. Here each rolling 10-step
window's reward is taken per prompt-length bucket and weighted by the buckets' shares in the prompt stream itself
(200,000 prompts drawn as the sampler draws them, from the runs' own task.length_mean and task.max_length), and
the step and training time at which that reaches the target are set beside the plain ones, with TRL's time (it
trains on every prompt it draws) over each. Also the share of groups dropped as stale and the mean prompt length
trained against the stream's. Ends with one JSON line.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megarl.rollout.tasks import COUNT_ALPHABET, CountTask  # noqa: E402

EDGES = (4, 8, 12, 19, 10**9)  # prompt-length buckets: 1-4, 5-8, 9-12, 13-19, 20+ letters
WINDOW, TARGET = 10, 0.9


def bucket(length: int) -> int:
    return next(i for i, edge in enumerate(EDGES) if length <= edge)


def run_length(prompt: str) -> int:
    """The answer's letters of a count prompt "d-k=" (megarl.rollout.tasks.CountTask.make_prompt)."""
    return COUNT_ALPHABET.index(prompt[2]) - COUNT_ALPHABET.index(prompt[0]) + 1


def run_task(run: Path) -> CountTask:
    """The count task the run drew its prompts from (its saved config's task.length_mean / max_length)."""
    task = yaml.safe_load((run / "megarl_pipeline" / "config.yaml").read_text())["task"]
    return CountTask(length_mean=task["length_mean"], max_length=task["max_length"])


def stream_shares(task: CountTask, draws: int = 200_000) -> dict[int, float]:
    counts = collections.Counter(bucket(p.meta["length"]) for p in task.sample_prompts(random.Random(0), draws))
    return {b: c / draws for b, c in counts.items()}


def first_at_target(values: list[float]) -> int | None:
    return next((i for i, v in enumerate(values) if v >= TARGET), None)


def analyse(run: Path, shares: dict[int, float]) -> dict:
    by_step: dict[int, list[tuple[int, float]]] = collections.defaultdict(list)
    groups = set()
    for line in (run / "megarl_pipeline" / "rollouts.jsonl").read_text().splitlines():
        r = json.loads(line)
        by_step[r["trained_at_step"]].append((bucket(run_length(r["prompt"])), r["reward"]))
        groups.add((r["group_id"], run_length(r["prompt"])))
    results = json.loads((run / "results.json").read_text())
    train_s = results["megarl pipeline"]["curve"]["train_s"]
    steps = sorted(by_step)
    plain, reweighted = [], []
    for i in range(WINDOW - 1, len(steps)):
        window = [x for s in steps[i - WINDOW + 1:i + 1] for x in by_step[s]]
        plain.append(statistics.mean(r for _, r in window))
        per = collections.defaultdict(list)
        for b, r in window:
            per[b].append(r)
        reweighted.append(sum(share * (statistics.mean(per[b]) if per[b] else 0.0) for b, share in shares.items()))
    metrics = [json.loads(line) for line in (run / "megarl_pipeline" / "metrics.jsonl").read_text().splitlines()]
    stale = max((m.get("dropped/stale_groups_total", 0) for m in metrics), default=0)
    out = {"run": str(run), "stale_dropped_frac": round(stale / (stale + len(groups)), 3),
           "trained_prompt_letters_mean": round(statistics.mean(n for _, n in groups), 2)}
    trl = results.get("TRL GRPOTrainer", {}).get("summary", {}).get("reached", {}).get(str(TARGET))
    for name, curve in (("plain", plain), ("reweighted", reweighted)):
        i = first_at_target(curve)
        if i is None:
            out[name] = None
            continue
        step = i + WINDOW - 1
        out[name] = {"step": step + 1, "train_s": round(train_s[step], 2)}
        if trl:
            out[name]["ratio_vs_trl"] = round(trl["train_s"] / train_s[step], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="vs_trl.py output directories (each with results.json)")
    args = parser.parse_args()
    tasks = {run: run_task(run) for run in args.runs}
    if len(set(tasks.values())) > 1:
        parser.error(f"the runs drew from different prompt streams: {sorted(set(map(str, tasks.values())))}")
    task = tasks[args.runs[0]]
    shares = stream_shares(task)
    stream_mean = statistics.mean(p.meta["length"] for p in task.sample_prompts(random.Random(1), 50_000))
    print(f"prompt stream ({task}): letters mean {stream_mean:.2f}; bucket shares "
          + ", ".join(f"<= {EDGES[b] if EDGES[b] < 10**9 else 'inf'}: {s:.3f}" for b, s in sorted(shares.items())))
    rows = [analyse(run, shares) for run in args.runs]
    for row in rows:
        print(json.dumps(row))
    ratios = {name: [r[name]["ratio_vs_trl"] for r in rows if r.get(name) and "ratio_vs_trl" in r[name]]
              for name in ("plain", "reweighted")}
    print(json.dumps({"stream_prompt_letters_mean": round(stream_mean, 2),
                      "stale_dropped_frac_median": statistics.median(r["stale_dropped_frac"] for r in rows),
                      **{f"time_to_target_ratio_vs_trl_{k}": round(statistics.median(v), 3)
                         for k, v in ratios.items() if v},
                      "runs": rows}))


if __name__ == "__main__":
    main()
