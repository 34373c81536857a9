"""Peak resident memory of a command's processes: a thread reads each descendant's RSS high-water mark (VmHWM in
/proc/PID/status, Linux) every `interval_s` while the command runs, keeping each process's largest reading.

VmHWM only grows, so the last reading before a process exits is its peak up to then; what it adds in its last
`interval_s` is missed (the benchmarks' processes reach their peak in their first steps, long before they end).
Each process is named by `label(pid, cmdline, environ)`, e.g. its torchrun RANK mapped to a role.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable


def read_hwm_mb(pid: int) -> float | None:
    """The process's RSS high-water mark in MiB; None if it is gone or unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def children_map() -> dict[int, list[int]]:
    """parent pid -> child pids, for every process /proc shows."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(root: int, kids: dict[int, list[int]]) -> list[int]:
    """root and every process below it."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class PeakRss:
    """`with PeakRss(pid, label) as peaks:` ... then `peaks.by_label()`: {label: peak MiB}."""

    def __init__(self, root: int, label: Callable[[int, str, dict], str | None], interval_s: float = 0.5):
        self.root, self.label, self.interval_s = root, label, interval_s
        self.peaks: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        for pid in descendants(self.root, children_map()):
            hwm = read_hwm_mb(pid)
            if hwm is None:
                continue
            if pid not in self.peaks:
                name = self.label(pid, _cmdline(pid), _environ(pid))
                if name is None:
                    continue
                self.peaks[pid] = (name, hwm)
            self.peaks[pid] = (self.peaks[pid][0], max(self.peaks[pid][1], hwm))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "PeakRss":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10 * self.interval_s + 5)

    def by_label(self) -> dict[str, float]:
        """{label: peak MiB}, the largest where several processes share a label."""
        out: dict[str, float] = {}
        for name, mb in self.peaks.values():
            out[name] = round(max(out.get(name, 0.0), mb), 1)
        return dict(sorted(out.items()))
