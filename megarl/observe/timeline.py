"""The run timeline: what every process was doing when, for the throughput-over-time picture.

Each process appends JSON lines to `run.dir/timeline/<role><rank>.jsonl`, stamped with wall-clock
time (`time.time()`, comparable across the processes of one node):
  * learners write spans: {"kind": "wait" | "train" | "publish", "start": t0, "end": t1}
  * samplers write decode slices: {"kind": "decode", "start": t0, "end": t1, "tokens": n}, one per
    `slice_s` of wall time in which the engine produced tokens.
`load_timeline(run_dir)` reads them back for plotting (benchmarks/plot_timeline.py).
"""
from __future__ import annotations

import json
from pathlib import Path


class Timeline:
    def __init__(self, run_dir: str | Path, name: str, slice_s: float = 0.05):
        directory = Path(run_dir) / "timeline"
        directory.mkdir(parents=True, exist_ok=True)
        self.file = open(directory / f"{name}.jsonl", "a", buffering=1 << 16)
        self.slice_s = slice_s
        self._slice_start: float | None = None
        self._slice_tokens = 0
        self._last_end = 0.0

    def span(self, kind: str, start: float, end: float) -> None:
        self.file.write(json.dumps({"kind": kind, "start": start, "end": end}) + "\n")

    def tokens(self, n: int, start: float, end: float) -> None:
        """Count the tokens of one engine step (wall-clock start/end) into the current slice. A slice
        closes once it covers `slice_s`, or at the last step before an idle gap, so idle time is
        never smeared into a slice."""
        if self._slice_start is not None and start - self._last_end > self.slice_s / 2:
            self._flush()
        if self._slice_start is None:
            self._slice_start = start
        self._slice_tokens += n
        self._last_end = end
        if end - self._slice_start >= self.slice_s:
            self._flush()

    def _flush(self) -> None:
        if self._slice_start is not None and self._slice_tokens:
            self.file.write(json.dumps({"kind": "decode", "start": self._slice_start, "end": self._last_end,
                                        "tokens": self._slice_tokens}) + "\n")
        self._slice_start, self._slice_tokens = None, 0

    def close(self) -> None:
        self._flush()
        self.file.close()


def load_timeline(run_dir: str | Path) -> dict[str, list[dict]]:
    """{process name: its events}, e.g. {"learner0": [...], "sampler1": [...]}."""
    return {path.stem: [json.loads(line) for line in path.read_text().splitlines()]
            for path in sorted((Path(run_dir) / "timeline").glob("*.jsonl"))}
