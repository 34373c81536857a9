"""Membership epochs of replaceable samplers (fault.on_failure=replace): who receives the weights, over which group.

A sampler process is one *incarnation* of its sampler rank (0 for the one started with the run, k for its k-th
replacement; its keeper, megarl.roles.sampler_keeper, sets MEGARL_SAMPLER_INCARNATION). The learner's lead keeps
the live set (`SamplerSet`); each change starts a membership epoch e, recorded under `samplers/epoch/{e}` as the
members' (rank, incarnation) pairs, the publish index the epoch starts at and each newcomer's data position, and
its publish group is built straight over the run's store (`topology.epoch_publish_group`), so a dead member never
has to take part. A sampler's receiver follows the epochs (`EpochFollower`). Records in the store:

    samplers/join/{rank}     a ready incarnation asks to receive the weights (the incarnation)
    samplers/dead/{rank}     its keeper saw the incarnation end ({incarnation, cause})
    samplers/replace/{rank}  the learner asks the keeper to kill a hung incarnation ({incarnation, cause})
    samplers/epoch/{e}       the epoch record ({members: [[rank, incarnation], ...], first_publish, positions})

An incarnation's queue sequence numbers and heartbeat counts start at `incarnation << SHIFT`, above anything an
earlier incarnation of its rank can have used: the queue refuses a lower sequence as a replay, and the heartbeat
monitor counts only a rising count as a beat.
"""
from __future__ import annotations

import json
import os
import time
from typing import Callable

INCARNATION_ENV = "MEGARL_SAMPLER_INCARNATION"
SHIFT = 40
POLL_S = 0.05


def incarnation() -> int:
    """This process's incarnation of its sampler rank (0 outside a keeper)."""
    return int(os.environ.get(INCARNATION_ENV, "0"))


def join_key(rank: int) -> str:
    return f"samplers/join/{rank}"


def dead_key(rank: int) -> str:
    return f"samplers/dead/{rank}"


def replace_key(rank: int) -> str:
    return f"samplers/replace/{rank}"


def epoch_key(epoch: int) -> str:
    return f"samplers/epoch/{epoch}"


def read_record(store, key: str) -> dict | None:
    return json.loads(store.get(key)) if store.check([key]) else None


def lost_groups(started: float, retired: int) -> int:
    """Groups a dropped incarnation had started (its last message's count) and the learner never retired."""
    return max(0, int(started) - retired)


class SamplerDropped(RuntimeError):
    """This incarnation is no longer a member (the learner dropped it): its keeper starts another."""


