"""Console lines of one kind printed at most every few seconds, every occurrence counted: what a listener or a
loop says about events a peer or the environment can repeat at will (dropped messages, disconnects, refusals),
so one bad peer cannot flood the console."""
from __future__ import annotations

import threading
import time

REPORT_EVERY_S = 30.0


class RateLimitedLine:
    """Console lines of one kind, at most one every `every_s`; every occurrence is counted (`count`)."""

    def __init__(self, every_s: float = REPORT_EVERY_S):
        self.every_s, self.count, self._next, self._since = every_s, 0, 0.0, 0
        self._lock = threading.Lock()

    def __call__(self, text: str) -> None:
        with self._lock:
            self.count += 1
            self._since += 1
            if time.monotonic() < self._next:
                return
            self._next, since, self._since = time.monotonic() + self.every_s, self._since, 0
        more = f" ({since - 1} more since the last such line)" if since > 1 else ""
        print(f"megarl: {text}; {self.count} so far{more}", flush=True)
