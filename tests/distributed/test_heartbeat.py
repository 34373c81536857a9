"""Heartbeats through a real TCPStore: a sampler that stops beating is named once the timeout passes; forged
values neither end the run nor make a beating sampler look hung."""
import time

import pytest

from megarl.distributed.heartbeat import Heartbeat, HeartbeatMonitor, SamplerHungError, heartbeat_key
from tests.helpers import signed_loopback_store

KEY = b"k" * 32


@pytest.fixture
def store():
    return signed_loopback_store(KEY, timeout_s=10)


def test_beating_samplers_pass_and_a_silent_one_is_named(store):
    beats = {r: Heartbeat(store, r, period_s=0.0) for r in (1, 2)}
    monitor = HeartbeatMonitor(store, [1, 2], timeout_s=0.3, check_every_s=0.0)
    deadline = time.monotonic() + 0.8
    while time.monotonic() < deadline:  # both beat: never raises, well past the timeout
        for beat in beats.values():
            beat.beat()
        monitor.check(num_learners=1)
        time.sleep(0.02)
    with pytest.raises(SamplerHungError, match=r"sampler rank 2 \(sampler 1\) stopped beating.*sampler_timeout_s=0.3"):
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            beats[1].beat()  # rank 2 went silent
            monitor.check(num_learners=1)
            time.sleep(0.02)


def test_a_sampler_that_never_beats_is_named_after_the_timeout(store):
    monitor = HeartbeatMonitor(store, [3], timeout_s=0.2, check_every_s=0.0)
    monitor.check()  # within the timeout: fine
    time.sleep(0.3)
    with pytest.raises(SamplerHungError, match="sampler rank 3 .* has not started its loop"):
        monitor.check()


def test_a_resumed_publish_waits_for_every_sampler_to_start_and_names_one_that_never_does(store):
    """A restarted sampler starts its engine (a vLLM server: tens of seconds) before its loop beats; the learner's
    resumed publish waits for every first beat, under fault.sampler_timeout_s, not the broadcast's timeout."""
    import threading

    monitor = HeartbeatMonitor(store, [1, 2], timeout_s=5.0)
    late = threading.Timer(0.3, Heartbeat(store, 2, period_s=0.0).beat)  # sampler 1 starts later than sampler 0
    Heartbeat(store, 1, period_s=0.0).beat()
    late.start()
    started = time.monotonic()
    monitor.wait_started(num_learners=1, poll_s=0.02)
    assert time.monotonic() - started >= 0.25  # it waited for sampler 1's first beat
    never = HeartbeatMonitor(store, [1, 3], timeout_s=0.2)
    with pytest.raises(SamplerHungError, match=r"sampler rank 3 \(sampler 2\) did not start its loop within "
                                               r"fault.sampler_timeout_s=0.2s") as caught:
        never.wait_started(num_learners=1, poll_s=0.02)
    assert caught.value.rank == 3


def test_beats_are_rate_limited(store):
    beat = Heartbeat(store, 5, period_s=60.0)
    beat.beat()
    beat.beat()
    assert store.get(heartbeat_key(store, 5)) == b"1"


def test_observed_only_now_and_then_a_quiet_sampler_is_still_named(store):
    """A publish source observes the counters once per publish; when a broadcast then times out, the
    samplers that did not move since are named with how long they have been quiet."""
    beats = {r: Heartbeat(store, r, period_s=0.0) for r in (1, 2)}
    monitor = HeartbeatMonitor(store, [1, 2], timeout_s=60, check_every_s=0.0)
    for beat in beats.values():
        beat.beat()
    monitor.observe()  # before the publish
    time.sleep(0.4)  # the broadcast hangs; sampler 1 keeps beating, sampler 2 does not
    beats[1].beat()
    quiet = monitor.silent(num_learners=1, min_s=0.3)
    assert quiet.startswith("sampler rank 2 (sampler 1) has sent no heartbeat for") and "rank 1 " not in quiet


def test_a_sampler_that_died_just_before_the_failure_is_named_not_reported_current(store, monkeypatch):
    """A broadcast fails at once when a receiver dies (connection reset): nobody has been quiet for long
    yet, so the monitor watches a moment more and names the counter that no longer moves. The live samplers beat
    at every pause of the monitor's watch (its `time.sleep`), so what it sees does not depend on how a loaded
    machine schedules threads."""
    from megarl.distributed import heartbeat

    beats = {r: Heartbeat(store, r, period_s=0.0) for r in (1, 2)}
    monitor = HeartbeatMonitor(store, [1, 2], timeout_s=60, check_every_s=0.0)
    for beat in beats.values():
        beat.beat()
    monitor.observe()
    turning = [1]  # sampler 2 (rank 2) has just died

    class TurningWhileWatched:
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(seconds: float) -> None:
            for rank in turning:
                beats[rank].beat()
            time.sleep(seconds)

    monkeypatch.setattr(heartbeat, "time", TurningWhileWatched)
    assert monitor.silent(num_learners=1, min_s=0.5) == \
        "sampler rank 2 (sampler 1) has sent no heartbeat since (watched 0.5s): it died or hung"
    beats[2].beat()
    turning.append(2)
    assert monitor.silent(num_learners=1, min_s=0.5) == "every sampler's heartbeat kept moving for 0.5s after the failure"


def test_a_forged_value_alternating_with_a_replayed_genuine_one_is_counted_and_ignored(store):
    """Worst case, an outsider that knows the counter's key: it writes back an older genuine value and a
    forged one in turn. The monitor neither crashes nor takes either for a beat; the genuine beats still count."""
    beat = Heartbeat(store, 1, period_s=0.0)
    monitor = HeartbeatMonitor(store, [1], timeout_s=60, check_every_s=0.0)
    key = heartbeat_key(store, 1)
    beat.beat()
    replay = store.raw.get(key)  # the signed "1"
    beat.beat()
    monitor.check()
    assert monitor.last_value == {1: 2}
    for _ in range(5):
        store.raw.set(key, replay)
        monitor.check()
        store.raw.set(key, b"1000")
        monitor.check()
    assert monitor.last_value == {1: 2} and monitor.forged[1] == 5
    beat.beat()
    monitor.check()
    assert monitor.last_value == {1: 3}


def test_a_steady_flood_of_forged_heartbeats_does_not_make_a_beating_sampler_look_hung(store):
    """An outsider overwrites every heartbeat key it can name right after each genuine beat (a flood that
    always wins the race): every beat is still recognised at the monitor's next look."""
    beat = Heartbeat(store, 1, period_s=0.0)
    monitor = HeartbeatMonitor(store, [1], timeout_s=60, check_every_s=0.0)
    for count in range(1, 6):
        beat.beat()
        for name in ("heartbeat/1", "megarl/heartbeat/1", "heartbeat/1/0"):
            store.raw.set(name, b"9999")
        monitor.observe()
        assert monitor.last_value == {1: count}
    assert monitor.forged[1] == 0
