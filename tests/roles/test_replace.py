"""fault.on_failure=replace, for real: a sampler killed, hung, or whose server dies is replaced while the learner
trains on, under every publish layout, sync mode, an engine of several ranks, SGLang servers and evaluation; samplers
added to and removed from a running job. Each run is checked step by step: none skipped or trained twice, and every
group of a replacement carries a version it ran."""
import collections
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import train_metrics
from tests.roles.fault_runs import (
    REPLACE_PUBLISH_TIMEOUT_S, Logged, finish, leftovers, remove_added, samplers_command,
    start_run, wait_for_steps, worker_processes,
)


def _sampler_processes(run_dir) -> dict[tuple[int, int], int]:
    """(RANK, incarnation) -> pid of the live sampler processes of a fault.on_failure=replace run (a sampler rank's
    keeper, the torchrun worker, has no incarnation in its environment and is left out)."""
    return {(int(env[b"RANK"]), int(env[b"MEGARL_SAMPLER_INCARNATION"])): pid
            for pid, env in worker_processes(run_dir) if b"MEGARL_SAMPLER_INCARNATION" in env}


# That worst case (3 x 20 s), the replacement's process start and imports (minutes on a loaded 2-core machine) and
# the steps asked for after its join.
REJOIN_TIMEOUT_S = 360


def _replace_run(run_dir, model_dir, *overrides) -> Logged:
    return start_run(run_dir, model_dir, "fault.on_failure=replace", "sampler.num_engines=2", "run.log_rollouts=true",
                  *overrides)


