"""Membership epochs (fault.on_failure=replace) over a real TCPStore and real gloo groups, in threads: a dropped
member leaves the publish set, the survivor follows to the next epoch's group, a replacement is admitted with its
data position and receives the next (whole) publish bit exact; late groups of a dropped incarnation are refused."""
import collections
import json
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megarl.distributed.heartbeat import Heartbeat, HeartbeatMonitor
from megarl.distributed.lifetime import WaitAbandoned
from megarl.distributed.membership import (SHIFT, EpochFollower, SamplerDropped, SamplerSet, dead_key, epoch_key,
                                           join_key, lost_groups)
from megarl.distributed.publish import StagedReceiver, WeightPublisher, WeightReceiver
from megarl.distributed.ranks import Topology
from megarl.distributed.signed_store import SignedStore
from megarl.distributed.topology import epoch_publish_group, publish_stage_store
from megarl.roles.sampler_keeper import how_it_ended, over_limit
from tests.helpers import signed_loopback_store

KEY = b"k" * 32
TIMEOUT_S = 20.0


@pytest.fixture
def store():
    return signed_loopback_store(KEY)


def _client(store):
    """Another process's connection to the store: each member (a process of its own in a run) blocks in its
    group's rendezvous on its own connection."""
    return SignedStore(dist.TCPStore("127.0.0.1", store.raw.port, None, False, timedelta(seconds=30)), KEY)


def _group(store, epoch: int, rank: int, size: int):
    return epoch_publish_group(store, epoch, rank, size, "gloo", TIMEOUT_S)


def _weights(version: int) -> dict[str, torch.Tensor]:
    return {"a": torch.full((4, 3), float(version)), "b": torch.arange(5, dtype=torch.float32) * version}


class Member:
    """A sampler incarnation's receiver: what it got, per version, and every version handed over, in order (an engine
    runs a version as soon as it is handed over). `refuse`: versions whose first hand-over fails (a receive that
    fails on this member only); `destination`: the receiver writes into fresh per-version storage (the built-in
    engine's staging_buffers) instead of its staging sets."""

    def __init__(self, store, rank: int, incarnation: int, group=None, destination: bool = False):
        store = _client(store)
        self.got: dict[int, dict] = {}
        self.handed: list[int] = []
        self.refuse: set[int] = set()
        self.stopped = threading.Event()
        self.follower = EpochFollower(store, rank, incarnation, lambda e, r, n: _group(store, e, r, n), group=group)
        expected = {name: (t.shape, t.dtype) for name, t in _weights(0).items()}

        def storage(version):  # fresh storage per version
            return {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in expected.items()}

        self.receiver = WeightReceiver(group, store, expected, torch.device("cpu"), on_version=self._on_version,
                                       current_version=lambda: max(self.got, default=0),
                                       should_stop=self.stopped.is_set, timeout_s=TIMEOUT_S,
                                       destination=storage if destination else None,
                                       follower=self.follower)

    def _on_version(self, version, tensors, extra):
        if version in self.refuse:
            self.refuse.discard(version)
            raise RuntimeError(f"version {version}: this member's receive failed")
        self.handed.append(version)
        self.got[version] = {name: t.clone() for name, t in tensors.items()}

    def wait_for(self, version: int) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while version not in self.got:
            assert self.receiver.error is None, self.receiver.error
            assert time.monotonic() < deadline, f"version {version} did not arrive"
            time.sleep(0.01)


