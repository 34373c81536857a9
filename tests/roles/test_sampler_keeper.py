"""A sampler rank's keeper (fault.on_failure=replace), its children stand-in processes that exit with a given status:
an incarnation that fails with an error before it sent its first group is not replaced (the run stops, naming
why), one that fails after it served is."""
import json
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from megarl.distributed import lifetime
from megarl.distributed.membership import dead_key, replace_key, served_key
from megarl.distributed.ranks import Topology
from megarl.roles import sampler_keeper
from megarl.roles.learner_main import STOP_KEY
from tests.roles.test_replace_membership import store  # noqa: F401 (a fixture)

TOPO = Topology(rank=1, world_size=2, num_learners=1, num_samplers=1)
CFG = SimpleNamespace(fault=SimpleNamespace(max_sampler_restarts_per_hour=6))


def _children(monkeypatch, store, statuses: list[int], served: list[bool]) -> list[int]:
    """Each incarnation the keeper starts exits with the next of `statuses` (having sent a group where `served`
    says so); one that exits 0 finds the run stopped. The incarnations started, in order."""
    started = []
    real_popen = subprocess.Popen

    def popen(argv, env, **kwargs):
        incarnation = int(env["MEGARL_SAMPLER_INCARNATION"])
        i = len(started)
        started.append(incarnation)
        if served[i]:
            store.set(served_key(TOPO.rank), str(incarnation))
        if statuses[i] == 0:  # it leaves with the run
            store.set(STOP_KEY, "learner stopped")
        return real_popen([sys.executable, "-c", f"import sys; sys.exit({statuses[i]})"], env=env, **kwargs)

    monkeypatch.setattr(sampler_keeper.subprocess, "Popen", popen)
    return started


def test_a_sampler_that_fails_before_its_first_group_is_not_replaced_and_the_run_stops(store, monkeypatch):
    started = _children(monkeypatch, store, [1], served=[False])
    with pytest.raises(SystemExit) as stopped:
        sampler_keeper.keep_sampler([], CFG, TOPO, store)
    assert started == [0]
    assert str(stopped.value.code) == ("megarl: sampler 0 (rank 1) exited with code 1 before it sent its first group: "
                                       "not replaced (a start-up error, which a replacement would repeat; its error "
                                       "is above)")
    assert store.check([dead_key(TOPO.rank)])  # the learner drops it (an added sampler's keeper stops no run)


def test_a_sampler_that_fails_after_it_served_is_replaced(store, monkeypatch):
    started = _children(monkeypatch, store, [1, 0], served=[True, False])
    with pytest.raises(SystemExit) as ended:
        sampler_keeper.keep_sampler([], CFG, TOPO, store)
    assert started == [0, 1]
    assert ended.value.code == 0  # the replacement left with the run
    assert store.check([dead_key(TOPO.rank)])


def test_a_replacement_that_fails_before_its_first_group_stops_the_run_though_its_predecessor_served(store,
                                                                                                   monkeypatch):
    started = _children(monkeypatch, store, [1, 1], served=[True, False])
    with pytest.raises(SystemExit) as stopped:
        sampler_keeper.keep_sampler([], CFG, TOPO, store)
    assert started == [0, 1]
    assert "exited with code 1 before it sent its first group: not replaced" in str(stopped.value.code)


def test_a_sampler_stopped_at_start_up_by_a_signal_the_keeper_also_received_ends_the_rank_with_its_status(
        store, monkeypatch):
    # The sampler left as a stopped rank does (128 + SIGTERM) before it sent a group: the run's stop, no failure.
    started = _children(monkeypatch, store, [128 + signal.SIGTERM], served=[False])
    stand_in = sampler_keeper.subprocess.Popen

    def stopped_first(*args, **kwargs):  # the signal reached the sampler first: it is gone before the keeper looks
        child = stand_in(*args, **kwargs)
        child.wait()
        monkeypatch.setattr(lifetime, "_received", (signal.SIGTERM, time.monotonic()))
        return child

    monkeypatch.setattr(sampler_keeper.subprocess, "Popen", stopped_first)
    with pytest.raises(SystemExit) as stopped:
        sampler_keeper.keep_sampler([], CFG, TOPO, store)
    assert started == [0] and stopped.value.code == 128 + signal.SIGTERM


