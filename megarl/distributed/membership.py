"""Membership epochs of replaceable samplers (fault.on_failure=replace): who receives the weights, over which group.

A sampler process is one *incarnation* of its sampler rank (0 for the one started with the run, k for its k-th
replacement; its keeper, megarl.roles.sampler_keeper, sets MEGARL_SAMPLER_INCARNATION). An engine spanning several
ranks (sampler.tp > 1) is one member, named by its lead's rank: all its ranks are replaced together, as the same
incarnation. The learner's lead keeps
the live set (`SamplerSet`); each change starts a membership epoch e, recorded under `samplers/epoch/{e}` as the
members' (rank, incarnation) pairs, the publish index the epoch starts at and each newcomer's data position, and
its publish group is built straight over the run's store (`topology.epoch_publish_group`), so a dead member never
has to take part. A sampler's receiver follows the epochs (`EpochFollower`). Records in the store:

    samplers/join/{rank}     a ready incarnation asks to receive the weights (the incarnation)
    samplers/dead/{rank}     its keeper saw the incarnation end ({incarnation, cause, code}); a TP engine's follower
                             rank's record is for its lead's keeper, whose record is the engine's end
    samplers/replace/{rank}  the learner asks the keeper to kill a hung incarnation ({incarnation, cause})
    samplers/served/{rank}   the incarnation sent its first group (the incarnation): one that fails with an error
                             before that is not replaced (a start-up error repeats; megarl.roles.sampler_keeper)
    samplers/epoch/{e}       the epoch record ({members: [[rank, incarnation], ...], first_publish, positions})
    samplers/added/{n}       `megarl samplers add` started the run's n-th added sampler rank ({rank}); its
                             incarnations count from 1, so each joins as a replacement does
    samplers/remove/{rank}   `megarl samplers remove` asks the learner to drain the sampler ({request})
    samplers/removed/{rank}  the learner's answer ({request, incarnation, lost} or {request, refused}): with an
                             incarnation, its keeper kills that incarnation and starts none
    samplers/ready/{rank}/{incarnation}  a TP follower rank's receiver is following the epochs: its engine's lead
                             asks to join only once every rank of the engine is ready (engine_ready_key)
    samplers/sync_extra/{rank}  algo.mode=sync: the groups of a version the learner asks of the incarnation beyond
                             its share ({version, incarnation, groups}; SyncShares)

An incarnation's queue sequence numbers and heartbeat counts start at `incarnation << SHIFT`, above anything an
earlier incarnation of its rank can have used: the queue refuses a lower sequence as a replay, and the heartbeat
monitor counts only a rising count as a beat.
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import Callable

INCARNATION_ENV = "MEGARL_SAMPLER_INCARNATION"
# Set for a sampler its keeper starts in a session of its own (`megarl samplers add`): it starts with stop signals
# ignored, which megarl.roles.worker leaves so; its keeper turns a stop signal into its removal (sampler_keeper).
SIGNALS_TO_KEEPER_ENV = "MEGARL_SAMPLER_SIGNALS_TO_KEEPER"
SHIFT = 40
POLL_S = 0.05
MEMBERSHIP_ATTEMPTS = 3  # epochs the learner tries, to form a group or to publish over it, before the run stops


def rejoin_timeout_s(cfg) -> float:
    """How long a member waits for the next epoch after a failed receive or epoch (EpochFollower): the learner's
    wait for groups before its next publish (queue.timeout_s), its watch for the member that is gone
    (fault.sampler_timeout_s at most) and its attempts to form a group and publish over it (MEMBERSHIP_ATTEMPTS
    x (2 + 1) x publish.timeout_s). `cfg`: the run's megarl.config.schema.Config."""
    return cfg.queue.timeout_s + cfg.fault.sampler_timeout_s + MEMBERSHIP_ATTEMPTS * 3 * cfg.publish.timeout_s


def incarnation() -> int:
    """This process's incarnation of its sampler rank (0 outside a keeper)."""
    return int(os.environ.get(INCARNATION_ENV, "0"))


def join_key(rank: int) -> str:
    return f"samplers/join/{rank}"


def dead_key(rank: int) -> str:
    return f"samplers/dead/{rank}"


def replace_key(rank: int) -> str:
    return f"samplers/replace/{rank}"


def served_key(rank: int) -> str:
    return f"samplers/served/{rank}"


def engine_ready_key(rank: int, incarnation: int) -> str:
    return f"samplers/ready/{rank}/{incarnation}"


def epoch_key(epoch: int) -> str:
    return f"samplers/epoch/{epoch}"


ADDED_COUNT_KEY = "samplers/added_count"  # the raw counter `megarl samplers add` numbers its ranks by


def added_key(n: int) -> str:
    return f"samplers/added/{n}"


def remove_key(rank: int) -> str:
    return f"samplers/remove/{rank}"


