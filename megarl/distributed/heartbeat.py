"""Liveness of sampler ranks, through the torchrun store: a hung sampler is named, not waited on forever.

A sampler whose process dies is torchrun's to detect (its agent sees the exit within its monitor
interval and stops or restarts every worker, `fault.on_failure`). A sampler that is alive but stuck
(a wedged engine step, a reward call that ignores its timeout, a deadlocked server) exits nothing, so
the learner would only notice at `queue.timeout_s`, with no hint which rank. Each sampler therefore
bumps a counter `heartbeat/{rank}` from its main loop (at most every `period_s`), and the learner's
`HeartbeatMonitor` raises `SamplerHungError` naming the rank once a counter has not moved for
`timeout_s` *by the learner's own clock* (counters, not timestamps, so node clocks need not agree).
"""
from __future__ import annotations

import time


def heartbeat_key(rank: int) -> str:
    return f"heartbeat/{rank}"


class SamplerHungError(RuntimeError):
    pass


class Heartbeat:
    """Sampler side: call `beat()` from the main loop; it writes at most once per `period_s`."""

    def __init__(self, store, rank: int, period_s: float = 1.0):
        self.store, self.key, self.period_s = store, heartbeat_key(rank), period_s
        self.count, self.next_write = 0, 0.0

    def beat(self) -> None:
        now = time.monotonic()
        if now >= self.next_write:
            self.count += 1
            self.store.set(self.key, str(self.count))
            self.next_write = now + self.period_s


class HeartbeatMonitor:
    """Learner side: `check()` raises SamplerHungError for a sampler whose counter stopped moving.

    A sampler that has not beaten yet (still loading its model) gets `timeout_s` from the monitor's
    creation, like any other silence."""

    def __init__(self, store, sampler_ranks: list[int], timeout_s: float, check_every_s: float = 1.0):
        self.store, self.ranks, self.timeout_s, self.check_every_s = store, list(sampler_ranks), timeout_s, check_every_s
        now = time.monotonic()
        self.last_value: dict[int, bytes | None] = {r: None for r in self.ranks}
        self.last_change: dict[int, float] = {r: now for r in self.ranks}
        self.next_check = 0.0

    def observe(self) -> float:
        """Read every sampler's counter now (returns the time). `silent()` can only say how long a counter
        has stood still since it was last observed moving, so call this regularly (check() does)."""
        now = time.monotonic()
        present = [r for r in self.ranks if self.store.check([heartbeat_key(r)])]
        values = dict(zip(present, self.store.multi_get([heartbeat_key(r) for r in present]))) if present else {}
        for rank in self.ranks:
            if values.get(rank) != self.last_value[rank]:
                self.last_value[rank], self.last_change[rank] = values.get(rank), now
        return now

    def silent(self, num_learners: int = 0, min_s: float = 3.0) -> str:
        """Which samplers are silent, for the error message of a failure that just happened: those quiet
        for at least `min_s` now or, when none is, those whose counter does not move in the next `min_s`
        (a peer that died a moment before the failure, e.g. the one a broadcast lost, is named, not
        reported as current)."""
        now = self.observe()
        quiet = [f"sampler rank {r} (sampler {r - num_learners}) has sent no heartbeat for {now - t:.0f}s"
                 for r, t in self.last_change.items() if now - t >= min_s]
        if quiet:
            return "; ".join(quiet)
        start, before = now, dict(self.last_value)
        while now - start < min_s:
            time.sleep(min(0.25, min_s))
            now = self.observe()
        quiet = [f"sampler rank {r} (sampler {r - num_learners}) has sent no heartbeat since (watched {min_s:g}s): "
                 f"it died or hung" for r in self.ranks if self.last_value[r] == before[r]]
        return "; ".join(quiet) if quiet else f"every sampler's heartbeat kept moving for {min_s:g}s after the failure"

    def check(self, num_learners: int = 0) -> None:
        now = time.monotonic()
        if now < self.next_check or not self.ranks:
            return
        self.next_check = now + self.check_every_s
        self.observe()
        for rank in self.ranks:
            value = self.last_value[rank]
            if now - self.last_change[rank] > self.timeout_s:
                what = "has not started its loop" if value is None else "stopped beating"
                raise SamplerHungError(
                    f"sampler rank {rank} (sampler {rank - num_learners}) {what}: no heartbeat for "
                    f"{now - self.last_change[rank]:.0f}s (fault.sampler_timeout_s={self.timeout_s:g}); it is alive "
                    f"(torchrun would have reported its exit) but stuck, e.g. in an engine step or a reward call")
