"""fault.on_failure=replace, the learner's membership and step state machine driven directly (no processes): a
failed epoch or publish must not turn into replacing live samplers, a survivor is never handed a data position, the
learner waits on while every sampler is being replaced, and a step is always one batch's optimizer steps."""
import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from megarl.config.load import load_config
from megarl.distributed.membership import EpochFollower, dead_key, epoch_key, join_key, read_record, sync_extra_key
from megarl.distributed.publish import header_key
from megarl.protocols import TrainBatch
from megarl.roles import learner_main
from megarl.roles.learner_main import Intake, JoinersWaiting, RunOutputs, check_trained, publish_to_members, \
    refresh_members
from megarl.sampler.sglang_engine import SGLangWeightFollower
from megarl.distributed.publish import WeightPublisher
from tests.distributed.test_membership import Member, _epoch0, _group, _weights
from tests.helpers import REPO, signed_loopback_store

KEY = b"k" * 32


@pytest.fixture
def store():
    return signed_loopback_store(KEY)


def _intake(store, monkeypatch, *overrides) -> Intake:
    """The lead's intake of a 1-learner, 2-sampler run (ranks 1 and 2) under fault.on_failure=replace."""
    monkeypatch.setenv("MEGARL_RUN_SECRET", "ab" * 32)
    cfg = load_config(REPO / "configs" / "arithmetic.yaml",
                      ["fault.on_failure=replace", "sampler.num_engines=2", *overrides], check_files=False)
    intake = Intake(cfg, store, SimpleNamespace(num_learners=1, engine_leads=[1, 2]))
    intake.members.note = lambda line: None

    def observe():  # every sampler watched beats (the real counters are the heartbeat tests')
        now = time.monotonic()
        intake.heartbeats.last_change = dict.fromkeys(intake.heartbeats.ranks, now)
        return now

    intake.heartbeats.observe = observe
    return intake


class FakePublisher:
    """The publisher's surface refresh_members and publish_to_members use; `fail` publishes raise TimeoutError."""

    def __init__(self, fail: int = 0, on_fail=lambda: None):
        self.group, self.last_sent, self.published, self.fail, self.sent = "epoch 0", [], 0, fail, []
        self.on_fail = on_fail  # what happens while a failing publish runs (a member dies)

    def publish(self, version, tensors, extra=None, spec=None):
        self.published += 1
        list(tensors)
        if self.fail:
            self.fail -= 1
            self.on_fail()
            raise TimeoutError(f"weight publish: version {version} timed out (a member is slow)")
        self.sent.append((version, self.group))
        return {"bytes": 1, "seconds": 0.0}


class FakeLearner:
    version = 7

    def publish_tensors(self):
        return iter([("w", torch.zeros(2))])

    def publish_spec(self, shards):
        return [("w", (2,), torch.float32)]


def _epoch(store, epoch: int) -> dict:
    return json.loads(store.get(epoch_key(epoch)))


def test_a_survivor_gets_no_data_position_when_an_epoch_fails_to_form(store, monkeypatch):
    # A survivor handed its stream's data position would re-issue the groups it has in flight (trained twice, and
    # its pending groups clobbered, which crashes it: a live sampler replaced). Only newcomers get one.
    intake = _intake(store, monkeypatch, "publish.timeout_s=0.2", "fault.sampler_timeout_s=0.2", "fault.heartbeat_s=0.1")
    intake.position.retire("s1-g0")
    store.set(dead_key(1), json.dumps({"incarnation": 0, "cause": "was killed by signal 9 (SIGKILL)"}))
    tries = []

    def make_group(epoch, size):
        tries.append(epoch)
        if len(tries) == 1:
            raise TimeoutError("a member was slow to join")
        return f"epoch {epoch}"

    publisher = FakePublisher()
    assert refresh_members(intake, publisher, make_group, version=3)
    assert tries == [1, 2] and publisher.group == "epoch 2"
    assert _epoch(store, 1)["positions"] == {} and _epoch(store, 2)["positions"] == {}  # rank 2 survived: none
    # its replacement is a newcomer until a publish reaches it: every epoch until then carries its position
    store.set(join_key(1), "1")
    tries.clear()
    assert refresh_members(intake, publisher, make_group, version=3)
    assert _epoch(store, 3)["positions"] == {"1": {"cursor": 0, "above": []}}
    assert _epoch(store, 4)["positions"] == {"1": {"cursor": 0, "above": []}}
    intake.members.delivered()
    intake.members.changed = True
    assert refresh_members(intake, publisher, make_group, version=4)
    assert _epoch(store, 5)["positions"] == {}