def _wait_for_rejoin(run_dir, proc: Logged, replaced: int = 1, more_steps: int = 4,
                     timeout: float = REJOIN_TIMEOUT_S, alive: int = 2) -> None:
    """Until the replacements have joined (samplers/alive back at `alive` after samplers/replaced rose to `replaced`)
    and `more_steps` steps were trained since."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = train_metrics(run_dir)
        back = [m["step"] for m in metrics
                if m.get("samplers/replaced") == float(replaced) and m.get("samplers/alive") == float(alive)]
        if back and metrics[-1]["step"] >= back[0] + more_steps:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    last = {k: v for k, v in (train_metrics(run_dir) or [{}])[-1].items() if k == "step" or k.startswith("samplers/")}
    raise AssertionError(f"no replacement joined and trained {more_steps} steps within {timeout}s; last step's "
                         f"metrics: {last}; the run's stderr ends:\n{proc.stderr_tail()}")


def _check_replaced(run_dir, out: str, err: str, rank: int, replaced: int = 1, learners: int = 1,
                    alive: int = 2) -> None:
    """Stopped by SIGTERM at a step boundary with every step once, in order; the replacement of `rank` (of a run with
    `learners` learner ranks) joined at a version V and none of its trained groups carries an older one (it generated
    nothing before it ran V; its first token may come from V + 1 when that version landed first, the pipeline's
    in-flight update)."""
    metrics = train_metrics(run_dir)
    steps = len(metrics)
    assert f"megarl: stopped by SIGTERM after {steps} steps" in out, err[-3000:]
    assert [m["step"] for m in metrics] == list(range(steps))  # none skipped, none trained twice
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    joined = [int(v) for v in re.findall(
        rf"sampler {rank - learners} \(rank {rank}\): replacement 1 joins the publish set at version (\d+)", out)]
    assert len(joined) == 1, out[-3000:]
    rollouts = [json.loads(line) for line in (Path(run_dir) / "rollouts.jsonl").read_text().splitlines()]
    after = [r for r in rollouts if r["sampler_rank"] == rank and r["trained_at_step"] >= joined[0]]
    assert after, "the replacement contributed no group"
    assert all(min(r["versions"]) >= joined[0] for r in after), (joined, [r["versions"][:1] for r in after[:4]])
    ids = [r["group_id"] for r in rollouts]
    assert len(set(ids)) * 8 == len(ids)  # no group trained twice (8 samples per group)
    assert metrics[-1]["samplers/alive"] == float(alive) and metrics[-1]["samplers/replaced"] == float(replaced)


@pytest.mark.timeout(900)  # the waits above (240 s to the first steps, REJOIN_TIMEOUT_S, 120 s to finish) bound it
@pytest.mark.parametrize("victims", [(1,), (1, 2)])
def test_with_replace_a_killed_sampler_is_replaced_and_the_run_goes_on(victims, embedded_think_model_dir, tmp_path):
    # (1, 2): every sampler at once; no group can come until a replacement has the weights, which the learner then
    # publishes in place of a batch (learner_main.JoinersWaiting).
    run_dir = tmp_path / "replace_kill"
    proc = _replace_run(run_dir, embedded_think_model_dir, f"publish.timeout_s={REPLACE_PUBLISH_TIMEOUT_S}")
    wait_for_steps(run_dir, 3, proc)
    pids = _sampler_processes(run_dir)
    for rank in victims:
        os.kill(pids[(rank, 0)], signal.SIGKILL)
    _wait_for_rejoin(run_dir, proc, replaced=len(victims))
    proc.send_signal(signal.SIGTERM)
    out, err, took = finish(proc, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    for rank in victims:
        assert f"megarl: sampler {rank - 1} (rank {rank}) was killed by signal 9 (SIGKILL): dropped from the publish " \
               f"set, replacement 1 starting; " in out, out[-3000:]
        _check_replaced(run_dir, out, err, rank, replaced=len(victims))
    assert not leftovers(run_dir)


@pytest.mark.timeout(900)  # the waits above (240 s to the first steps, REJOIN_TIMEOUT_S, 120 s to finish) bound it
@pytest.mark.parametrize("layout", ["learner.pp=2", "learner.dp=2 publish.senders=2"])
def test_with_replace_a_sampler_of_a_several_source_publish_is_replaced_and_the_run_goes_on(layout,
                                                                                             embedded_think_model_dir,
                                                                                             tmp_path):
    # Two publish sources (each pipeline stage its layers; each sender its share of the buckets), two learner ranks:
    # learner rank 0 forms each membership epoch and the other source builds its part's group of it; the replacement
    # receives both parts of the version current at its join before it generates (_check_replaced).
    run_dir = tmp_path / "replace_parts"
    proc = _replace_run(run_dir, embedded_think_model_dir, f"publish.timeout_s={REPLACE_PUBLISH_TIMEOUT_S}",
                        *layout.split())
    wait_for_steps(run_dir, 3, proc)
    os.kill(_sampler_processes(run_dir)[(2, 0)], signal.SIGKILL)  # ranks 0 and 1 learn; sampler 0 is rank 2
    _wait_for_rejoin(run_dir, proc)
    proc.send_signal(signal.SIGTERM)
    out, err, took = finish(proc, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "megarl: sampler 0 (rank 2) was killed by signal 9 (SIGKILL): dropped from the publish set, replacement 1 " \
           "starting; " in out, out[-3000:]
    _check_replaced(run_dir, out, err, 2, learners=2)
    assert not leftovers(run_dir)


@pytest.mark.timeout(900)  # the waits above (240 s to the first steps, REJOIN_TIMEOUT_S, 120 s to finish) bound it
def test_with_replace_in_sync_mode_a_killed_sampler_is_replaced_and_every_step_trains_one_whole_batch(embedded_think_model_dir, tmp_path):
    # algo.mode=sync: each version's batch is each sampler's share (4 prompts / 2 samplers) generated on that version.
    # Whatever the killed sampler owed is asked of the survivor (membership.SyncShares) or, when the replacement joins
    # the epoch of the next version first, generated by it: which one depends on where in a step the kill lands (the
    # asking itself: test_replace_membership.py::test_in_sync_mode_the_share_a_lost_sampler_owed_is_asked_of_the_others).
    # Either way every step trains exactly one whole batch of its own version, and the run goes on.
    run_dir = tmp_path / "replace_sync"
    proc = _replace_run(run_dir, embedded_think_model_dir, f"publish.timeout_s={REPLACE_PUBLISH_TIMEOUT_S}",
                        "algo.mode=sync")
    wait_for_steps(run_dir, 3, proc)
    os.kill(_sampler_processes(run_dir)[(1, 0)], signal.SIGKILL)
    _wait_for_rejoin(run_dir, proc)
    proc.send_signal(signal.SIGTERM)
    out, err, took = finish(proc, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "megarl: sampler 0 (rank 1) was killed by signal 9 (SIGKILL): dropped from the publish set, replacement 1 " \
           "starting; " in out, out[-3000:]
    _check_replaced(run_dir, out, err, 1)
    rollouts = [json.loads(line) for line in (Path(run_dir) / "rollouts.jsonl").read_text().splitlines()]
    per_step = collections.Counter(r["trained_at_step"] for r in rollouts)
    assert set(per_step.values()) == {4 * 8}, per_step  # 4 groups of 8 samples in every step
    assert all(set(r["versions"]) == {r["trained_at_step"]} for r in rollouts)  # each generated on its step's version
    assert not leftovers(run_dir)


@pytest.mark.timeout(1200)  # the waits above (240 s to the first steps, 2 x REJOIN_TIMEOUT_S, 120 s to finish) bound it
def test_with_replace_an_engine_of_two_ranks_that_loses_one_is_replaced_whole_and_the_run_goes_on(
        embedded_think_model_dir, tmp_path):
    # One built-in engine over two ranks (sampler.tp=2; learner.tp=1: each rank keeps its slices of the whole tensors
    # published to both). Its follower rank is SIGKILLed (the lead's keeper then kills the lead), then, once the
    # replacement trains, the replacement's lead (the follower's keeper then kills the follower). Each time the engine
    # is one sampler: the learner drops it, both ranks start the next incarnation, whose TP group forms afresh, and it
    # receives the version current at its join before it generates. With no sampler left meanwhile the learner waits
    # for the replacement and publishes to it at once (learner_main.JoinersWaiting). Shard to shard (learner.tp=2)
    # every epoch's publish carries each source's slices
    # (test_replace_membership.py::test_shard_to_shard_every_epochs_publish_carries_the_sources_own_slices).
    run_dir = tmp_path / "replace_tp"
    proc = start_run(run_dir, embedded_think_model_dir, "fault.on_failure=replace", "sampler.num_engines=1",
                  "sampler.tp=2", "run.log_rollouts=true", f"publish.timeout_s={REPLACE_PUBLISH_TIMEOUT_S}")
    wait_for_steps(run_dir, 3, proc)
    for incarnation, victim in enumerate((2, 1)):  # the follower of the first incarnation, the lead of the second
        pids = _sampler_processes(run_dir)
        assert sorted(pids) == [(1, incarnation), (2, incarnation)]
        os.kill(pids[(victim, incarnation)], signal.SIGKILL)
        _wait_for_rejoin(run_dir, proc, replaced=incarnation + 1, alive=1)
    assert sorted(_sampler_processes(run_dir)) == [(1, 2), (2, 2)]  # both ranks replaced together, each time
    proc.send_signal(signal.SIGTERM)
    out, err, took = finish(proc, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    for cause, replacement in (("lost its TP rank 1 (rank 2), which was", 1), ("was", 2)):
        assert f"megarl: sampler 0 (rank 1) {cause} killed by signal 9 (SIGKILL): dropped from the publish set, " \
               f"replacement {replacement} starting; " in out, out[-3000:]
    _check_replaced(run_dir, out, err, 1, replaced=2, alive=1)
    joined = [int(v) for v in re.findall(r"sampler 0 \(rank 1\): replacement 2 joins the publish set at version (\d+)",
                                         out)]
    rollouts = [json.loads(line) for line in (Path(run_dir) / "rollouts.jsonl").read_text().splitlines()]
    after = [r for r in rollouts if r["trained_at_step"] >= joined[0]]
    assert len(joined) == 1 and after and all(min(r["versions"]) >= joined[0] for r in after), (joined, out[-3000:])
    # every trained token carries the version it was sampled on (none newer than the step's weights) and its log-prob
    # under it
    for r in rollouts:
        assert len(r["versions"]) == len(r["behaviour_logprobs"]) == len(r["token_ids"]) > 0, r
        assert r["versions"] == sorted(r["versions"]) and r["versions"][-1] <= r["trained_at_step"], r
        assert all(-1e4 < lp <= 0.0 for lp in r["behaviour_logprobs"]), r
    assert not leftovers(run_dir)


def _server_processes(sampler_pid: int, module: bytes) -> list[int]:
    """The pids of the server processes (`python -m <module>`) a sampler process started."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == sampler_pid and module in args:
            found.append(int(proc.name))
    return found


