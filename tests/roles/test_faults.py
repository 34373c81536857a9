"""Faults, for real: real runs, real signals. A run that cannot go on stops every process, quickly,
with a message that names the failed rank and role; nothing is left running. (A sampler replaced while the run goes
on: test_replace.py.)"""
import os
import signal
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, run_python, train_metrics
from tests.roles.fault_runs import (
    DEMO, REPLACE_PUBLISH_TIMEOUT_S, Logged, finish, leftovers, start_run, wait_for_steps,
    worker_pids,
)


def test_nonfinite_steps_in_a_row_stop_the_run(embedded_think_model_dir, tmp_path):
    # lr=1e30: the first step is finite but blows the weights up; every later loss is inf/NaN, so
    # steps are skipped (no update, counted) until max_nonfinite_in_row stops the run. 4 in a row outlast the
    # samplers' staleness budget (algo.max_lag + 1 = 2 batches): the skipped steps publish nothing, so only the
    # learner's retired counts let the samplers go on (else the run stalls until queue.timeout_s).
    run_dir = tmp_path / "nan"
    proc = run_python("-m", "megarl.cli", "train", DEMO, f"run.dir={run_dir}", "run.steps=50", "learner.lr=1e30",
                      "learner.max_nonfinite_in_row=4", "algo.prompts_per_step=4", "algo.max_lag=1",
                      "queue.timeout_s=120", f"model.path={embedded_think_model_dir}", timeout=300)
    assert proc.returncode != 0
    assert "4 optimizer steps in a row had a non-finite loss or grad norm" in proc.stderr, proc.stderr[-3000:]
    assert "learner.max_nonfinite_in_row=4" in proc.stderr
    assert "megarl: the run failed: learner 0 (rank 0) exited with code 1" in proc.stderr
    assert "megarl: done" not in proc.stdout
    assert not leftovers(run_dir)


def test_a_killed_sampler_stops_the_run_and_is_named(embedded_think_model_dir, tmp_path):
    run_dir = tmp_path / "kill"
    proc = start_run(run_dir, embedded_think_model_dir, "fault.on_failure=stop")  # the default (auto) replaces it
    wait_for_steps(run_dir, 2, proc)
    os.kill(worker_pids(run_dir)[1], signal.SIGKILL)
    out, err, took = finish(proc, timeout=60)
    assert proc.returncode != 0
    assert "megarl: the run failed: sampler 0 (rank 1) was killed by signal 9 (SIGKILL); " \
           "torchrun stopped every other process" in err
    assert not leftovers(run_dir)
    assert len(train_metrics(run_dir)) >= 2  # what was done is kept