def test_a_failed_publish_drops_no_live_sampler_that_stood_still_a_few_seconds(store, monkeypatch):
    # On a loaded machine a live sampler's loop stands still for seconds; dropping it for that has its keeper kill it
    # (a replacement replaced during its first publish). Gone: a keeper's record, or silence for gone_after_s.
    intake = _intake(store, monkeypatch, "publish.timeout_s=3.5")
    beats = {"n": 0}

    def observe():  # rank 2 stood still 3.2 s, then beats again
        beats["n"] += 1
        now = time.monotonic()
        if beats["n"] == 1:
            intake.heartbeats.last_change = {1: now, 2: now - 3.2}
        else:
            intake.heartbeats.last_change = {1: now, 2: now}
        return now

    intake.heartbeats.observe = observe
    intake.publish_failed(TimeoutError("weight publish timed out"))
    assert intake.members.members == {1: 0, 2: 0} and intake.members.replaced == 0
    assert intake.members.changed  # the next publish goes over a new epoch (whole)
    assert not store.check(["samplers/replace/2"])  # its keeper is not asked to kill it


def test_after_a_failed_publish_the_survivors_budget_does_not_wait_for_the_next_publish(store, monkeypatch):
    # A survivor's staleness budget is freed by the retired counts a publish carries: after a failed publish they are
    # posted at once (else a survivor with its budget spent sends nothing and the learner waits queue.timeout_s).
    intake = _intake(store, monkeypatch, "publish.timeout_s=0.2", "fault.sampler_timeout_s=0.2",
                     "fault.heartbeat_s=0.1")
    intake.retired.update({1: 6, 2: 4})
    # rank 2 dies during the publish
    publisher = FakePublisher(fail=1, on_fail=lambda: store.set(dead_key(2), json.dumps(
        {"incarnation": 0, "cause": "was killed by signal 9 (SIGKILL)"})))
    published = publish_to_members(FakeLearner(), publisher, intake, lambda epoch, size: f"epoch {epoch}", None, 1)
    assert published["bytes"] == 0 and publisher.sent == []  # a sampler gone (built-in engine): the next step's publish
    assert store.get("retired/1") == b"6"


def test_a_failed_publish_goes_again_at_once_where_the_samplers_left_could_not_go_on_without_it(store, monkeypatch):
    # SGLang servers whose receive failed stay paused until a whole publish; newcomers send nothing before one.
    intake = _intake(store, monkeypatch, "publish.timeout_s=0.2", "fault.sampler_timeout_s=0.2",
                     "fault.heartbeat_s=0.1")
    publisher = FakePublisher(fail=1)
    store.set(dead_key(2), json.dumps({"incarnation": 0, "cause": "was killed by signal 9 (SIGKILL)"}))
    published = publish_to_members(FakeLearner(), publisher, intake, lambda epoch, size: f"epoch {epoch}", None, 1,
                                   True)
    assert published["bytes"] == 1
    assert publisher.sent == [(7, "epoch 2")]  # epoch 1 ({1, 2}) failed; epoch 2 ({1}) got version 7 at once
    assert _epoch(store, 2)["members"] == [[1, 0]]
    # no sampler gone, MEMBERSHIP_ATTEMPTS failures in a row: the run stops, naming the publish's error
    publisher.fail = 3
    intake.heartbeats.ranks = [1]
    with pytest.raises(TimeoutError, match="failed 3 times in a row .* with no sampler gone: weight publish: version"):
        publish_to_members(FakeLearner(), publisher, intake, lambda epoch, size: f"epoch {epoch}", None, 1, True)


