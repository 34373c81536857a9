"""JSONL files that a kill never leaves with a torn record in the middle: the run's metrics, rollouts and
timeline files.

Each `append` hands the kernel whole lines in one `os.write` on an O_APPEND descriptor, so what lands in
the file is a sequence of complete records (a process killed between two writes loses the unwritten
records, never half of one; Python's buffered file objects flush at buffer boundaries, which fall inside
lines). The rare torn tail a kill *during* a write can still leave (a short write to a full disk, a
crash of the machine) is what `read_jsonl` skips and megarl/checkpoint/resume.py trims on resume.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


class JsonlAppender:
    """Appends records to `path`; `append(records)` writes them all at once. With `buffer_bytes`, records
    are held until that many bytes are pending (or `flush`/`close`), still written whole."""

    def __init__(self, path: str | Path, buffer_bytes: int = 0):
        self.path, self.buffer_bytes = Path(path), buffer_bytes
        # 0600: rollouts hold prompts, completions and tool output, none of it for other users of the machine
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.pending: list[bytes] = []
        self.pending_bytes = 0

    def append(self, *records: dict) -> None:
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        self.pending.append(data)
        self.pending_bytes += len(data)
        if self.pending_bytes >= self.buffer_bytes:
            self.flush()

    def flush(self) -> None:
        data = b"".join(self.pending)
        self.pending, self.pending_bytes = [], 0
        view = memoryview(data)
        while view:  # a regular file takes it in one write; a short one (disk full) continues where it stopped
            view = view[os.write(self.fd, view):]

    def close(self) -> None:
        if self.fd is not None:
            self.flush()
            os.close(self.fd)
            self.fd = None


def read_jsonl(path: str | Path) -> list[dict]:
    """Every complete record of `path`; a last line cut short by a crash is left out."""
    records = []
    for line in Path(path).read_text().splitlines(keepends=True):
        try:
            records.append(json.loads(line))
        except ValueError:
            if line.endswith("\n"):  # damage inside the file is not a crash's torn tail: say so
                raise ValueError(f"{path}: line {len(records) + 1} is not JSON: {line[:80]!r}") from None
    return records
