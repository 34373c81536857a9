"""Start-up marks: when each part of this process's start-up ended, for the start-up breakdown.

A run spends seconds before its first step (torchrun, imports, the model, process groups); to say which part
costs what, the worker and the roles call `mark(part)` as each part ends, and the role writes the marks to its
timeline as spans `startup:<part>` (from the previous mark, the first from the process's creation as the kernel
recorded it), read back by benchmarks/vs_trl.py. Process-wide on purpose: the marks are set in several modules
of one process's start-up and read once.
"""
from __future__ import annotations

import os
import time

_marks: list[tuple[str, float]] = []


def process_start_time() -> float:
    """The wall-clock time (time.time()) this process was created, from /proc (Linux; the import time elsewhere)."""
    try:  # field 22 (after the ")" that ends the command name): clock ticks after boot, on CLOCK_BOOTTIME
        with open("/proc/self/stat") as fh:
            started_after_boot = int(fh.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started_after_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


_IMPORTED = time.time()


def mark(part: str) -> None:
    """`part` of the start-up ends now."""
    _marks.append((part, time.time()))


def spans() -> list[tuple[str, float, float]]:
    """(part, start, end) of every mark so far, each starting where the previous one ended."""
    out, start = [], process_start_time()
    for part, end in _marks:
        out.append((part, start, end))
        start = end
    return out
