"""The run timeline: what every process was doing when, for the throughput-over-time picture.

Each process appends JSON lines to `run.dir/timeline/<role><rank>.jsonl`, stamped with wall-clock
time (`time.time()`, comparable across the processes of one node):
  * learners write spans: {"kind": "wait" | "train" | "publish", "start": t0, "end": t1}
  * samplers write decode slices: {"kind": "decode", "start": t0, "end": t1, "tokens": n}, one per
    `slice_s` of wall time in which the engine produced tokens.
  * both write, once, what they did before their first step: {"kind": "startup:<part>", "start", "end"}
    (megarl/observe/startup.py).
`load_timeline(run_dir)` reads them back for plotting (benchmarks/plot_timeline.py), without the start-up spans;
`load_startup(run_dir)` reads those (benchmarks/vs_trl.py). Records are
buffered (a sampler writes ~20 a second) and written whole (megarl/observe/jsonl.py), so a killed
process leaves complete lines.
"""
from __future__ import annotations

from pathlib import Path

from megarl.observe.jsonl import JsonlAppender, read_jsonl

STARTUP = "startup:"


class Timeline:
    def __init__(self, run_dir: str | Path, name: str, slice_s: float = 0.05):
        directory = Path(run_dir) / "timeline"
        directory.mkdir(parents=True, exist_ok=True)
        self.file = JsonlAppender(directory / f"{name}.jsonl", buffer_bytes=1 << 16)
        self.slice_s = slice_s
        self._slice_start: float | None = None
        self._slice_tokens = 0
        self._last_end = 0.0

    def span(self, kind: str, start: float, end: float) -> None:
        self.file.append({"kind": kind, "start": start, "end": end})

    def startup(self, spans: list[tuple[str, float, float]]) -> None:
        """The process's start-up parts, (part, start, end) each (megarl.observe.startup.spans())."""
        for part, start, end in spans:
            self.span(STARTUP + part, start, end)

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
            self.file.append({"kind": "decode", "start": self._slice_start, "end": self._last_end,
                              "tokens": self._slice_tokens})
        self._slice_start, self._slice_tokens = None, 0

    def close(self) -> None:
        self._flush()
        self.file.close()


def load_timeline(run_dir: str | Path) -> dict[str, list[dict]]:
    """{process name: its events}, e.g. {"learner0": [...], "sampler1": [...]}; start-up spans left out."""
    return {name: [e for e in events if not e["kind"].startswith(STARTUP)] for name, events in _read(run_dir).items()}


def load_startup(run_dir: str | Path) -> dict[str, list[dict]]:
    """{process name: its start-up spans, kind "startup:<part>", in order}."""
    return {name: [e for e in events if e["kind"].startswith(STARTUP)] for name, events in _read(run_dir).items()}


def _read(run_dir: str | Path) -> dict[str, list[dict]]:
    return {path.stem: read_jsonl(path) for path in sorted((Path(run_dir) / "timeline").glob("*.jsonl"))}
