"""Where a run's numbers go: metrics.jsonl + TensorBoard per learner step, rollouts.jsonl per trained
sample, and one console progress line."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from megarl.protocols import Sample


class MetricsSink:
    def __init__(self, run_dir: str | Path, tensorboard: bool):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()


def _finite_or_none(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


class RolloutSink:
    def __init__(self, run_dir: str | Path):
        self.file = open(Path(run_dir) / "rollouts.jsonl", "a", buffering=1 << 16)

    def log(self, samples: list[Sample], trained_at_step: int) -> None:
        for s in samples:
            self.file.write(json.dumps({
                "trained_at_step": trained_at_step, "group_id": s.group_id, "prompt": s.prompt,
                "completion": s.completion, "prompt_ids": s.prompt_ids, "token_ids": s.token_ids,
                "behaviour_logprobs": s.logprobs, "versions": s.versions, "reward": s.reward,
                "finish_reason": s.finish_reason, "sampler_rank": s.sampler_rank,
                "reward_error": s.reward_error}) + "\n")

    def close(self) -> None:
        self.file.close()


class ProgressLine:
    """One self-overwriting console line on a terminal, a plain line per step elsewhere (logs, CI)."""

    def __init__(self, total_steps: int, enabled: bool):
        self.total, self.enabled = total_steps, enabled
        self.tty = sys.stdout.isatty()
        self.start = time.monotonic()

    def update(self, step: int, m: dict[str, float]) -> None:
        if not self.enabled:
            return
        line = (f"step {step}/{self.total}  reward {m.get('reward_mean', float('nan')):.3f}  "
                f"lag {m.get('lag_mean', float('nan')):.2f}/{m.get('lag_max', 0):.0f}  "
                f"loss {m.get('loss', float('nan')):+.4f}  tok/s {m.get('tokens_per_s', 0):.0f}  "
                f"stale {m.get('dropped/stale_groups_total', 0):.0f}  {time.monotonic() - self.start:.0f}s")
        if self.tty:
            sys.stdout.write("\r" + line.ljust(100) + ("\n" if step == self.total else ""))
        else:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()