def _epoch0(store, size: int):
    """The run's first group, built by every member at once (as at start-up)."""
    groups = [None] * size
    threads = [threading.Thread(target=lambda r=r: groups.__setitem__(r, _group(_client(store), 0, r, size)))
               for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups


def test_a_dropped_member_is_left_out_and_a_replacement_joins_with_its_position_and_the_next_whole_publish(store):
    notes = []
    members = SamplerSet(store, [1, 2], num_learners=1, note=notes.append)
    groups = _epoch0(store, 3)
    a, b = Member(store, 1, 0, groups[1]), Member(store, 2, 0, groups[2])
    publisher = WeightPublisher(groups[0], store, bucket_mb=1e-4, timeout_s=TIMEOUT_S, checksum=True, delta=True)
    a.receiver.start(), b.receiver.start()
    publisher.publish(1, _weights(1).items())
    a.wait_for(1), b.wait_for(1)

    # rank 2 dies: its keeper's record names incarnation 0; the learner drops it and starts epoch 1 without it
    b.stopped.set()
    store.set(dead_key(2), json.dumps({"incarnation": 0, "cause": "was killed by signal 9 (SIGKILL)"}))
    members.started[2] = 5.0
    [(rank, cause)] = members.dead()
    members.drop(rank, cause, retired=3)
    assert notes[-1] == ("megarl: sampler 1 (rank 2) was killed by signal 9 (SIGKILL): dropped from the publish set, "
                         "replacement 1 starting; 2 unfinished groups lost")
    assert not members.accepts(2, {"incarnation": 0.0})  # its late groups are refused
    epoch = members.start_epoch(publisher.published + 1, {})
    publisher.group, publisher.last_sent = _group(store, epoch, 0, 1 + members.alive), []
    publisher.publish(2, _weights(2).items())
    a.wait_for(2)
    assert a.follower.epoch == 1 and 2 not in b.got

    # its replacement (incarnation 1) announces itself; the learner admits it with its stream's data position
    c = Member(store, 2, 1)
    c.receiver.start()
    store.set(join_key(2), "1")
    assert members.joins() == [(2, 1)]
    members.admit(2, 1)
    epoch = members.start_epoch(publisher.published + 1, {2: {"cursor": 3, "above": [5]}})
    built = []
    builder = threading.Thread(target=lambda: built.append(_group(store, epoch, 0, 1 + members.alive)))
    builder.start()
    builder.join(TIMEOUT_S)
    publisher.group, publisher.last_sent = built[0], []
    publisher.publish(3, _weights(3).items())
    a.wait_for(3), c.wait_for(3)
    for member in (a, c):  # bit exact, the newcomer included (the epoch's first publish is whole)
        assert all(torch.equal(member.got[3][n], t) for n, t in _weights(3).items())
    assert sorted(c.got) == [3] and c.follower.position == {"cursor": 3, "above": [5]}
    assert members.accepts(2, {"incarnation": 1.0, "started": 4.0})
    assert members.metrics() == {"samplers/alive": 2.0, "samplers/replaced": 1.0, "samplers/rollouts_lost": 2.0}
    publisher.publish(4, _weights(4).items())  # a delta again, on the base both now hold
    a.wait_for(4), c.wait_for(4)
    assert all(torch.equal(c.got[4][n], t) for n, t in _weights(4).items())
    for member in (a, b, c):
        member.stopped.set()
        member.receiver.thread.join(5)


@pytest.mark.parametrize("mode", ["staging sets", "delta", "destination"])
def test_a_version_published_again_over_a_new_epoch_is_taken_once_and_the_next_one_does_not_wait(store, mode):
    # The learner sends a version again at once over a new epoch when its publish failed with every sampler alive
    # (learner_main.publish_to_members). Here the publish of version 2 reached both members, but b's receive failed
    # (b alone): a holds version 2 and must discard the second copy (staging it again would fill its other staging
    # set, and version 3 would wait for the engine to move past version 2, which it runs), b takes it in the set its
    # failed receive used; version 3 then reaches both at once, bit exact.
    groups = _epoch0(store, 3)
    a, b = Member(store, 1, 0, groups[1], mode == "destination"), Member(store, 2, 0, groups[2], mode == "destination")
    members = SamplerSet(store, [1, 2], num_learners=1, note=lambda line: None)
    publisher = WeightPublisher(groups[0], store, bucket_mb=1e-4, timeout_s=TIMEOUT_S, checksum=True,
                                delta=mode == "delta")
    a.receiver.start(), b.receiver.start()
    publisher.publish(1, _weights(1).items())
    a.wait_for(1), b.wait_for(1)
    b.refuse.add(2)
    publisher.publish(2, _weights(2).items())
    a.wait_for(2)

    epoch = members.start_epoch(publisher.published + 1, {})  # the same members: version 2 goes again over it
    publisher.group, publisher.last_sent = _group(store, epoch, 0, 3), []
    publisher.publish(2, _weights(2).items())
    b.wait_for(2)
    publisher.publish(3, _weights(3).items())
    a.wait_for(3), b.wait_for(3)
    assert a.handed == [1, 2, 3] and b.handed == [1, 2, 3]
    for member in (a, b):
        assert all(torch.equal(member.got[3][n], t) for n, t in _weights(3).items())
        assert member.receiver.error is None
        member.stopped.set()
        member.receiver.thread.join(5)


def _part_groups(store, epoch: int, stage: int) -> list:
    """Publish part `stage`'s group of `epoch` with one member, built by both sides at once: [source's, member's]."""
    sides = [None, None]
    threads = [threading.Thread(target=lambda r=r: sides.__setitem__(
        r, epoch_publish_group(_client(store), epoch, r, 2, "gloo", TIMEOUT_S, stage))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sides


def test_a_member_that_missed_one_part_of_a_version_takes_the_next_version_whole_without_waiting(store):
    # learner.pp=2 under replace: each stage publishes its part ("a", "b") over its own group. Here the member's
    # receive of stage 0's part of version 2 fails after its bytes arrived, so both sources' publishes succeeded and
    # the learner goes on to version 3 over a new epoch. Stage 1's receiver holds version 2, which can never be whole,
    # while the engine runs version 1 from the other staging set: version 3 must land in version 2's set (waiting for
    # the engine to move past version 1 would wait for version 3 itself, until publish.timeout_s failed it).
    stores = [publish_stage_store(store, stage) for stage in (0, 1)]
    groups = [_part_groups(store, 0, stage) for stage in (0, 1)]
    clients = [_client(store) for _ in (0, 1)]
    followers = [EpochFollower(clients[stage], 1, 0, lambda e, r, n, stage=stage: epoch_publish_group(
        clients[stage], e, r, n, "gloo", TIMEOUT_S, stage), group=groups[stage][1]) for stage in (0, 1)]
    got, stopped = {}, threading.Event()
    expected = {name: (t.shape, t.dtype) for name, t in _weights(0).items()}
    receiver = StagedReceiver([(groups[stage][1], publish_stage_store(clients[stage], stage)) for stage in (0, 1)],
                              expected, torch.device("cpu"),
                              on_version=lambda v, tensors, extra: got.__setitem__(v, {n: t.clone() for n, t in
                                                                                      tensors.items()}),
                              current_version=lambda: max(got, default=0), should_stop=stopped.is_set,
                              timeout_s=TIMEOUT_S, followers=followers)
    stage0 = receiver.receivers[0]
    hand_over = stage0.on_version

    def fail_version_2(version, tensors, extra):
        if version == 2:
            raise RuntimeError("version 2: this member's receive of stage 0's part failed")
        hand_over(version, tensors, extra)

    stage0.on_version = fail_version_2
    receiver.start()
    publishers = [WeightPublisher(groups[stage][0], stores[stage], bucket_mb=1e-4, timeout_s=TIMEOUT_S, checksum=True)
                  for stage in (0, 1)]

    def publish(version):
        for publisher, name in zip(publishers, ("a", "b")):
            publisher.publish(version, [(name, _weights(version)[name])])

    publish(1)
    publish(2)
    deadline = time.monotonic() + TIMEOUT_S
    while 1 not in got or 2 not in receiver.parts:  # stage 1's part of version 2 arrived, stage 0's did not
        assert receiver.error is None and time.monotonic() < deadline, receiver.error
        time.sleep(0.01)
    store.set(epoch_key(1), json.dumps({"members": [[1, 0]], "first_publish": 3, "positions": {}}))
    for publisher, stage in zip(publishers, (0, 1)):
        publisher.group, publisher.last_sent = _part_groups_source(store, 1, stage), []
    start = time.monotonic()
    publish(3)
    while 3 not in got:
        assert receiver.error is None and time.monotonic() < deadline + TIMEOUT_S, receiver.error
        time.sleep(0.01)
    assert sorted(got) == [1, 3] and time.monotonic() - start < TIMEOUT_S / 2
    assert all(torch.equal(got[3][n], t) for n, t in _weights(3).items())
    assert 2 not in receiver.parts  # its parts were let go
    stopped.set()
    receiver.join(5)


def _part_groups_source(store, epoch: int, stage: int):
    """The source's side of publish part `stage`'s group of `epoch` (the member's follower builds its own)."""
    return epoch_publish_group(_client(store), epoch, 0, 2, "gloo", TIMEOUT_S, stage)


def test_a_member_in_one_parts_epoch_rendezvous_holds_up_neither_its_heartbeat_nor_its_other_parts_group(store):
    # One sampler process, one store connection, two publish parts (learner.pp=2). Part 0's source has arrived but
    # not yet entered torch's rendezvous, so the member's part-0 receiver thread sits in that C++ rendezvous. Over a
    # shared connection every other call of the process would queue behind it until its timeout: the loop's
    # heartbeat (the learner then drops a live sampler as hung) and part 1's group (its source gives up on the
    # member). Both must go on while part 0 still waits; part 0 forms once its source comes.
    member = _client(store)
    dist.PrefixStore("publish/e1/", store.raw).set("arrived/0", "1")  # part 0's source said it arrived
    part0 = []
    waiting = threading.Thread(target=lambda: part0.append(epoch_publish_group(member, 1, 1, 2, "gloo", TIMEOUT_S)))
    waiting.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not store.raw.check(["publish/e1//0/1"]):  # gloo's key: the member is inside torch's rendezvous
        assert time.monotonic() < deadline
        time.sleep(0.01)
    Heartbeat(member, 1, period_s=0.0).beat()
    part1 = [None]
    source1 = threading.Thread(target=lambda: part1.__setitem__(0, _part_groups_source(store, 1, 1)))
    source1.start()
    member_part1 = epoch_publish_group(member, 1, 1, 2, "gloo", TIMEOUT_S, 1)
    source1.join()
    assert waiting.is_alive() and not part0  # all the above happened while part 0's rendezvous waited
    assert HeartbeatMonitor(store, [1], timeout_s=60)._read(1) == 1
    source0 = epoch_publish_group(_client(store), 1, 0, 2, "gloo", TIMEOUT_S)
    waiting.join()
    for source, receiving in ((source0, part0[0]), (part1[0], member_part1)):  # both groups work
        sent, got = torch.arange(3.0), torch.zeros(3)
        works = [source.broadcast([sent], dist.BroadcastOptions()), receiving.broadcast([got], dist.BroadcastOptions())]
        for work in works:
            work.wait()
        assert torch.equal(got, sent)


def test_a_stopping_member_leaves_an_epoch_whose_members_have_not_all_arrived_at_once(store):
    with pytest.raises(WaitAbandoned, match=r"stopped while waiting for every member of publish epoch 3's group "
                                            r"\(stage 1, TP rank 0, sender 0\) of 2 sampler\(s\)"):
        epoch_publish_group(store, 3, 2, 3, "gloo", TIMEOUT_S, 1, should_stop=lambda: True)


def test_an_incarnation_left_out_of_a_later_epoch_knows_it_was_dropped(store):
    follower = EpochFollower(store, 1, 0, lambda e, r, n: pytest.fail("no group for a dropped member"), group=object())
    assert follower.follow() is None
    store.set(epoch_key(1), json.dumps({"members": [[2, 0]], "first_publish": 4, "positions": {}}))
    with pytest.raises(SamplerDropped, match="sampler rank 1 incarnation 0 is not a member of publish epoch 1"):
        follower.follow()
    newcomer = EpochFollower(store, 1, 1, lambda e, r, n: (e, r, n))
    assert newcomer.follow() is None  # epoch 1 does not name it yet: it waits
    store.set(epoch_key(2), json.dumps({"members": [[1, 1], [2, 0]], "first_publish": 6, "positions": {"1": {}}}))
    assert newcomer.follow() == 6 and newcomer.group == (2, 1, 3) and newcomer.position == {}


@pytest.mark.parametrize("learner_tp", [1, 2])
def test_every_rank_of_an_engine_of_several_ranks_follows_the_epochs_as_its_engine_at_its_place_in_the_group(
        store, learner_tp):
    # Two engines of two ranks (sampler.tp=2). At learner.tp=1 every rank receives the whole tensors (slices on
    # arrival): an epoch of both engines places them as the run's first group does (topology's publish_rank), and one
    # of the second engine alone puts its ranks right after the source. At learner.tp=2 each TP rank has its own
    # part's group, one receiver per engine.
    world = [Topology(rank=r, world_size=learner_tp + 4, num_learners=learner_tp, num_samplers=4, sampler_tp=2,
                      learner_tp=learner_tp) for r in range(learner_tp + 4)]
    leads = world[0].engine_leads
    store.set(epoch_key(1), json.dumps({"members": [[lead, 0] for lead in leads], "first_publish": 3,
                                        "positions": {}}))
    followers = {topo.rank: EpochFollower(store, topo.engine_lead, 0, lambda e, r, n: (e, r, n), group=object(),
                                          receivers=topo.receivers_per_engine, offset=topo.publish_offset)
                 for topo in world[learner_tp:]}
    for topo in world[learner_tp:]:
        assert followers[topo.rank].follow() == 3
        assert followers[topo.rank].group == (1, topo.publish_rank, topo.publish_group_size)
    store.set(epoch_key(2), json.dumps({"members": [[leads[1], 0]], "first_publish": 5, "positions": {}}))
    for topo in world[learner_tp:]:
        if topo.engine_index == 0:
            with pytest.raises(SamplerDropped):  # both its ranks leave with it
                followers[topo.rank].follow()
            continue
        assert followers[topo.rank].follow() == 5
        assert followers[topo.rank].group == (2, 1 + topo.publish_offset, 1 + topo.receivers_per_engine)


def test_a_replacement_counts_heartbeats_above_its_predecessor_and_is_watched_once_it_joins(store):
    monitor = HeartbeatMonitor(store, [1], timeout_s=60, check_every_s=0.0)
    old = Heartbeat(store, 1, period_s=0.0)
    for _ in range(3):
        old.beat()
    monitor.observe()
    monitor.forget(1)
    assert monitor.ranks == []
    new = Heartbeat(store, 1, period_s=0.0, first=1 << SHIFT)
    monitor.watch(1)
    monitor.observe()
    new.beat()
    before = monitor.last_value[1]
    monitor.observe()
    assert monitor.last_value[1] == (1 << SHIFT) + 1 > before


def test_the_keeper_limits_restarts_per_hour_and_says_how_a_sampler_ended():
    restarts = collections.deque()
    assert not any(over_limit(restarts, t, per_hour=2) for t in (0.0, 10.0))
    assert over_limit(restarts, 20.0, per_hour=2)
    assert not over_limit(collections.deque([0.0, 10.0]), 3700.0, per_hour=2)  # older than an hour: forgotten
    assert how_it_ended(-9) == "was killed by signal 9 (SIGKILL)" and how_it_ended(1) == "exited with code 1"
    assert lost_groups(7.0, 5) == 2 and lost_groups(3.0, 5) == 0