class ShardedLearner(FakeLearner):
    """A learner TP rank's side: its own slice of `w` (publish_shards) or the whole tensor (publish_tensors)."""

    def publish_shards(self):
        return iter([("w", torch.zeros(1))])

    def publish_spec(self, shards):
        return [("w", (1,) if shards else (2,), torch.float32)]


def test_shard_to_shard_every_epochs_publish_carries_the_sources_own_slices(store, monkeypatch):
    # learner.tp = sampler.tp > 1: each engine TP rank expects its slices, as in the run's first groups; whole tensors
    # would fail every member's receive (a shape the engine does not hold).
    intake = _intake(store, monkeypatch)
    sent = []
    publisher = FakePublisher()
    publisher.publish = lambda version, tensors, extra=None, spec=None: sent.append(
        (spec, [tuple(t.shape) for _, t in tensors])) or {"bytes": 1, "seconds": 0.0}
    publish_to_members(ShardedLearner(), publisher, intake, lambda epoch, size: f"epoch {epoch}", None, 1, shards=True)
    assert sent == [([("w", (1,), torch.float32)], [(1,)])]


class TimesOutOnce:
    """The learner's side of a real group whose broadcasts reach every member, then report what gloo reports when
    a member was slower than publish.timeout_s (every sampler alive)."""

    def __init__(self, group):
        self.group = group

    def broadcast(self, tensor, root, timeout):
        work = self.group.broadcast(tensor, root, timeout)

        class Late:
            def wait(self):
                work.wait()
                raise RuntimeError("Timed out waiting 20000ms for send operation to complete")

        return Late()


class WeightsSource:
    """The learner's publish surface over test_membership's weights."""

    def __init__(self, version: int):
        self.version = version

    def publish_tensors(self):
        return iter(_weights(self.version).items())

    def publish_spec(self, shards):
        return [(name, tuple(t.shape), t.dtype) for name, t in _weights(0).items()]


def test_a_publish_that_times_out_with_every_sampler_alive_goes_again_at_once_and_is_taken_once(store, monkeypatch):
    # Left to the next step, the samplers that missed the version would generate on an older one while their
    # staleness budget lasts, and the learner would wait for groups until queue.timeout_s. The members the failed
    # publish reached take the second copy and discard it; the next version reaches them without waiting.
    intake = _intake(store, monkeypatch, "fault.sampler_timeout_s=0.2", "fault.heartbeat_s=0.1")
    groups = _epoch0(store, 3)
    members = [Member(store, 1, 0, groups[1]), Member(store, 2, 0, groups[2])]
    for member in members:
        member.receiver.start()
    publisher = WeightPublisher(TimesOutOnce(groups[0]), store, bucket_mb=1, timeout_s=20, checksum=True)
    make_group = lambda epoch, size: _group(store, epoch, 0, size)  # noqa: E731
    published = publish_to_members(WeightsSource(1), publisher, intake, make_group, None, 1)
    assert published["bytes"] > 0 and intake.failed_publishes == 0
    assert _epoch(store, 1) == {"members": [[1, 0], [2, 0]], "first_publish": 2, "positions": {}}
    published = publish_to_members(WeightsSource(2), publisher, intake, make_group, None, 1)
    assert published["bytes"] > 0
    for member in members:
        member.wait_for(2)
        assert member.handed == [1, 2] and member.receiver.error is None
        assert all(torch.equal(member.got[2][n], t) for n, t in _weights(2).items())
        member.stopped.set()
        member.receiver.thread.join(5)


