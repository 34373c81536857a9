"""The data position: which prompt groups each sampler stream has retired (pure data, no torch).

Sampler r's k-th group has the id ``s{r}-g{k}`` and its prompt is a pure function of
(run.seed, r, k) (``megarl.rollout.tasks.prompt_rng``), so the prompt stream is resumable by index.
The learner retires a group when it trains it or drops it (stale, zero variance); groups finish out
of order, so the retired indices of one stream are kept as a contiguous cursor plus the few retired
indices above it.  The learner checkpoints this record; on resume each sampler issues, in increasing
order, every index its record does not hold: first those that were in flight, then fresh ones.
docs/checkpoint.md states the guarantee.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Iterator

_GROUP_ID = re.compile(r"s(\d+)-g(\d+)")


def group_id(stream: int, index: int) -> str:
    """The id of group `index` of sampler stream `stream` (the sampler's role rank)."""
    return f"s{stream}-g{index}"


def parse_group_id(gid: str) -> tuple[int, int]:
    """(stream, index) of a group id; ValueError for anything not made by `group_id`."""
    match = _GROUP_ID.fullmatch(gid)
    if match is None:
        raise ValueError(f"not a megarl group id: {gid!r} (expected s<sampler>-g<index>)")
    return int(match[1]), int(match[2])


@dataclass
class RetiredIndices:
    """A set of non-negative integers stored as: all of [0, cursor) plus `above` (each > cursor)."""

    cursor: int = 0
    above: set[int] = field(default_factory=set)

    def add(self, index: int) -> None:
        if index < 0:
            raise ValueError(f"group index must be >= 0, got {index}")
        if index < self.cursor:
            return
        self.above.add(index)
        while self.cursor in self.above:  # close the gap the new index filled
            self.above.remove(self.cursor)
            self.cursor += 1

    def __contains__(self, index: int) -> bool:
        return index < self.cursor or index in self.above

    def __len__(self) -> int:
        return self.cursor + len(self.above)

    def unretired(self) -> Iterator[int]:
        """Every index not in the set, in increasing order (endless)."""
        return (k for k in itertools.count(self.cursor) if k not in self.above)

    def to_dict(self) -> dict:
        return {"cursor": self.cursor, "above": sorted(self.above)}

    @classmethod
    def from_dict(cls, d: dict) -> "RetiredIndices":
        cursor, above = int(d["cursor"]), {int(k) for k in d["above"]}
        if cursor < 0 or any(k <= cursor for k in above):
            raise ValueError(f"malformed retired-index record {d!r}: need cursor >= 0 and every 'above' > cursor")
        return cls(cursor, above)


@dataclass
class DataPosition:
    """Retired group indices per sampler stream; kept by the learner's intake, saved in checkpoints."""

    streams: dict[int, RetiredIndices] = field(default_factory=dict)

    def retire(self, gid: str) -> None:
        stream, index = parse_group_id(gid)
        self.streams.setdefault(stream, RetiredIndices()).add(index)

    def stream(self, stream: int) -> RetiredIndices:
        """Stream `stream`'s record (empty for a stream never seen: a new sampler starts at index 0)."""
        return self.streams.get(stream, RetiredIndices())

    def to_dict(self) -> dict:
        return {str(s): r.to_dict() for s, r in sorted(self.streams.items())}

    @classmethod
    def from_dict(cls, d: dict) -> "DataPosition":
        return cls({int(s): RetiredIndices.from_dict(r) for s, r in d.items()})