def test_a_hung_sampler_is_named_by_the_learner(embedded_think_model_dir, tmp_path):
    # SIGSTOP: the sampler process is alive (torchrun sees nothing wrong) but stops turning. The
    # learner finds out either waiting for groups (heartbeat timeout) or in the weight broadcast the
    # sampler no longer receives (publish timeout); either way it names the sampler.
    run_dir = tmp_path / "hang"
    proc = start_run(run_dir, embedded_think_model_dir, "fault.on_failure=stop", "fault.sampler_timeout_s=4",
                        f"publish.timeout_s={REPLACE_PUBLISH_TIMEOUT_S}",
                  "queue.timeout_s=600")
    wait_for_steps(run_dir, 2, proc)
    sampler = worker_pids(run_dir)[1]
    os.kill(sampler, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60
        while 0 in worker_pids(run_dir) and time.monotonic() < deadline:  # until the learner gives up
            time.sleep(0.5)
    finally:
        os.kill(sampler, signal.SIGCONT)  # let it take torchrun's SIGTERM like the others
    out, err, took = finish(proc, timeout=60)
    assert proc.returncode != 0
    assert "sampler rank 1 (sampler 0)" in err and ("stopped beating" in err or "has sent no heartbeat" in err)
    assert "megarl: the run failed: sampler 0 (rank 1) hung: alive but silent, no heartbeat for " in err
    assert "so learner 0 (rank 0) stopped the run (its error is above)" in err
    assert not leftovers(run_dir)


def test_with_restart_a_killed_sampler_costs_only_the_steps_since_the_checkpoint(embedded_think_model_dir, tmp_path):
    run_dir = tmp_path / "restart"
    # Steps enough that the kill lands mid-run: a learner fed the last batches before the sampler died may
    # otherwise finish (and checkpoint) all of them first, and the restart then has nothing left to redo.
    steps = 30
    proc = start_run(run_dir, embedded_think_model_dir, f"run.steps={steps}", "fault.on_failure=restart",
                  "checkpoint.every_steps=3")
    wait_for_steps(run_dir, 5, proc)  # a checkpoint at step 3, progress past it
    os.kill(worker_pids(run_dir)[1], signal.SIGKILL)
    out, err, took = finish(proc, timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "megarl: resumed from" in out and "; restart 1" in out  # "redoing N logged steps" follows where N > 0
    metrics = train_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(steps))  # one history, nothing skipped or doubled
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    resumed = [m for m in metrics if m.get("restarts") == 1.0]
    assert resumed and resumed[0]["step"] % 3 == 0 and resumed[0]["redone_steps"] >= 0, [
        (m["step"], m.get("restarts")) for m in metrics]
    assert not leftovers(run_dir)


def test_a_job_killed_mid_run_resumes_from_its_last_checkpoint(embedded_think_model_dir, tmp_path):
    run_dir = tmp_path / "killed"
    proc = start_run(run_dir, embedded_think_model_dir, "checkpoint.every_steps=2")
    wait_for_steps(run_dir, 5, proc)
    # A second run into the same run.dir meanwhile is refused before it launches, naming the first.
    second = run_python("-m", "megarl.cli", "train", DEMO, f"run.dir={run_dir}", "run.resume=true", timeout=120)
    assert second.returncode == 2 and "launching" not in second.stdout, second.stderr[-3000:]
    assert second.stderr.startswith(f"megarl: run.dir {run_dir} is in use by the run started "), second.stderr
    assert f" as pid {proc.pid} on " in second.stderr
    for pid in [proc.pid, *leftovers(run_dir)]:  # the whole job at once: launcher, agent, workers
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    time.sleep(1)
    assert not leftovers(run_dir)
    assert (run_dir / ".megarl.lock").is_file()  # left by the killed run: it must not block the resumed one
    done = len(train_metrics(run_dir))
    resumed = run_python("-m", "megarl.cli", "train", DEMO, f"run.dir={run_dir}", f"model.path={embedded_think_model_dir}",
                         f"run.steps={done + 3}", "algo.prompts_per_step=4", "checkpoint.every_steps=2",
                         "run.resume=true", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = train_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(done + 3))
    assert [m["version"] for m in metrics] == list(range(1, done + 4))


@pytest.mark.parametrize("sig, overrides", [(signal.SIGTERM, ["fault.checkpoint_on_signal=true"]), (signal.SIGINT, [])])
def test_a_stop_signal_to_megarl_train_stops_every_process_of_the_run(sig, overrides, embedded_think_model_dir,
                                                                      tmp_path):
    # The main process only: what a supervisor, a container runtime, a scheduler or `kill PID` signals.
    run_dir = tmp_path / "signal"
    proc = start_run(run_dir, embedded_think_model_dir, *overrides)
    wait_for_steps(run_dir, 2, proc)
    proc.send_signal(sig)
    out, err, took = finish(proc, timeout=60)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert not leftovers(run_dir)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    steps = len(train_metrics(run_dir))
    assert f"megarl: stopped by {sig.name} after {steps} steps" in out  # at a step boundary: every step logged whole
    assert f"megarl: stopped by {sig.name}; every process of the run has exited" in err
    if overrides:
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps:08d}"
        assert f"continue from {run_dir}/checkpoints/step_{steps:08d} with the same command and run.resume=true" in err
    else:
        assert "no checkpoint was saved" in err


def test_torchrun_killed_from_outside_is_named_in_one_line_and_its_workers_stopped(embedded_think_model_dir, tmp_path):
    run_dir = tmp_path / "torchrun"
    proc = start_run(run_dir, embedded_think_model_dir)
    wait_for_steps(run_dir, 2, proc)
    [torchrun] = map(int, Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split())
    os.kill(torchrun, signal.SIGKILL)
    out, err, took = finish(proc, timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL
    assert err.rstrip().endswith(f"megarl: the run failed: torchrun (pid {torchrun}) was killed by SIGKILL (from "
                                 f"outside megarl); megarl stopped its workers. Outputs so far are in {run_dir}")
    assert "DistNetworkError" not in err and "Traceback" not in err, err[-3000:]
    assert not leftovers(run_dir)


def test_a_sigterm_to_the_raw_single_node_script_stops_the_run_and_it_exits_143_quietly(embedded_think_model_dir,
                                                                                      tmp_path):
    # launch/torchrun_single_node.sh execs megarl.distributed.local_launch: the signal reaches torchrun's agent,
    # which passes it to the ranks (they stop at a step boundary) and then exits as the signal's 128 + 15.
    run_dir = tmp_path / "raw"
    proc = Logged(["bash", str(REPO / "launch" / "torchrun_single_node.sh"), DEMO, f"run.dir={run_dir}",
                    f"model.path={embedded_think_model_dir}", "run.steps=100000", "algo.prompts_per_step=4"],
                   Path(f"{run_dir}.console"))
    wait_for_steps(run_dir, 1, proc)
    proc.send_signal(signal.SIGTERM)
    out, err, took = finish(proc, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert not leftovers(run_dir)