def test_while_every_sampler_is_being_replaced_the_learner_waits_past_queue_timeout(store, monkeypatch):
    intake = _intake(store, monkeypatch)
    assert not intake._wait_more()  # samplers are members: queue.timeout_s stands
    intake.drop_sampler(1, "was killed by signal 9 (SIGKILL)")
    assert not intake._wait_more()
    intake.drop_sampler(2, "was killed by signal 9 (SIGKILL)")
    assert intake._wait_more()  # none is: their replacements start
    intake.memberless_since -= learner_main.memberless_wait_s(intake.cfg)
    assert not intake._wait_more()  # bounded
    store.set(join_key(2), "1")
    publisher = FakePublisher()
    assert refresh_members(intake, publisher, lambda epoch, size: f"epoch {epoch}", version=3)
    assert intake.memberless_since is None and not intake._wait_more()


def test_collect_groups_asks_whether_to_wait_on_when_queue_timeout_passes():
    cfg = load_config(REPO / "configs" / "arithmetic.yaml", ["algo.prompts_per_step=1"], check_files=False)
    group = [SimpleNamespace(sampler_rank=1, group_id="s0-g0", versions=[1], token_ids=[1])]

    class Queue:
        calls = 0

        def recv_group(self, timeout_s, on_wait=None):
            Queue.calls += 1
            if Queue.calls == 1:
                raise TimeoutError("sample queue: no group arrived")
            return group, {}

    monkeypatch_stale = learner_main.is_stale
    try:
        learner_main.is_stale = lambda *a: False
        groups, _, _ = learner_main._collect_groups(Queue(), cfg, 1, lambda g: None, {}, wait_more=lambda: True)
    finally:
        learner_main.is_stale = monkeypatch_stale
    assert groups == [group] and Queue.calls == 2
    with pytest.raises(TimeoutError):
        Queue.calls = 0
        learner_main._collect_groups(Queue(), cfg, 1, lambda g: None, {}, wait_more=lambda: False)


def test_an_epoch_that_fails_to_form_leaves_a_member_waiting_for_the_next_not_failed(store):
    def make_group(epoch, rank, size):
        if epoch == 1:
            raise RuntimeError("gloo: connect timed out (a member died while the group formed)")
        return ("group", epoch, rank, size)

    follower = EpochFollower(store, 2, 0, make_group, group="epoch 0")
    store.set(epoch_key(1), json.dumps({"members": [[1, 1], [2, 0]], "first_publish": 4, "positions": {}}))
    assert follower.follow() is None and follower.group is None  # between epochs: nothing is received
    store.set(epoch_key(2), json.dumps({"members": [[2, 0]], "first_publish": 5, "positions": {}}))
    assert follower.follow() == 5 and follower.group == ("group", 2, 1, 2)


def test_a_member_takes_its_data_position_once(store):
    follower = EpochFollower(store, 1, 1, lambda e, r, n: ("group", e))
    store.set(epoch_key(1), json.dumps({"members": [[1, 1]], "first_publish": 2, "positions": {"1": {"cursor": 3}}}))
    assert follower.follow() == 2
    assert follower.take_position() == {"cursor": 3}
    store.set(epoch_key(2), json.dumps({"members": [[1, 1]], "first_publish": 4, "positions": {"1": {"cursor": 5}}}))
    assert follower.follow() == 4
    assert follower.take_position() is None  # it runs on from the position it started with


class FakeSGLangEngine:
    """Records the calls the follower makes; the first update fails part-way (a member died mid-publish)."""

    def __init__(self):
        self.version, self.group_name, self.calls, self.fail = 0, None, [], 1

    def join_update_group(self, group, offset):
        self.group_name = group["group_name"]

    def leave_update_group(self):
        self.group_name = None

    def update_weights(self, version, weight_format, calls, continue_on_failure=True):
        self.calls.append((version, continue_on_failure))
        if self.fail:
            self.fail -= 1
            raise RuntimeError("/update_weights_from_distributed: gloo connection closed by peer")
        self.version = version


