"""Data sources in the metrics: a sample's source (Sample.source: its dataset row's task.source_field) becomes a
metric name; the learner reports each source's reward per step, an evaluation each source's scores per set."""
from __future__ import annotations

import re

from megarl.protocols import Sample


class SourceNames:
    """The metric name of each data source (reward/source/<name>, eval/<set>/source/<name>/...): the source made
    tag-safe. The first MAX_SOURCES distinct sources keep theirs; later ones are reported together as "other" (a
    dataset whose rows each name their own source must not add a metric per row)."""

    MAX_SOURCES = 32

    def __init__(self):
        self.names: dict[str, str] = {}

    def __call__(self, source: str) -> str:
        if source not in self.names:
            tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", source)[:64] or "_"
            self.names[source] = tag if len(self.names) < self.MAX_SOURCES else "other"
        return self.names[source]


def source_rewards(samples: list[Sample], name_of: SourceNames) -> dict[str, float]:
    """reward/source/<name>: the mean reward of the batch's samples of each data source (none without sources)."""
    by_source: dict[str, list[float]] = {}
    for s in samples:
        if s.source:
            by_source.setdefault(name_of(s.source), []).append(s.reward)
    return {f"reward/source/{name}": sum(rewards) / len(rewards) for name, rewards in sorted(by_source.items())}