class SamplerSet:
    """Learner rank 0: the live sampler incarnations, the current epoch, and what replacing them cost.

    `drop` removes a member (it died or hung) and `refresh` (before every publish) takes in the keepers'
    death records and the replacements that asked to join; a change makes the next publish start a new epoch
    (`start_epoch`: its record, then its group). Groups are accepted only from a member incarnation."""

    def __init__(self, store, ranks: list[int], num_learners: int, note: Callable[[str], None] = print):
        self.store, self.num_learners, self.note = store, num_learners, note
        self.members: dict[int, int] = {rank: 0 for rank in ranks}
        self.known: dict[int, int] = dict(self.members)  # the newest incarnation seen per rank
        self.epoch, self.changed = 0, False
        self.replaced, self.lost = 0, 0
        self.started: dict[int, float] = {}  # the member's last reported count of groups started

    def name(self, rank: int) -> str:
        return f"sampler {rank - self.num_learners} (rank {rank})"

    @property
    def alive(self) -> int:
        return len(self.members)

    def accepts(self, rank: int, stats: dict[str, float]) -> bool:
        """Is a group from this sender's current member incarnation? Also notes its started count."""
        if self.members.get(rank) != int(stats.get("incarnation", 0)):
            return False  # counted in `lost` when its incarnation was dropped (it had started it)
        self.started[rank] = stats.get("started", self.started.get(rank, 0.0))
        return True

    def drop(self, rank: int, cause: str, retired: int) -> None:
        if rank not in self.members:
            return
        incarnation = self.members.pop(rank)
        lost = lost_groups(self.started.pop(rank, 0.0), retired)
        self.lost += lost
        self.replaced += 1
        self.changed = True
        self.note(f"megarl: {self.name(rank)} {cause}: dropped from the publish set, replacement {incarnation + 1} "
                  f"starting; {lost} unfinished group{'s' if lost != 1 else ''} lost")

    def dead(self) -> list[tuple[int, str]]:
        """Members whose keeper recorded their end: (rank, cause)."""
        found = []
        for rank, incarnation in list(self.members.items()):
            record = read_record(self.store, dead_key(rank))
            if record is not None and record["incarnation"] == incarnation:
                found.append((rank, record["cause"]))
        return found

    def joins(self) -> list[tuple[int, int]]:
        """Ready replacements not yet members: (rank, incarnation)."""
        found = []
        for rank in self.known:
            raw = read_record(self.store, join_key(rank))
            if raw is not None and raw > self.known[rank] and rank not in self.members:
                found.append((rank, raw))
        return found

    def admit(self, rank: int, incarnation: int) -> None:
        self.members[rank] = self.known[rank] = incarnation
        self.started.pop(rank, None)
        self.changed = True

    def start_epoch(self, first_publish: int, positions: dict[int, dict]) -> int:
        """Record the next epoch (the current members, the publish it starts at, newcomers' positions)."""
        self.epoch += 1
        self.changed = False
        self.store.set(epoch_key(self.epoch), json.dumps({
            "members": sorted([rank, inc] for rank, inc in self.members.items()), "first_publish": first_publish,
            "positions": {str(rank): pos for rank, pos in positions.items()}}))
        return self.epoch

    def group_rank_order(self) -> list[int]:
        """Sampler ranks in publish-group order (group rank 1 + i)."""
        return sorted(self.members)

    def metrics(self) -> dict[str, float]:
        return {"samplers/alive": float(self.alive), "samplers/replaced": float(self.replaced),
                "samplers/rollouts_lost": float(self.lost)}


class EpochFollower:
    """A sampler incarnation's side: the group it receives over, moved to each new epoch that names it.

    Incarnation 0 starts in epoch 0 over the run's first publish group; a replacement starts outside any epoch
    and waits for one that names it. `make_group(epoch, group_rank, size)` builds an epoch's group (blocks until
    every member and the learner joined it)."""

    def __init__(self, store, rank: int, incarnation: int, make_group: Callable[[int, int, int], object],
                 group=None):
        self.store, self.rank, self.incarnation, self.make_group = store, rank, incarnation, make_group
        self.epoch = 0 if incarnation == 0 else -1
        self.group = group
        self.position: dict | None = None  # a newcomer's data position, from the epoch that admitted it

    def next_epoch(self) -> int | None:
        """The newest recorded epoch after the current one, or None."""
        epoch, newest = max(self.epoch, 0) + 1, None
        while self.store.check([epoch_key(epoch)]):
            newest, epoch = epoch, epoch + 1
        return newest

    def follow(self) -> int | None:
        """Move to a newer epoch if one is recorded: its first publish index, else None. SamplerDropped when it
        does not name this incarnation (after this one joined)."""
        epoch = self.next_epoch()
        if epoch is None:
            return None
        record = json.loads(self.store.get(epoch_key(epoch)))
        members = [tuple(m) for m in record["members"]]
        if (self.rank, self.incarnation) not in members:
            if self.epoch < 0:  # not admitted yet: wait for a later epoch
                return None
            raise SamplerDropped(f"sampler rank {self.rank} incarnation {self.incarnation} is not a member of "
                                 f"publish epoch {epoch}: the learner dropped it")
        self.group = None  # the previous epoch's group is left before the next one is built
        self.epoch = epoch
        self.group = self.make_group(epoch, 1 + members.index((self.rank, self.incarnation)), 1 + len(members))
        if str(self.rank) in record["positions"]:
            self.position = record["positions"][str(self.rank)]
        return record["first_publish"]

    def wait_for_epoch(self, should_stop: Callable[[], bool], timeout_s: float | None,
                       what: BaseException | None = None) -> int | None:
        """Follow until a newer epoch is joined: its first publish index. None when `should_stop`; TimeoutError
        (naming `what`, the failure that made this wait) after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            first = self.follow()
            if first is not None:
                return first
            if should_stop():
                return None
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"sampler rank {self.rank}: no new publish epoch within {timeout_s:.0f}s after a "
                                   f"failed receive ({what})")
            time.sleep(POLL_S)