def _following_version_5(store, engine, published: list, stop: threading.Event):
    """An SGLang weight follower of sampler rank 2 over `engine`, started with version 5 published (publish 1)."""
    follower = EpochFollower(store, 2, 0, lambda e, r, n: f"megarl_weight_update_e{e}")
    follower.rejoin_timeout_s = 30.0
    weights = SGLangWeightFollower(engine, store, 1, lambda v, extra: published.append(v), stop.is_set,
                                   follower=follower)
    store.set("sglang/update_group", json.dumps({"group_name": "megarl_weight_update"}))
    store.set("sglang/spec", json.dumps({"format": "flattened_bucket", "calls": [[["w", [2], "float32"]]]}))
    store.set(header_key(1), json.dumps({"version": 5, "extra": {}}))
    weights.start()
    return weights


def test_an_sglang_server_whose_update_failed_waits_paused_for_the_next_epoch_not_fails(store):
    engine, published, stop = FakeSGLangEngine(), [], threading.Event()
    weights = _following_version_5(store, engine, published, stop)
    deadline = time.monotonic() + 30
    while not engine.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    store.set(epoch_key(1), json.dumps({"members": [[2, 0]], "first_publish": 2, "positions": {}}))
    store.set(header_key(2), json.dumps({"version": 5, "extra": {}}))
    while not published and time.monotonic() < deadline and weights.error is None:
        time.sleep(0.01)
    stop.set()
    weights.join(10)
    assert weights.error is None, weights.error
    assert engine.calls == [(5, False), (5, False)] and published == [5]  # paused on failure, then the whole one


def test_an_sglang_server_that_got_a_version_loads_it_again_when_the_learner_sends_it_again(store):
    # A publish that timed out on another member, every sampler alive, goes again at once over a new epoch: a server
    # that got it loads it again under the same label (its tokens keep that version) and goes on.
    engine, published, stop = FakeSGLangEngine(), [], threading.Event()
    engine.fail = 0
    weights = _following_version_5(store, engine, published, stop)
    deadline = time.monotonic() + 30
    while not published and time.monotonic() < deadline:
        time.sleep(0.01)
    store.set(epoch_key(1), json.dumps({"members": [[2, 0]], "first_publish": 2, "positions": {}}))
    store.set(header_key(2), json.dumps({"version": 5, "extra": {}}))
    store.set(header_key(3), json.dumps({"version": 6, "extra": {}}))
    while len(published) < 3 and time.monotonic() < deadline and weights.error is None:
        time.sleep(0.01)
    stop.set()
    weights.join(10)
    assert weights.error is None, weights.error
    assert published == [5, 5, 6] and engine.version == 6 and weights.follower.group == "megarl_weight_update_e1"


def test_a_step_is_one_batch_of_applied_optimizer_steps():
    batch = TrainBatch(*(torch.zeros(2, 3) for _ in range(5)), learner_version=4)
    check_trained(0, batch, 4, 5, applied=1)
    check_trained(0, batch, 4, 4, applied=0)  # skipped as non-finite: counted, the version stays
    with pytest.raises(RuntimeError, match="step 3 broke the step invariant"):
        check_trained(3, JoinersWaiting(), 4, 4, applied=0)
    with pytest.raises(RuntimeError, match="version 4 -> 5 after 0 applied"):
        check_trained(3, batch, 4, 5, applied=0)
    with pytest.raises(RuntimeError, match="of 0 rows"):
        check_trained(3, TrainBatch(*(torch.zeros(0, 3) for _ in range(5)), learner_version=4), 4, 5, applied=1)