def removed_key(rank: int) -> str:
    return f"samplers/removed/{rank}"


def sync_extra_key(rank: int) -> str:
    return f"samplers/sync_extra/{rank}"


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
        # The incarnations a whole publish reached: they run on the data position they started from. Every other
        # member is a newcomer that takes its position from the epoch record (once: EpochFollower.take_position).
        self.synced: dict[int, int] = dict(self.members)
        self.removed: set[int] = set()  # ranks `megarl samplers remove` took out for good (never re-admitted)
        self.answered: set[str] = set()  # remove requests answered
        self.added: list[int] = []  # ranks `megarl samplers add` started, in their order (added_key)

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
        self.synced.pop(rank, None)
        lost = lost_groups(self.started.pop(rank, 0.0), retired)
        self.lost += lost
        self.replaced += 1
        self.changed = True
        self.note(f"megarl: {self.name(rank)} {cause}: dropped from the publish set, replacement {incarnation + 1} "
                  f"starting; {lost} unfinished group{'s' if lost != 1 else ''} lost")

    def removals(self) -> list[tuple[int, str]]:
        """Remove requests (`megarl samplers remove`) not answered yet: (rank, request id)."""
        self.discover()
        found = []
        for rank in self.known:
            record = read_record(self.store, remove_key(rank))
            if record is not None and record["request"] not in self.answered:
                found.append((rank, record["request"]))
        return found

    def remove(self, rank: int, request: str, retired: int) -> dict:
        """Take `rank` out of the live set for good (its keeper then kills the incarnation and starts none); its
        running rollouts are dropped, counted as lost. Refused (the answer says why) for a rank that is no member
        or the last member: the run would have no sampler left. The answer is recorded under removed_key."""
        self.answered.add(request)
        if rank not in self.members:
            answer = {"request": request, "refused": f"{self.name(rank)} is not in the publish set (being replaced, "
                                                     f"or removed already)"}
        elif len(self.members) == 1:
            answer = {"request": request, "refused": f"{self.name(rank)} is the last live sampler: the run would "
                                                     f"have none left"}
        else:
            incarnation = self.members.pop(rank)
            self.synced.pop(rank, None)
            self.removed.add(rank)
            lost = lost_groups(self.started.pop(rank, 0.0), retired)
            self.lost += lost
            self.changed = True
            answer = {"request": request, "incarnation": incarnation, "lost": lost}
            self.note(f"megarl: {self.name(rank)} removed (megarl samplers remove): left the publish set, stopped "
                      f"and not replaced; {lost} running group{'s' if lost != 1 else ''} dropped (lost)")
        self.store.set(removed_key(rank), json.dumps(answer))
        return answer

    def dead(self) -> list[tuple[int, str]]:
        """Members whose keeper recorded their end: (rank, cause)."""
        found = []
        for rank, incarnation in list(self.members.items()):
            record = read_record(self.store, dead_key(rank))
            if record is not None and record["incarnation"] == incarnation:
                found.append((rank, record["cause"]))
        return found

    def discover(self) -> None:
        """Take in the ranks `megarl samplers add` started since the last look (their first incarnation is 1: it
        asks to join as a replacement does)."""
        while (record := read_record(self.store, added_key(len(self.added) + 1))) is not None:
            self.added.append(int(record["rank"]))
            self.known.setdefault(int(record["rank"]), 0)

    def join_line(self, rank: int, incarnation: int, version: int) -> str:
        what = "added" if rank in self.added and incarnation == 1 else f"replacement {incarnation}"
        return f"megarl: {self.name(rank)}: {what} joins the publish set at version {version}"

    def joins(self) -> list[tuple[int, int]]:
        """Ready replacements and added samplers not yet members: (rank, incarnation)."""
        self.discover()
        found = []
        for rank in self.known:
            raw = read_record(self.store, join_key(rank))
            if raw is not None and raw > self.known[rank] and rank not in self.members and rank not in self.removed:
                found.append((rank, raw))
        return found

    def admit(self, rank: int, incarnation: int) -> None:
        self.members[rank] = self.known[rank] = incarnation
        self.started.pop(rank, None)
        self.changed = True

    def newcomers(self) -> list[int]:
        """Members no whole publish has reached yet: the next epoch record carries their data position."""
        return sorted(rank for rank, inc in self.members.items() if self.synced.get(rank) != inc)

    def delivered(self) -> None:
        """A publish reached every member: none is a newcomer any more (a survivor must never be given a position:
        it would re-issue the groups it has in flight, which the learner would then train twice)."""
        self.synced.update(self.members)

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


