"""What a person watching a run sees: one progress line per learner step, notes, and a closing summary.

On a terminal the progress line overwrites itself ("\\r"); anywhere else (logs, CI, a pipe) every
step is a plain line. The line carries the step, reward, the run's share of trained rollouts that
hold tokens of two or more policy versions (what Pipeline RL's in-flight updates produce), the
token lag, throughput and an ETA, and -- only on steps where some rewards failed -- the share of
the batch whose reward raised. `note(text)` prints a message (a checkpoint, an export) on its own
line: on a terminal it clears the progress line first, so the message is never glued onto it, and
redraws the line below. `close()` prints the summary of a finished run: reward first -> last 10% of
steps, the multi-version shares, versions per rollout, where the outputs are and how to draw them.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

WIDTH = 110  # the progress line is padded to this, so a shorter line fully covers a longer one


def tenth_means(values: list[float]) -> tuple[float, float]:
    """Mean of the first and of the last 10% of `values` (at least one value each)."""
    k = max(1, len(values) // 10)
    return sum(values[:k]) / k, sum(values[-k:]) / k


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


class Console:
    """The lead learner's console: `update` once per step, `note` for messages, `close` at the end."""

    def __init__(self, total_steps: int, enabled: bool, run_dir: str | Path, stream=None):
        self.total, self.enabled, self.run_dir = total_steps, enabled, Path(run_dir)
        self.stream = sys.stdout if stream is None else stream
        self.tty = self.stream.isatty()
        self.rewards: list[float] = []
        self.version_counts: list[int] = []  # distinct policy versions in each trained rollout
        self.first_update: tuple[float, int] | None = None  # (time, step) of the first step seen
        self.line = ""
        self.last_step = 0
        self.router: dict[str, list[float]] = {}  # MoE: router agreement metrics of every step, by name

    def update(self, step: int, metrics: dict[str, float], version_counts: list[int]) -> None:
        """Step `step` (1-based) is trained; `version_counts`: distinct versions of each of its rollouts."""
        now = time.monotonic()
        self.rewards.append(metrics.get("reward_mean", float("nan")))
        self.version_counts.extend(version_counts)
        self.last_step = step
        for key, value in metrics.items():
            if key.startswith("router/") or key.endswith("/router_agreement"):
                self.router.setdefault(key, []).append(value)
        if self.first_update is None:
            self.first_update = (now, step)
        if not self.enabled:
            return
        start, first = self.first_update
        eta = (f"eta {format_duration((now - start) / (step - first) * (self.total - step))}"
               if step > first else "eta --")
        line = (f"step {step}/{self.total}  reward {metrics.get('reward_mean', float('nan')):.3f}  "
                f"multi-version {self.share(2):.0%}  lag {metrics.get('lag_mean', float('nan')):.1f}/"
                f"{metrics.get('lag_max', 0):.0f}  tok/s {metrics.get('tokens_per_s', 0):.0f}  "
                f"stale {metrics.get('dropped/stale_groups_total', 0):.0f}  {eta}")
        errors = metrics.get("reward_errors", 0)
        if errors and version_counts:
            line += f"  reward errors {errors / len(version_counts):.0%}"
        self.line = line
        self._draw(end=step == self.total)

    def note(self, text: str) -> None:
        """A message on its own line; on a terminal the progress line is cleared first and redrawn after."""
        if self.tty and self.line:
            self.stream.write("\r" + " " * WIDTH + "\r")
        self.stream.write(text + "\n")
        if self.tty and self.line and self.last_step != self.total:
            self._draw(end=False)
        self.stream.flush()

    def share(self, min_versions: int) -> float:
        """Share of the rollouts trained so far that hold tokens of at least `min_versions` versions."""
        if not self.version_counts:
            return 0.0
        return sum(n >= min_versions for n in self.version_counts) / len(self.version_counts)

    def summary(self) -> str:
        first, last = tenth_means(self.rewards)
        n = len(self.version_counts)
        return "\n".join([
            f"megarl: done, {len(self.rewards)} steps. reward {first:.3f} -> {last:.3f} "
            f"(mean of the first -> last 10% of steps)",
            f"megarl: {n} rollouts trained; {self.share(2):.1%} hold tokens of >= 2 policy versions, "
            f"{self.share(3):.1%} of >= 3; {sum(self.version_counts) / max(1, n):.2f} versions per rollout",
            *self._router_summary(),
            f"megarl: outputs in {self.run_dir}/ (metrics.jsonl, rollouts.jsonl, tensorboard/, timeline/)",
            f"megarl: draw them: python benchmarks/plot_rollouts.py {self.run_dir}   (rollouts coloured by version)",
            f"megarl:            python benchmarks/plot_timeline.py {self.run_dir}   (generated tokens/s over time)",
        ])

    def _router_summary(self) -> list[str]:
        """MoE runs: how often the learner's router chose the sampler's experts (mean over steps)."""
        if "router/agreement" not in self.router:
            return []
        mean = {k: sum(v) / len(v) for k, v in self.router.items()}
        by_lag = ", ".join(f"{k.split('/')[0]} {v:.1%}" for k, v in sorted(mean.items()) if k.endswith("/router_agreement"))
        return [f"megarl: router agreement sampler vs learner {mean['router/agreement']:.1%} of routing decisions "
                f"({by_lag}); {mean.get('router/token_diff_frac', 0.0):.1%} of trained tokens routed differently in "
                f"some layer (with routing replay: what the learner's router would have chosen)"]

    def close(self) -> None:
        """The summary, once the run reached its last step (a failed run ends with its error instead)."""
        if self.enabled and self.rewards and self.last_step == self.total:
            self.note(self.summary())

    def _draw(self, end: bool) -> None:
        if self.tty:
            self.stream.write("\r" + self.line.ljust(WIDTH) + ("\n" if end else ""))
        else:
            self.stream.write(self.line + "\n")
        self.stream.flush()
