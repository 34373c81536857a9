"""A sampler rank's keeper (fault.on_failure=replace), its children stand-in processes that exit with a given status:
an incarnation that fails with an error before it sent its first group is not replaced (the run stops, naming
why), one that fails after it served is."""
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from megarl.distributed import lifetime
from megarl.distributed.membership import dead_key, served_key
from megarl.roles import sampler_keeper
from megarl.roles.learner_main import STOP_KEY
from tests.roles.test_replace_membership import store  # noqa: F401 (a fixture)

TOPO = SimpleNamespace(rank=1, role_rank=0)
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