class SyncShares:
    """algo.mode=sync, learner rank 0: who still owes the batch being collected how many groups.

    Each member generates its share (prompts_per_step / sampler.num_engines) of every version it receives, and the
    batch is that version's groups. What the members cannot cover is asked of the members left as extra groups of
    that version (`sync_extra_key`), the one owing least first: the share a member dropped mid-batch had not
    delivered, and the shares of engines with no member at the batch's start (a replacement not joined yet)."""

    def __init__(self, store, batch_groups: int, share: int):
        self.store, self.batch_groups, self.share = store, batch_groups, share
        self.version: int | None = None  # the version whose batch is being collected (None between batches)
        self.incarnations: dict[int, int] = {}  # the members owing groups of it
        self.owed: Counter[int] = Counter()
        self.extra: Counter[int] = Counter()  # asked beyond the share, per member

    def start(self, version: int, members: dict[int, int]) -> None:
        """The batch of `version` is collected from `members` (rank -> incarnation): each owes its share."""
        self.version, self.incarnations = version, dict(members)
        self.owed, self.extra = Counter(dict.fromkeys(members, self.share)), Counter()
        self._ask(self.batch_groups - self.share * len(members))

    def delivered(self, rank: int) -> None:
        if self.version is not None:
            self.owed[rank] -= 1

    def lost(self, rank: int) -> None:
        """`rank` left the members mid-batch: what it still owed is asked of the others."""
        if self.version is not None and self.incarnations.pop(rank, None) is not None:
            self._ask(max(0, self.owed.pop(rank, 0)))

    def done(self) -> None:
        self.version = None

    def _ask(self, groups: int) -> None:
        if groups <= 0 or not self.incarnations:
            return  # no member left: the replacements that join generate the whole batch (JoinersWaiting)
        asked = set()
        for _ in range(groups):
            rank = min(self.incarnations, key=lambda r: (self.owed[r], r))
            self.owed[rank] += 1
            self.extra[rank] += 1
            asked.add(rank)
        for rank in sorted(asked):
            self.store.set(sync_extra_key(rank), json.dumps({"version": self.version, "groups": self.extra[rank],
                                                             "incarnation": self.incarnations[rank]}))


class EpochFollower:
    """A sampler incarnation's side of one publish part (each learner pipeline stage's and publish sender's part has
    a follower of its own, reading the same records): the group it receives over, moved to each new epoch that
    names it.

    Incarnation 0 starts in epoch 0 over the run's first publish group; a replacement starts outside any epoch
    and waits for one that names it. `make_group(epoch, group_rank, size)` builds an epoch's group (blocks until
    every member and the learner joined it). An epoch whose group fails to form (a member died or was slow meanwhile:
    the learner's side fails too and records a later epoch) leaves this incarnation between epochs, group None,
    waiting for the next one; only an epoch that leaves it out ends it (SamplerDropped).

    `rank` is the member's rank in the records: its engine's lead rank (an engine spanning sampler.tp ranks is one
    member; each of its ranks follows the epochs with the lead's rank and the engine's incarnation). `receivers`:
    the engine's ranks in each group (topology's receivers_per_engine), this rank the `offset`-th of them, so the
    i-th member's receivers are group ranks 1 + i * receivers + offset.

    `rejoin_timeout_s`: how long a member may wait for the next epoch after a failed receive or formation. The
    learner records it at its next publish at the latest, which follows its wait for groups (queue.timeout_s) and
    the attempts to form and publish (`rejoin_timeout_s`): a shorter one would fail live samplers whenever a
    member's failure costs the learner a slow step."""

    def __init__(self, store, rank: int, incarnation: int, make_group: Callable[[int, int, int], object],
                 group=None, rejoin_timeout_s: float | None = None, receivers: int = 1, offset: int = 0):
        self.store, self.rank, self.incarnation, self.make_group = store, rank, incarnation, make_group
        self.receivers, self.offset = receivers, offset
        self.epoch = 0 if incarnation == 0 else -1
        self.group = group
        self.rejoin_timeout_s = rejoin_timeout_s
        self.position: dict | None = None  # a newcomer's data position, from the newest epoch record naming it
        self.positioned = False  # taken (with the first version received): later records' positions are ignored
        self.failed: BaseException | None = None  # why the last epoch's group did not form

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
        try:
            self.group = self.make_group(epoch, 1 + members.index((self.rank, self.incarnation)) * self.receivers +
                                         self.offset, 1 + len(members) * self.receivers)
        except (RuntimeError, TimeoutError) as exc:  # the learner's side failed as well: a later epoch
            self.failed = exc
            return None
        if str(self.rank) in record["positions"] and not self.positioned:
            self.position = record["positions"][str(self.rank)]
        return record["first_publish"]

    def take_position(self) -> dict | None:
        """With the first version this incarnation applies: the data position to issue its groups from (None for
        an incarnation that started with the run, or once taken)."""
        if self.positioned:
            return None
        self.positioned = True
        position, self.position = self.position, None
        return position

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
                                   f"failed receive ({what}; last epoch not formed: {self.failed})")
            time.sleep(POLL_S)
