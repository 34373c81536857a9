"""Where a run's numbers go: metrics.jsonl + TensorBoard per learner step, rollouts.jsonl per trained
sample (the console a person watches: megarl/observe/console.py).

metrics.jsonl holds one record per learner step and, with eval.sets, one record per evaluation, marked
`"kind": "eval"` (train records have no kind): `train_records` / `eval_records` split what a reader loads."""
from __future__ import annotations

import math
from pathlib import Path

from megarl.observe.jsonl import JsonlAppender
from megarl.protocols import Sample


class MetricsSink:
    def __init__(self, run_dir: str | Path, tensorboard: bool):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.file = JsonlAppender(self.run_dir / "metrics.jsonl")  # one whole line per step
        self.writer = None
        if tensorboard:
            from tensorboard.compat.proto.summary_pb2 import Summary
            from torch.utils.tensorboard.writer import FileWriter

            self.writer, self.summary = FileWriter(str(self.run_dir / "tensorboard")), Summary

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
        self.file.append(record)
        if self.writer is not None:
            # All of a step's scalars in one event (SummaryWriter.add_scalar writes one event each: ~60 per step
            # cost the learner ~10 ms of its step loop; this costs < 1 ms). TensorBoard reads both the same.
            self.writer.add_summary(self.summary(value=[
                self.summary.Value(tag=key, simple_value=float(value)) for key, value in metrics.items()
                if isinstance(value, (int, float)) and math.isfinite(value)]), step)

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()


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
            "spans": [list(span) for span in s.spans()]} for s in samples))

    def close(self) -> None:
        self.file.close()
