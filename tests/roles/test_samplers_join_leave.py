"""`megarl samplers add|remove`, their state changes driven directly (no run): the learner drains a sampler (out of
the publish set for good, its running groups counted lost, never re-admitted), refuses to drain the last one, the
sampler leaves by itself and its keeper starts none; an added rank is taken in and joins the next epoch as a
newcomer; the commands find only a live run of their own user under fault.on_failure=replace, naming why not."""
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from megarl.distributed import run_contact
from megarl.distributed.membership import epoch_key, join_key, remove_key, removed_key
from megarl.roles import sampler_control, sampler_keeper
from megarl.roles.learner_main import STOP_KEY, refresh_members
from tests.roles.test_replace_membership import FakePublisher, _intake, store  # noqa: F401 (store: a fixture)


def _ask(store, rank: int, request: str = "r1") -> None:
    store.set(remove_key(rank), json.dumps({"request": request}))


def test_a_removed_sampler_leaves_the_publish_set_for_good_and_its_running_groups_count_lost(store, monkeypatch):
    intake = _intake(store, monkeypatch)
    intake.members.accepts(2, {"incarnation": 0, "started": 9})
    intake.retired[2] = 5
    _ask(store, 2)
    intake.take_removals()
    assert intake.members.members == {1: 0}
    assert json.loads(store.get(removed_key(2))) == {"request": "r1", "incarnation": 0, "lost": 4}
    assert intake.members.metrics() == {"samplers/alive": 1.0, "samplers/replaced": 0.0, "samplers/rollouts_lost": 4.0}
    assert 2 not in intake.heartbeats.ranks  # its silence from now on is no fault
    assert not intake.members.accepts(2, {"incarnation": 0, "started": 10})  # a late group of it: refused
    publisher = FakePublisher()
    assert refresh_members(intake, publisher, lambda epoch, size: f"epoch {epoch}", version=3)
    assert json.loads(store.get(epoch_key(1)))["members"] == [[1, 0]]  # the next publish reaches exactly the live set
    intake.take_removals()  # answered once
    store.set(join_key(2), "1")  # nothing of that rank is admitted again
    assert intake.members.joins() == []


def test_the_last_live_sampler_and_a_non_member_are_not_removed(store, monkeypatch):
    intake = _intake(store, monkeypatch)
    intake.drop_sampler(1, "was killed by signal 9 (SIGKILL)")
    _ask(store, 1, "a")
    intake.take_removals()
    assert "is not in the publish set" in json.loads(store.get(removed_key(1)))["refused"]
    _ask(store, 2, "b")
    intake.take_removals()
    assert "is the last live sampler" in json.loads(store.get(removed_key(2)))["refused"]
    assert intake.members.members == {2: 0}


def test_the_keeper_lets_a_removed_incarnation_leave_by_itself_starts_none_and_idles_until_the_run_ends(store):
    # Not killed: a sampler killed while it relays a broadcast to the others would fail their receive (gloo's
    # broadcast is a tree). It leaves on the first epoch that leaves it out (SamplerLoop._removed), status 0.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    try:
        store.set(removed_key(1), json.dumps({"request": "r", "incarnation": 0, "lost": 0}))
        assert sampler_keeper._watch(child, store, 1, 0) == (sampler_keeper.REMOVED, 0)
    finally:
        child.kill()
    store.set(removed_key(2), json.dumps({"request": "r", "refused": "the last live sampler"}))
    assert not sampler_keeper.removal_of(store, 2, 0)
    threading.Timer(0.3, lambda: store.set(STOP_KEY, "learner stopped")).start()
    assert sampler_keeper.idle_until_run_ends(store, poll_s=0.05) == 0


def test_a_removed_sampler_leaves_quietly_only_when_the_learner_removed_this_incarnation(store):
    from types import SimpleNamespace

    from megarl.distributed.membership import SamplerDropped
    from megarl.roles.sampler_main import SamplerLoop

    loop = SimpleNamespace(store=store, topo=SimpleNamespace(rank=2), incarnation=1)
    dropped = SamplerDropped("not a member of publish epoch 3")
    assert not SamplerLoop._removed(loop, dropped)  # dropped as dead or hung: its keeper replaces it
    store.set(removed_key(2), json.dumps({"request": "r", "incarnation": 1, "lost": 0}))
    assert SamplerLoop._removed(loop, dropped) and not SamplerLoop._removed(loop, TimeoutError("publish"))
    loop.incarnation = 2
    assert not SamplerLoop._removed(loop, dropped)


def _contact(run_dir, **record):
    return run_contact.write_contact(run_dir, {"store": ["127.0.0.1", 1], "prefix": "megarl/attempt0/",
                                               "secret": "ab" * 32, "sampler_ranks": [1, 2], "world_size": 3,
                                               "num_learners": 1, **record})


