"""Where a run's numbers go: metrics.jsonl and the run trackers (observe.trackers: TensorBoard, wandb, MLflow;
megarl/observe/trackers.py) per learner step, rollouts.jsonl per trained sample (the console a person watches:
megarl/observe/console.py).

metrics.jsonl holds one record per learner step and, with eval.sets, one record per evaluation, marked
`"kind": "eval"` (train records have no kind): `train_records` / `eval_records` split what a reader loads."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from megarl.observe.jsonl import JsonlAppender
from megarl.observe.trackers import Tracker, scalars
from megarl.protocols import Sample


class MetricsSink:
    """metrics.jsonl and `trackers` (megarl.observe.trackers.open_trackers): each record to all of them."""

    def __init__(self, run_dir: str | Path, trackers: Sequence[Tracker] = ()):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.file = JsonlAppender(self.run_dir / "metrics.jsonl")  # one whole line per step
        self.trackers = list(trackers)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
        self.file.append(record)
        if self.trackers:
            numbers = scalars(metrics)
            for tracker in self.trackers:
                tracker.log(step, numbers)

    def close(self) -> None:
        """metrics.jsonl closed, then every tracker (each waits for what it has queued); a tracker that does not
        finish in time is raised once all are closed."""
        self.file.close()
        late = []
        for tracker in self.trackers:
            try:
                tracker.close()
            except TimeoutError as exc:
                late.append(exc)
        if late:
            raise late[0]


def train_records(records: list[dict]) -> list[dict]:
    """The per-step records of a metrics.jsonl (evaluation records left out)."""
    return [r for r in records if "kind" not in r]


def eval_records(records: list[dict]) -> list[dict]:
    """The evaluation records of a metrics.jsonl (megarl/eval/: eval_version, step, eval/<set>/<metric>)."""
    return [r for r in records if r.get("kind") == "eval"]


def _finite_or_none(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


class RolloutSink:
    def __init__(self, run_dir: str | Path):
        self.file = JsonlAppender(Path(run_dir) / "rollouts.jsonl")

    def log(self, samples: list[Sample], trained_at_step: int) -> None:
        """One write per step: after a kill the file holds whole steps, never part of one's samples."""
        self.file.append(*({
            "trained_at_step": trained_at_step, "group_id": s.group_id, "prompt": s.prompt,
            "completion": s.completion, "prompt_ids": s.prompt_ids, "token_ids": s.token_ids,
            "behaviour_logprobs": s.logprobs, "versions": s.versions, "reward": s.reward,
            "finish_reason": s.finish_reason, "sampler_rank": s.sampler_rank,
            "reward_error": s.reward_error, "turns": s.turns, "source": s.source,
            "spans": [list(span) for span in s.spans()],
            **({} if s.reward_parts is None else {"reward_parts": json.loads(s.reward_parts)})} for s in samples))

    def close(self) -> None:
        self.file.close()
