"""Liveness of sampler ranks, through the torchrun store: a hung sampler is named, not waited on forever.

A sampler whose process dies is torchrun's to detect (its agent sees the exit within its monitor
interval and stops or restarts every worker, `fault.on_failure`; under `replace`, its keeper's).
A sampler that is alive but stuck
(a wedged engine step, a reward call that ignores its timeout, a deadlocked server) exits nothing, so
the learner would only notice at `queue.timeout_s`, with no hint which rank. Each sampler therefore
bumps a counter `heartbeat/{rank}/<suffix>` from its main loop (at most every `period_s`), and the learner's
`HeartbeatMonitor` raises `SamplerHungError` naming the rank once a counter has not moved for
`timeout_s` *by the learner's own clock* (counters, not timestamps, so node clocks need not agree).

The store is open to every process that reaches it (docs/security.md#the-rendezvous-store). A counter is
signed (SignedStore) and lives under a key name derived from the run secret (`SignedStore.unlisted`), so an
outsider can neither find it to overwrite nor forge a value: a flood of forged writes lands elsewhere and
a healthy sampler still beats. Should a forged or replayed value reach the counter's key anyway, it is
counted (`HeartbeatMonitor.forged`) and ignored: only a genuine count above the last one is a beat, and a
forged value neither ends the run nor counts as silence.
"""
from __future__ import annotations

import time
from collections import Counter

from megarl.distributed.signed_store import ForgedStoreValue, SignedStore


def heartbeat_key(store: SignedStore, rank: int) -> str:
    return store.unlisted(f"heartbeat/{rank}")


class SamplerHungError(RuntimeError):
    def __init__(self, message: str, rank: int = -1):
        super().__init__(message)
        self.rank = rank  # the hung sampler's global rank


class Heartbeat:
    """Sampler side: call `beat()` from the main loop; it writes at most once per `period_s`."""

    def __init__(self, store: SignedStore, rank: int, period_s: float = 1.0, first: int = 0):
        # `first`: a replacement sampler counts on above its predecessor (megarl.distributed.membership)
        self.store, self.key, self.period_s = store, heartbeat_key(store, rank), period_s
        self.count, self.next_write = first, 0.0

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

    def __init__(self, store: SignedStore, sampler_ranks: list[int], timeout_s: float,
                 check_every_s: float = 1.0):
        self.store, self.ranks, self.timeout_s, self.check_every_s = store, list(sampler_ranks), timeout_s, check_every_s
        self.keys = {r: heartbeat_key(store, r) for r in self.ranks}
        now = time.monotonic()
        self.last_value: dict[int, int | None] = {r: None for r in self.ranks}  # the last genuine count seen
        self.last_change: dict[int, float] = {r: now for r in self.ranks}
        self.forged: Counter[int] = Counter()  # per rank: reads that held a forged or non-counter value
        self.next_check = 0.0

    def _read(self, rank: int) -> int | None:
        """The genuine count under `rank`'s key, or None (absent, or forged: counted, reported the first time)."""
        key = self.keys[rank]
        if not self.store.raw.check([key]):  # the raw check: SignedStore.check would print per key itself
            return None
        try:
            return int(self.store.get(key))
        except (ForgedStoreValue, ValueError) as exc:
            self.forged[rank] += 1
            if self.forged[rank] == 1:
                print(f"megarl: heartbeat of sampler rank {rank}: {exc}; ignored (neither a beat nor silence; "
                      f"further ones are counted, not printed)", flush=True)
            return None

    def watch(self, rank: int) -> None:
        """Watch `rank` (again) from now on: a replacement sampler that joined (fault.on_failure=replace)."""
        if rank not in self.ranks:
            self.ranks.append(rank)
        self.keys[rank] = heartbeat_key(self.store, rank)
        self.last_value[rank], self.last_change[rank] = None, time.monotonic()

    def forget(self, rank: int) -> None:
        """Stop watching `rank` (dropped: its replacement is watched once it joins)."""
        if rank in self.ranks:
            self.ranks.remove(rank)
            self.last_value.pop(rank, None)
            self.last_change.pop(rank, None)

    def observe(self) -> float:
        """Read every sampler's counter now (returns the time). `silent()` can only say how long a counter
        has stood still since it was last observed moving, so call this regularly (check() does). Only a
        genuine count above the last one seen moves it: a replayed older one does not."""
        now = time.monotonic()
        for rank in self.ranks:
            value = self._read(rank)
            if value is not None and (self.last_value[rank] is None or value > self.last_value[rank]):
                self.last_value[rank], self.last_change[rank] = value, now
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

    def _overdue(self, ranks: list[int], now: float) -> list[int]:
        """Of `ranks`, those whose counter has stood still (or not started) for more than timeout_s at `now`: the
        one rule behind check() and wait_started()."""
        return [r for r in ranks if now - self.last_change[r] > self.timeout_s]

    def wait_started(self, num_learners: int = 0, poll_s: float = 0.25) -> None:
        """Block until every watched sampler has beaten once (its engine is up and its weight receiver listens):
        a publish before that would wait on a receiver that is still loading, and a vLLM or SGLang server
        takes longer to start than one version's broadcast is given (publish.timeout_s). Raises
        SamplerHungError, naming the samplers that never started, once `timeout_s` has passed since the monitor
        was created or last watched them."""
        while True:
            now = self.observe()
            waiting = [r for r in self.ranks if self.last_value[r] is None]
            if not waiting:
                return
            late = self._overdue(waiting, now)
            if late:
                names = ", ".join(f"sampler rank {r} (sampler {r - num_learners})" for r in late)
                raise SamplerHungError(
                    f"{names} did not start its loop within fault.sampler_timeout_s={self.timeout_s:g}s (engine "
                    f"start and model load); the learner was waiting to publish its resumed weights", late[0])
            time.sleep(poll_s)

    def check(self, num_learners: int = 0) -> None:
        now = time.monotonic()
        if now < self.next_check or not self.ranks:
            return
        self.next_check = now + self.check_every_s
        self.observe()
        overdue = self._overdue(self.ranks, now)
        if overdue:
            rank = overdue[0]
            what = "has not started its loop" if self.last_value[rank] is None else "stopped beating"
            raise SamplerHungError(
                f"sampler rank {rank} (sampler {rank - num_learners}) {what}: no heartbeat for "
                f"{now - self.last_change[rank]:.0f}s (fault.sampler_timeout_s={self.timeout_s:g}); it is alive "
                f"(torchrun would have reported its exit) but stuck, e.g. in an engine step or a reward call", rank)