def test_the_logged_steps_never_skip_or_repeat(tmp_path):
    cfg = load_config(REPO / "configs" / "arithmetic.yaml", [f"run.dir={tmp_path}", "observe.trackers=[]",
                                                            "run.progress=false"], check_files=False)
    outputs = RunOutputs(cfg, 0, {})
    outputs.metrics.log = lambda step, metrics: None
    outputs.console.update = lambda *a: None
    batch_metrics, learner_main.batch_metrics = learner_main.batch_metrics, lambda batch: {}
    source_rewards, learner_main.source_rewards = learner_main.source_rewards, lambda *a: {}
    try:
        batch = SimpleNamespace(num_tokens=1, samples=[])
        wall = [0.0, 1.0, 2.0, 3.0]
        outputs.record(5, batch, {}, wall, {"bytes": 0, "seconds": 0.0}, 5)
        outputs.record(6, batch, {}, wall, {"bytes": 0, "seconds": 0.0}, 6)
        with pytest.raises(RuntimeError, match="step 6 logged after step 6"):
            outputs.record(6, batch, {}, wall, {"bytes": 0, "seconds": 0.0}, 7)
    finally:
        learner_main.batch_metrics, learner_main.source_rewards = batch_metrics, source_rewards
        outputs.close()


def test_train_on_counts_a_critic_warm_up_step_as_a_step_that_moves_no_version():
    cfg = load_config(REPO / "configs" / "arithmetic.yaml", [], check_files=False)

    class Learner:
        version = 3

        def __init__(self, warmup: bool):
            self.warmup = warmup

        def train_step(self, batch):
            if not self.warmup:
                self.version += 1
            return {"loss": 0.1, "grad_norm": 1.0, "skipped_nonfinite": 0.0, "critic/warmup": float(self.warmup)}

    batch = TrainBatch(*(torch.zeros(2, 3) for _ in range(5)), learner_version=3)
    nonfinite = learner_main.NonfiniteSteps(5, "learner", "")
    assert learner_main.train_on(Learner(warmup=True), batch, cfg, 0, nonfinite)["critic/warmup"] == 1.0
    learner_main.train_on(Learner(warmup=False), batch, cfg, 1, nonfinite)
    broken = Learner(warmup=True)
    broken.train_step = lambda batch: {"loss": 0.1, "skipped_nonfinite": 0.0}  # trained, but the version stood
    with pytest.raises(RuntimeError, match="step 2 broke the step invariant"):
        learner_main.train_on(broken, batch, cfg, 2, nonfinite)


def _sync_extra(store, rank: int) -> dict | None:
    return read_record(store, sync_extra_key(rank))


def test_in_sync_mode_the_share_a_lost_sampler_owed_is_asked_of_the_others(store, monkeypatch):
    # Sync mode: each member generates its share (32 / 2 = 16 groups) of every version it receives; the batch is that
    # version's 32 groups. A member dropped mid-batch would leave the step waiting for its share forever: what it had
    # not delivered is asked of the survivors as extra groups of that version, the one owing least first.
    intake = _intake(store, monkeypatch, "algo.mode=sync")
    shares = intake.shares
    shares.start(5, intake.members.members)
    assert _sync_extra(store, 1) is None and _sync_extra(store, 2) is None  # two members cover the batch
    for _ in range(6):  # rank 2 delivered 6 of its 16 before it died
        assert intake._accepts([SimpleNamespace(sampler_rank=2)], {"incarnation": 0})
    intake.drop_sampler(2, "was killed by signal 9 (SIGKILL)")
    assert _sync_extra(store, 1) == {"version": 5, "groups": 10, "incarnation": 0}
    assert not intake._accepts([SimpleNamespace(sampler_rank=2)], {"incarnation": 0})  # its late groups: refused
    shares.done()
    intake.drop_sampler(1, "was killed by signal 9 (SIGKILL)")  # between batches: nothing is asked
    assert _sync_extra(store, 1) == {"version": 5, "groups": 10, "incarnation": 0}
    # The next batch starts with one member (rank 2's replacement has joined, rank 1's not yet): it owes the whole
    # batch, its share and the missing engine's.
    shares.start(6, {2: 1})
    assert _sync_extra(store, 2) == {"version": 6, "groups": 16, "incarnation": 1}
    assert shares.owed == {2: 32}