def test_the_contact_is_private_and_refused_when_finished_foreign_or_loose(tmp_path, monkeypatch):
    path = _contact(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert run_contact.read_contact(tmp_path)["sampler_ranks"] == [1, 2]
    os.chmod(path, 0o644)
    with pytest.raises(run_contact.ContactError, match="mode 0600"):
        run_contact.read_contact(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = json.loads(path.read_text())
    path.unlink()
    run_contact.write_contact(tmp_path, {})
    path.write_text(json.dumps({**record, "pid": dead.pid}))
    with pytest.raises(run_contact.ContactError, match=f"has finished: its learner \\(pid {dead.pid}\\) is gone"):
        run_contact.read_contact(tmp_path)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(run_contact.ContactError, match="belongs to user .*: only the run's own user"):
        run_contact.read_contact(tmp_path)


def test_the_command_names_fault_on_failure_for_a_run_that_cannot_change_its_samplers(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("fault:\n  on_failure: restart\n")
    assert sampler_control.remove_sampler(str(tmp_path), 0, 5) == 1
    assert "runs with fault.on_failure=restart: samplers join and leave only under fault.on_failure=replace" in \
        capsys.readouterr().out
    (tmp_path / "config.yaml").unlink()
    assert sampler_control.remove_sampler(str(tmp_path), 0, 5) == 1
    assert ".megarl.contact is absent (the run has finished" in capsys.readouterr().out
    _contact(tmp_path)
    (tmp_path / "config.yaml").write_text("fault:\n  on_failure: replace\nsampler:\n  tp: 2\n")
    assert sampler_control.remove_sampler(str(tmp_path), 0, 5) == 1
    assert "sampler.tp=2: each engine spans 2 ranks" in capsys.readouterr().out


def test_the_command_drains_through_the_learner_and_reports_its_answer(store, monkeypatch, tmp_path, capsys):
    intake = _intake(store, monkeypatch)
    port = store.raw.port
    # the run's own key space: the command's store is the run's, prefixed as the workers' is
    import torch.distributed as dist
    from megarl.distributed.signed_store import SignedStore

    prefixed = SignedStore(dist.PrefixStore("megarl/attempt0/", store.raw), b"ab" * 32)
    intake.members.store = intake.store = prefixed
    _contact(tmp_path, store=["127.0.0.1", port])
    stop = threading.Event()

    def learner():  # the lead's wait for groups reads requests every DEAD_CHECK_S
        while not stop.is_set():
            intake.take_removals()
            time.sleep(0.05)

    thread = threading.Thread(target=learner)
    thread.start()
    try:
        assert sampler_control.remove_sampler(str(tmp_path), 5, 5) == 1
        assert "--sampler 5: the run has samplers 0..1" in capsys.readouterr().out
        assert sampler_control.remove_sampler(str(tmp_path), 1, 30) == 0
        assert "megarl: sampler 1 (rank 2) removed from the run in" in capsys.readouterr().out
        assert sampler_control.remove_sampler(str(tmp_path), 0, 30) == 1
        assert "refused by the learner: sampler 0 (rank 1) is the last live sampler" in capsys.readouterr().out
    finally:
        stop.set()
        thread.join(10)
    assert intake.members.members == {1: 0}


def test_an_added_sampler_rank_is_taken_in_joins_the_next_epoch_as_a_newcomer_and_can_be_removed(store, monkeypatch):
    from megarl.distributed.membership import added_key

    intake = _intake(store, monkeypatch)
    lines = []
    intake.members.note = lines.append
    store.set(added_key(1), json.dumps({"rank": 3}))
    publisher = FakePublisher()
    intake.members.discover()
    assert intake.members.members == {1: 0, 2: 0}  # not ready yet: no join record
    store.set(join_key(3), "1")  # its first incarnation (1) is ready
    assert refresh_members(intake, publisher, lambda epoch, size: f"epoch {epoch}", version=4)
    record = json.loads(store.get(epoch_key(1)))
    assert record["members"] == [[1, 0], [2, 0], [3, 1]]
    assert record["positions"] == {"3": {"cursor": 0, "above": []}}  # a new stream: from index 0
    assert lines == ["megarl: sampler 2 (rank 3): added joins the publish set at version 4"]
    assert 3 in intake.heartbeats.ranks and intake.members.metrics()["samplers/alive"] == 3.0
    _ask(store, 3)
    intake.take_removals()
    assert intake.members.members == {1: 0, 2: 0}


def test_add_is_refused_for_real_sglang_eval_sets_sync_mode_and_engines_of_several_ranks_by_name(tmp_path, capsys):
    assert sampler_control.add_refusal({"sampler": {"engine": "builtin"}, "eval": {"sets": []}}) is None
    assert sampler_control.add_refusal({"sampler": {"engine": "vllm"}}) is None  # (tests/sampler/vllm/)
    assert sampler_control.add_refusal({"sampler": {"engine": "sglang", "sglang": {"server": "builtin"}}}) is None
    assert sampler_control.add_refusal({"sampler": {"engine": "sglang", "sglang": {"server": "sglang"}}}).startswith(
        "sampler.sglang.server=sglang: `megarl samplers add` starts built-in engines, vLLM servers and megarl's")
    assert sampler_control.add_refusal({"eval": {"sets": [{"name": "x"}]}}).startswith("eval.sets:")
    assert sampler_control.add_refusal({"algo": {"mode": "sync"}}).startswith("algo.mode=sync:")
    assert sampler_control.add_refusal({"sampler": {"tp": 2}}) == (
        "sampler.tp=2: each engine spans 2 ranks, and `megarl samplers add`/`remove` start or drain one rank")
    (tmp_path / "config.yaml").write_text("fault:\n  on_failure: stop\n")
    assert sampler_control.add_sampler(str(tmp_path), []) == 1
    assert "runs with fault.on_failure=stop" in capsys.readouterr().out
    _contact(tmp_path)
    (tmp_path / "config.yaml").write_text("fault:\n  on_failure: replace\nsampler:\n  engine: sglang\n  sglang:\n"
                                          "    server: sglang\n")
    assert sampler_control.add_sampler(str(tmp_path), []) == 1
    assert "sampler.sglang.server=sglang: `megarl samplers add` starts built-in engines, vLLM servers and megarl's " \
           "SGLang-compatible server" in capsys.readouterr().out


def test_a_stop_signal_to_the_add_command_asks_to_remove_its_sampler_instead_of_stopping_the_run(store):
    import signal

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        sampler_control.leave_on_signal(store, 3)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # the handler runs in the main thread at the next bytecode
        assert "request" in json.loads(store.get(remove_key(3)))
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL  # a second signal ends the command
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