def _engine_keepers(monkeypatch, store, cfg=CFG) -> tuple[dict, dict, list[threading.Thread]]:
    """The keepers of one engine spanning two ranks (lead rank 1, follower rank 2 of a 1-learner run), each in a
    thread, their samplers stand-in processes that run until killed. (rank, incarnation) -> its sampler's Popen,
    rank -> how the keeper ended, and the threads."""
    children, ended = {}, {}
    real_popen = subprocess.Popen

    def popen(argv, env, **kwargs):
        child = real_popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env, **kwargs)
        children[(int(argv[-1]), int(env["MEGARL_SAMPLER_INCARNATION"]))] = child  # its keeper's rank, as argv
        return child

    monkeypatch.setattr(sampler_keeper.subprocess, "Popen", popen)

    def keep(rank: int) -> None:
        topo = Topology(rank=rank, world_size=3, num_learners=1, num_samplers=2, sampler_tp=2)
        try:
            sampler_keeper.keep_sampler([str(rank)], cfg, topo, store)
        except SystemExit as exc:
            ended[rank] = exc.code

    threads = [threading.Thread(target=keep, args=(rank,)) for rank in (1, 2)]
    for thread in threads:
        thread.start()
    _until(lambda: (1, 0) in children and (2, 0) in children)
    return children, ended, threads


def _until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("fault", ["follower killed", "lead hung"])
def test_an_engine_of_several_ranks_is_replaced_whole_whichever_rank_fails(fault, store, monkeypatch):
    # A follower rank's sampler is SIGKILLed: its keeper records it, the lead's keeper kills the lead's sampler and
    # records the engine's end, naming the follower; or the learner asks the lead's keeper to replace a hung lead: the
    # follower's keeper kills its own on the lead's record. Either way both ranks start incarnation 1 together.
    children, ended, threads = _engine_keepers(monkeypatch, store)
    if fault == "follower killed":
        children[(2, 0)].kill()
    else:
        store.set(replace_key(1), json.dumps({"incarnation": 0, "cause": "no heartbeat for 20s"}))
    _until(lambda: (1, 1) in children and (2, 1) in children)
    assert children[(1, 0)].wait(10) == -signal.SIGKILL and children[(2, 0)].wait(10) == -signal.SIGKILL
    record = json.loads(store.get(dead_key(1)))  # what the learner drops the engine for
    cause = "lost its TP rank 1 (rank 2), which was killed by signal 9 (SIGKILL)" if fault == "follower killed" \
        else "hung (no heartbeat for 20s)"
    assert record == {"incarnation": 0, "cause": cause, "code": -signal.SIGKILL}
    store.set(STOP_KEY, "learner stopped")  # the run ends: the replacements leave with it, none is replaced again
    for rank in (1, 2):
        children[(rank, 1)].kill()
    for thread in threads:
        thread.join(30)
    assert ended == {1: 0, 2: 0} and sorted(children) == [(1, 0), (1, 1), (2, 0), (2, 1)]


def test_the_lead_keeper_counts_an_engines_replacements_against_the_hourly_limit(store, monkeypatch):
    # One replacement an hour: the engine's second end stops the run from its lead's keeper (torchrun then stops every
    # rank; here the run's end does), naming the follower whose end it was.
    cfg = SimpleNamespace(fault=SimpleNamespace(max_sampler_restarts_per_hour=1))
    children, ended, threads = _engine_keepers(monkeypatch, store, cfg)
    children[(2, 0)].kill()
    _until(lambda: (1, 1) in children and (2, 1) in children)
    children[(2, 1)].kill()
    _until(lambda: 1 in ended)
    assert ended[1] == ("megarl: sampler 0 (rank 1) lost its TP rank 1 (rank 2), which was killed by signal 9 "
                        "(SIGKILL): 2 ends within an hour, over fault.max_sampler_restarts_per_hour=1, so the run "
                        "stops")
    store.set(STOP_KEY, "learner stopped")
    _until(lambda: (2, 2) in children or 2 in ended)
    for child in children.values():
        child.kill()
    for thread in threads:
        thread.join(30)
    assert ended[2] == 0 and (1, 2) not in children
