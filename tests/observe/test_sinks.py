"""metrics.jsonl and rollouts.jsonl after a kill -9: every line is a whole record, and rollouts.jsonl holds
whole steps (a real process, really killed, between two steps)."""
import json
import os
import signal
import subprocess
import sys

from megarl.observe.jsonl import read_jsonl
from tests.helpers import REPO

SAMPLES_PER_STEP = 256

WRITER = f"""
import sys, time
from megarl.observe.sinks import MetricsSink, RolloutSink
from megarl.protocols import Sample

run_dir, steps = sys.argv[1], int(sys.argv[2])
metrics, rollouts = MetricsSink(run_dir), RolloutSink(run_dir)
samples = [Sample(group_id=f"s0-g{{i // 8}}", prompt="12+7=", completion=".........19", prompt_ids=list(range(6)),
                  token_ids=list(range(40)), logprobs=[-0.125] * 40, versions=[3] * 40, reward=1.0,
                  finish_reason="stop") for i in range({SAMPLES_PER_STEP})]
for step in range(steps):
    rollouts.log(samples, trained_at_step=step)
    metrics.log(step, {{"reward_mean": 0.5, "loss": 0.25}})
print("logged", flush=True)
time.sleep(600)  # killed here, between steps, as a run is killed during its next step's work
"""


def test_a_killed_writer_leaves_whole_records_and_whole_steps(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "7"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout.readline() == "logged\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    for name in ("rollouts.jsonl", "metrics.jsonl"):
        assert (tmp_path / name).read_text().endswith("\n"), f"{name} ends in a torn line"
    rollouts = read_jsonl(tmp_path / "rollouts.jsonl")
    assert [r["trained_at_step"] for r in rollouts] == [s for s in range(7) for _ in range(SAMPLES_PER_STEP)]
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(7))


def test_a_torn_last_line_is_left_out_and_damage_inside_the_file_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = "".join(json.dumps({"step": s}) + "\n" for s in range(3))
    path.write_text(whole + '{"step": 3, "rew')  # what a crash during a write can leave
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2]
    path.write_text('{"step": 0}\n{"st\n{"step": 2}\n')
    try:
        read_jsonl(path)
    except ValueError as exc:
        assert str(exc) == f"{path}: line 2 is not JSON: '{{\"st\\n'"
    else:
        raise AssertionError("a damaged line inside the file passed")


def test_run_outputs_are_the_users_alone(tmp_path):
    """Rollouts hold prompts, completions and tool output: 0600 files in a 0700 run.dir, whatever the umask."""
    from megarl import run_lock
    from megarl.observe.sinks import MetricsSink, RolloutSink

    run_dir = tmp_path / "run"
    old = os.umask(0o002)
    try:
        run_lock.hold(run_dir)
        MetricsSink(run_dir)
        RolloutSink(run_dir)
    finally:
        os.umask(old)
        run_lock.release_unused(run_dir)
    assert oct(run_dir.stat().st_mode & 0o777) == oct(0o700)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in run_dir.glob("*.jsonl")} == {
        "metrics.jsonl": oct(0o600), "rollouts.jsonl": oct(0o600)}


def test_a_rollout_records_its_rewards_parts_where_its_scorer_gave_them(tmp_path):
    from megarl.observe.sinks import RolloutSink
    from megarl.protocols import Sample

    def sample(parts):
        return Sample(group_id="s0-g0", prompt="p", completion="c", prompt_ids=[1], token_ids=[2], logprobs=[-0.5],
                      versions=[0], reward=0.5, finish_reason="stop", reward_parts=parts)

    sink = RolloutSink(tmp_path)
    sink.log([sample('{"exact": {"score": 1.0, "weight": 0.5}, "format": null}'), sample(None)], trained_at_step=0)
    sink.close()
    with_parts, without = read_jsonl(tmp_path / "rollouts.jsonl")
    assert with_parts["reward_parts"] == {"exact": {"score": 1.0, "weight": 0.5}, "format": None}
    assert "reward_parts" not in without