@pytest.mark.timeout(900)  # the waits above (240 s to the first steps, REJOIN_TIMEOUT_S, 120 s to finish) bound it
def test_with_replace_a_killed_sglang_server_is_replaced_and_the_run_goes_on(embedded_think_model_dir, tmp_path):
    # The SGLang-compatible server of sampler 0 is SIGKILLed: its sampler fails on it, the keeper starts a new
    # sampler and server, which joins a later membership epoch's weight-update group (sglang_publish.join_epoch).
    run_dir = tmp_path / "replace_sglang"
    proc = _replace_run(run_dir, embedded_think_model_dir, "sampler.engine=sglang")
    wait_for_steps(run_dir, 3, proc)
    servers = _server_processes(_sampler_processes(run_dir)[(1, 0)], b"megarl.sampler.sglang_server")
    assert len(servers) == 1, servers
    os.kill(servers[0], signal.SIGKILL)
    _wait_for_rejoin(run_dir, proc)
    proc.send_signal(signal.SIGTERM)
    out, err, took = finish(proc, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert re.search(r"megarl: sampler 0 \(rank 1\) exited with code \d+: dropped from the publish set, "
                     r"replacement 1 starting; \d+ unfinished groups? lost", out), out[-3000:]
    _check_replaced(run_dir, out, err, 1)
    assert not leftovers(run_dir)


@pytest.mark.timeout(900)  # the waits above (240 s to the first steps, REJOIN_TIMEOUT_S, 120 s to finish) bound it
def test_with_replace_and_eval_sets_a_replacement_evaluates_from_its_join_on(embedded_think_model_dir, tmp_path):
    # eval.sets under replace: the replacement evaluates its share of every due version from the one it joined at;
    # its predecessor's unposted shares of earlier versions are posted as missed (reported so, never waited for).
    run_dir = tmp_path / "replace_eval"
    proc = _replace_run(run_dir, embedded_think_model_dir, f"publish.timeout_s={REPLACE_PUBLISH_TIMEOUT_S}",
                        "eval.sets=[{name: heldout, prompts: 4}]",
                        "eval.every_steps=2", "eval.samples=2", "eval.k=2", "eval.at_start=false")
    wait_for_steps(run_dir, 3, proc)
    os.kill(_sampler_processes(run_dir)[(1, 0)], signal.SIGKILL)
    _wait_for_rejoin(run_dir, proc, more_steps=8)
    proc.send_signal(signal.SIGTERM)
    out, err, took = finish(proc, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    _check_replaced(run_dir, out, err, 1)
    joined = int(re.search(r"sampler 0 \(rank 1\): replacement 1 joins the publish set at version (\d+)", out)[1])
    missed = [int(v) for v in re.findall(r"megarl: eval of version (\d+) not reported: sampler engine 0 was replaced",
                                         out)]
    assert all(v < joined for v in missed), out[-3000:]
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    evaluated = sorted(r["eval_version"] for r in records if r.get("kind") == "eval")
    assert [v for v in evaluated if v >= joined], (joined, evaluated, out[-3000:])
    assert not set(evaluated) & set(missed)
    assert set(range(2, joined, 2)) <= set(evaluated) | set(missed)  # every due version before the join accounted
    assert out.count("not reported") == len(missed), out[-3000:]  # no version of a live share missed
    assert not leftovers(run_dir)


@pytest.mark.timeout(900)  # the waits above (240 s to the first steps, REJOIN_TIMEOUT_S, 120 s to finish) bound it
def test_with_replace_a_hung_sampler_is_replaced_and_the_run_goes_on(embedded_think_model_dir, tmp_path):
    run_dir = tmp_path / "replace_hang"
    proc = _replace_run(run_dir, embedded_think_model_dir, "fault.sampler_timeout_s=4",
                        f"publish.timeout_s={REPLACE_PUBLISH_TIMEOUT_S}", "queue.timeout_s=120")
    wait_for_steps(run_dir, 3, proc)
    os.kill(_sampler_processes(run_dir)[(2, 0)], signal.SIGSTOP)  # its keeper SIGKILLs it when the learner asks
    _wait_for_rejoin(run_dir, proc)
    proc.send_signal(signal.SIGTERM)
    out, err, took = finish(proc, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    # Named by its silent heartbeat, while the learner waits for groups or once a publish to it timed out.
    assert re.search(r"megarl: sampler 1 \(rank 2\) hung: no heartbeat for \d+s.*: dropped from the publish set, "
                     r"replacement 1 starting; \d+ unfinished groups? lost", out), out[-3000:]
    _check_replaced(run_dir, out, err, 2)
    assert not leftovers(run_dir)




def _adding_sampler(run_dir) -> Logged:
    """`megarl samplers add RUN_DIR` in the foreground of a second process (it keeps the added sampler)."""
    return Logged([sys.executable, "-m", "megarl.cli", "samplers", "add", str(run_dir)], Path(f"{run_dir}.add"),
                   merge_stderr=True)


def _wait_for_metric(run_dir, proc: Logged, key: str, value: float, more_steps: int,
                     timeout: float = REJOIN_TIMEOUT_S) -> int:
    """Until a step logged `key` == `value` and `more_steps` more steps followed; that first step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = train_metrics(run_dir)
        hit = [m["step"] for m in metrics if m.get(key) == value]
        if hit and metrics[-1]["step"] >= hit[0] + more_steps:
            return hit[0]
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    raise AssertionError(f"no step with {key}={value} and {more_steps} steps after it within {timeout}s; the run's "
                         f"stderr ends:\n{proc.stderr_tail()}")


@pytest.mark.timeout(1800)  # 240 s to the first steps, 3 x REJOIN_TIMEOUT_S, the commands, 120 s to finish
def test_with_replace_a_sampler_added_from_a_second_process_joins_and_removed_ones_stop(embedded_think_model_dir,
                                                                                          tmp_path):
    run_dir = tmp_path / "add_remove"
    proc = _replace_run(run_dir, embedded_think_model_dir, f"publish.timeout_s={REPLACE_PUBLISH_TIMEOUT_S}")
    wait_for_steps(run_dir, 3, proc)
    added = _adding_sampler(run_dir)
    try:
        _wait_for_metric(run_dir, proc, "samplers/alive", 3.0, more_steps=4)
        assert (3, 1) in _sampler_processes(run_dir)  # the added rank's first incarnation, kept by the command
        added_out = remove_added(run_dir, added, 2)
    finally:
        if added.poll() is None:
            added.kill()
    assert "megarl: sampler 2 (rank 3) added to the run in" in added_out, added_out[-3000:]
    assert "megarl: sampler 2 (rank 3) removed (megarl samplers remove): incarnation 1 stopped" in added_out
    removed = samplers_command("remove", str(run_dir), "--sampler", "1")  # one the run started with
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert re.search(r"megarl: sampler 1 \(rank 2\) removed from the run in .*: it left the publish set, its keeper "
                     r"stops it without a replacement; \d+ running groups? dropped \(lost\)", removed.stdout)
    since = _wait_for_metric(run_dir, proc, "samplers/alive", 1.0, more_steps=4)
    deadline = time.monotonic() + 120  # it leaves at the publish after its removal, then closes its engine
    while [key for key in _sampler_processes(run_dir) if key[0] in (2, 3)] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [key for key in _sampler_processes(run_dir) if key[0] in (2, 3)]  # stopped, none replaced
    refused = samplers_command("remove", str(run_dir), "--sampler", "0")  # the last one stays
    assert refused.returncode == 1 and "is the last live sampler" in refused.stdout, refused.stdout
    proc.send_signal(signal.SIGTERM)
    out, err, took = finish(proc, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    joined = [int(v) for v in re.findall(r"sampler 2 \(rank 3\): added joins the publish set at version (\d+)", out)]
    assert len(joined) == 1, out[-3000:]
    for rank in (2, 3):
        assert re.search(rf"megarl: sampler {rank - 1} \(rank {rank}\) removed \(megarl samplers remove\): left the "
                         r"publish set, stopped and not replaced; \d+ running groups? dropped \(lost\)",
                         out), out[-3000:]
    metrics = train_metrics(run_dir)
    assert f"megarl: stopped by SIGTERM after {len(metrics)} steps" in out, err[-3000:]
    assert [m["step"] for m in metrics] == list(range(len(metrics)))  # none skipped, none trained twice
    assert [m["version"] for m in metrics] == list(range(1, len(metrics) + 1))
    assert all(m["samplers/replaced"] == 0.0 for m in metrics)
    rollouts = [json.loads(line) for line in (Path(run_dir) / "rollouts.jsonl").read_text().splitlines()]
    from_added = [r for r in rollouts if r["sampler_rank"] == 3]
    assert from_added, "the added sampler contributed no group"
    assert all(min(r["versions"]) >= joined[0] for r in from_added)  # it generated nothing before its join version
    assert not [r for r in rollouts if r["sampler_rank"] == 2 and r["trained_at_step"] > since]
    ids = [r["group_id"] for r in rollouts]
    assert len(set(ids)) * 8 == len(ids)  # no group trained twice (8 samples per group)
    assert not (Path(run_dir) / ".megarl.contact").exists()
    gone = samplers_command("remove", str(run_dir), "--sampler", "0")
    assert gone.returncode == 1 and "absent (the run has finished" in gone.stdout, gone.stdout
    assert not leftovers(run_dir)


@pytest.mark.timeout(1800)  # 240 s to the first steps, REJOIN_TIMEOUT_S, the remove, 120 s to finish
def test_with_replace_an_sglang_sampler_added_from_a_second_process_joins_contributes_and_leaves(
        embedded_think_model_dir, tmp_path):
    # sampler.engine=sglang (megarl's SGLang-compatible server): the added sampler starts its own server, which
    # joins the next membership epoch's weight-update group; removed, it stops with its server.
    run_dir = tmp_path / "add_sglang"
    proc = _replace_run(run_dir, embedded_think_model_dir, "sampler.engine=sglang")
    wait_for_steps(run_dir, 3, proc)
    added = _adding_sampler(run_dir)
    try:
        _wait_for_metric(run_dir, proc, "samplers/alive", 3.0, more_steps=4)
        servers = _server_processes(_sampler_processes(run_dir)[(3, 1)], b"megarl.sampler.sglang_server")
        assert len(servers) == 1, servers
        remove_added(run_dir, added, 2)
    finally:
        if added.poll() is None:
            added.kill()
    _wait_for_metric(run_dir, proc, "samplers/alive", 2.0, more_steps=2)
    proc.send_signal(signal.SIGTERM)
    out, err, took = finish(proc, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert not [pid for pid in servers if Path(f"/proc/{pid}").exists()]  # its server stopped with it
    joined = [int(v) for v in re.findall(r"sampler 2 \(rank 3\): added joins the publish set at version (\d+)", out)]
    assert len(joined) == 1, out[-3000:]
    metrics = train_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(len(metrics)))  # none skipped, none trained twice
    assert [m["version"] for m in metrics] == list(range(1, len(metrics) + 1))
    rollouts = [json.loads(line) for line in (Path(run_dir) / "rollouts.jsonl").read_text().splitlines()]
    from_added = [r for r in rollouts if r["sampler_rank"] == 3]
    assert from_added, "the added sampler contributed no group"
    assert all(min(r["versions"]) >= joined[0] for r in from_added)  # it generated nothing before its join version
    ids = [r["group_id"] for r in rollouts]
    assert len(set(ids)) * 8 == len(ids)  # no group trained twice (8 samples per group)
    assert not leftovers(run_dir)
