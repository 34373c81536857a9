"""task.env=verifiers:<id> without the verifiers environment: the adapter's validation of the worker process (a
stand-in speaking its protocol, tests/rollout/fake_verifiers_worker.py), the worker's request checks, and the
config refusals before launch. The real package: tests/rollout/test_verifiers_real.py (marker `verifiers`)."""
import sys
from pathlib import Path

import pytest

from megarl.config.load import ConfigError, load_config
from megarl.rollout import verifiers_worker
from megarl.rollout.env_adapters import agent_for
from megarl.rollout.verifiers_adapter import (META_ENV, META_TASK, VerifiersTask, Worker, WorkerError, check_ready,
                                              check_result, env_id_of, run_episode)
from tests.helpers import REPO

FAKE = str(Path(__file__).with_name("fake_verifiers_worker.py"))


def fake(mode: str, timeout_s: float = 20.0) -> Worker:
    return Worker([sys.executable, FAKE, mode]).start(timeout_s)


def test_a_well_behaved_worker_lists_its_dataset_and_runs_episodes():
    worker = fake("ok")
    try:
        task = VerifiersTask("verifiers:fake", worker=worker, agent_timeout_s=10.0)
        (prompt,) = task.prompts
        assert (prompt.text, prompt.answer) == ("2+2", "4")
        assert prompt.meta[META_ENV] == "fake" and prompt.meta[META_TASK] == 0 and prompt.meta["k"] == 1
        reward = run_episode("http://127.0.0.1:1/sessions/x/v1", prompt.text, prompt.answer, prompt.meta)
        assert reward == 1.0 and reward.parts == {"correct": {"score": 1.0, "weight": 1.0}}  # the rubric's parts
        result = worker.run(0, "http://u", 10.0)
        assert result.rewards == {"correct": {"score": 1.0, "weight": 1.0}} and result.turns == 1
    finally:
        worker.close()
    assert worker.proc.returncode == 0


@pytest.mark.parametrize("mode, message", [
    ("not_json", "a line that is not JSON"),
    ("nan_reward", "result.reward must be a finite number"),
    ("crash", "exited (rc 3); its stderr ends:\nworker: something broke"),
])
def test_a_bad_reply_fails_the_episode_naming_why(mode, message):
    worker = fake(mode)
    try:
        with pytest.raises(WorkerError, match="verifiers worker") as err:
            worker.run(0, "http://u", 10.0)
        assert message in str(err.value)
    finally:
        worker.close()


def test_a_late_answer_is_dropped_and_the_worker_goes_on(monkeypatch):
    from megarl.rollout import env_worker

    monkeypatch.setattr(env_worker, "ANSWER_MARGIN_S", 0.0)
    worker = fake("slow_first")
    try:
        with pytest.raises(WorkerError, match="no answer for task 0 within 0.5s"):
            worker.run(0, "http://u", 0.5)
        assert worker.run(0, "http://u", 60.0).reward == 1.0  # after the late one: it was dropped, not fatal
        assert worker.dead is None
    finally:
        worker.close()


def test_an_episode_the_environment_reports_failed_fails_with_its_errors():
    worker = fake("failed_episode")
    try:
        task = VerifiersTask("verifiers:fake", worker=worker, agent_timeout_s=10.0)
        with pytest.raises(WorkerError, match="episode failed: HarnessError: the program exited 1"):
            run_episode("http://u", "", "", task.prompts[0].meta)
    finally:
        worker.close()


@pytest.mark.parametrize("mode, timeout_s, message", [
    ("fails_to_load", 60.0, "failed to start: ModuleNotFoundError: taskset 'nope' not found"),
    ("bad_ready", 60.0, "ready.tasks[0].prompt must be a non-empty list of messages"),
    ("silent", 1.0, "no dataset listed within 1s"),  # the stand-in sleeps 60 s before anything
])
def test_a_worker_that_cannot_start_is_refused(mode, timeout_s, message):
    with pytest.raises(WorkerError) as err:
        fake(mode, timeout_s)
    assert message in str(err.value)


def test_check_result_names_the_bad_field():
    good = {"type": "result", "ok": True, "reward": 0.5, "rewards": {}, "metrics": {}, "messages": [], "turns": 1,
            "errors": []}
    assert check_result(good).reward == 0.5
    for bad, field in ((dict(good, reward=True), "result.reward"), (dict(good, rewards={"a": 1}), "result.rewards"),
                       (dict(good, turns="1"), "result.turns"), (dict(good, ok=None), "result.ok")):
        with pytest.raises(WorkerError, match=field):
            check_result(bad)
    with pytest.raises(WorkerError, match="ready.tasks must be a non-empty list"):
        check_ready({"type": "ready", "harness": "null", "tasks": []})


def test_env_specs_and_conflicting_keys_are_refused_before_launch():
    assert env_id_of("verifiers:my-env") == "my-env"
    for spec in ("openenv:echo", "verifiers:", "my-env"):
        with pytest.raises(ValueError, match="task.env"):
            env_id_of(spec)
        with pytest.raises(ConfigError, match="task.env"):
            load_config(None, [f"task.env={spec}", "eval.sets=[]"], check_files=False)
    for key, value in (("task.agent", "m:f"), ("task.reward_fn", "m:f"), ("task.path", "x.jsonl")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, ["task.env=verifiers:my-env", "eval.sets=[]", f"{key}={value}"], check_files=False)
    with pytest.raises(ConfigError, match="eval.sets: not supported with task.env"):
        load_config(str(REPO / "configs" / "multiturn_demo.yaml"), ["task.env=verifiers:my-env"], check_files=False)
    cfg = load_config(None, ["task.env=verifiers:my-env", "eval.sets=[]"], check_files=False)
    assert agent_for(cfg.task) == "megarl.rollout.verifiers_adapter:run_episode"
