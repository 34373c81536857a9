"""Reward scoring: whatever a reward does -- raise, hang, crash, return a non-number, run escaping code --
the sampler gets (0.0, error string) in bounded time and goes on; a reward that breaks its contract is
refused at start-up naming task.reward_fn, a group's rewards share a time budget, and a run whose rewards
fail too often stops showing the first failure."""
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.config.load import load_config
from megarl.observe.sinks import train_records
from megarl.protocols import Prompt, Sample
from megarl.rollout.rewards import REWARD_BOUND, RewardErrorWindow, check_reward, extract_code, score, score_group
from megarl.rollout.sandbox import START_TIMEOUT_S
from megarl.rollout.tasks import ArithmeticTask, task_from_config
from tests.helpers import REPO, run_python

PROMPT = Prompt("1+1=", "2")


class FixedReward:
    """A task whose reward function returns (or raises) a fixed thing: a stand-in for user code."""

    def __init__(self, result):
        self.result = result

    def sample_prompts(self, rng, n):
        return [PROMPT] * n

    def reward(self, prompt, completion):
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


def test_good_rewards_pass_through():
    assert score(ArithmeticTask(), PROMPT, "2<|endoftext|>") == (1.0, None)
    assert score(ArithmeticTask(), PROMPT, "3") == (0.0, None)
    assert score(FixedReward(-0.5), PROMPT, "x") == (-0.5, None)
    assert score(FixedReward(True), PROMPT, "x") == (1.0, None)
    value, err = score(FixedReward(3), PROMPT, "x")
    assert (value, err) == (3.0, None) and isinstance(value, float)


def test_raising_reward_is_reported_not_raised():
    assert score(FixedReward(KeyError("answer")), PROMPT, "x") == (0.0, "KeyError: 'answer'")
    assert score(FixedReward(ZeroDivisionError("division by zero")), PROMPT, "x") == (
        0.0, "ZeroDivisionError: division by zero")


def test_non_numbers_and_non_finite_are_errors():
    for bad in (None, "1.0", [1.0]):
        value, err = score(FixedReward(bad), PROMPT, "x")
        assert value == 0.0 and err.startswith("TypeError: reward must be a real number")
    for bad in (math.nan, math.inf, -math.inf):
        value, err = score(FixedReward(bad), PROMPT, "x")
        assert value == 0.0 and err.startswith("ValueError: reward must be finite")
    # Beyond the documented bound: inf in float32 (1e308), or finite there but enough to overflow a group's
    # statistics and the batch metrics (3e38), or just drowning every other reward (1e7).
    for bad in (1e308, -1e39, 3e38, -3e38, 1e7):
        value, err = score(FixedReward(bad), PROMPT, "x")
        assert value == 0.0 and err == f"ValueError: reward must be within +-1e+06 (docs/rewards.md), got {bad}"
    assert score(FixedReward(REWARD_BOUND), PROMPT, "x") == (REWARD_BOUND, None)
    assert score(FixedReward(-REWARD_BOUND), PROMPT, "x") == (-REWARD_BOUND, None)


# ----------------------------------------------------------------- rewards selected by task.reward_fn

def task_with(**keys):
    """The task `megarl train` would build from these task.* keys (on top of the defaults)."""
    return task_from_config(load_config(None, [f"task.{k}={v}" for k, v in keys.items()]).task)


FNS = "tests.rollout.reward_fns"


def test_a_user_reward_runs_by_dotted_path_in_a_worker_process():
    task = task_with(reward_fn=f"{FNS}:exact")
    assert score(task, PROMPT, " 2 ") == (1.0, None) and score(task, PROMPT, "3") == (0.0, None)
    assert score(task_with(reward_fn=f"{FNS}:pid"), PROMPT, "x")[0] not in (0.0, float(os.getpid()))
    assert score(task_with(reward_fn=f"{FNS}:numpy_scalar"), PROMPT, "2") == (1.5, None)


def test_a_hanging_user_reward_fails_within_its_timeout_and_scoring_goes_on():
    task = task_with(reward_fn=f"{FNS}:hang_on_nine", reward_timeout_s=0.5)
    assert score(task, Prompt("1+1=", "2"), "2") == (1.0, None)  # the worker started
    start = time.monotonic()
    value, error = score(task, Prompt("9+9=", "18"), "18")
    assert value == 0.0 and error.startswith(f"TimeoutError: {FNS}:hang_on_nine did not return within 0.5s")
    assert time.monotonic() - start < 2.0
    assert score(task, Prompt("1+2=", "3"), "3") == (1.0, None)  # a fresh worker (its start-up is not the call's)


@pytest.mark.parametrize("fn, error", [
    ("raises", "ValueError: cannot score 'x'"),
    ("not_a_number", "TypeError: reward must be a real number, got str '1.0'"),
    ("crash", f"{FNS}:crash: its worker process exited with status 3 during the call"),
    ("nope", f"ValueError: '{FNS}:nope': "),
])
def test_user_reward_failures_are_reported_not_raised(fn, error):
    value, err = score(task_with(reward_fn=f"{FNS}:{fn}"), PROMPT, "x")
    assert value == 0.0 and err.startswith(error), err


@pytest.mark.parametrize("fn, error", [
    ("write_outside", "OSError: [Errno 30] Read-only file system"),
    ("fork_bomb", "PermissionError: [Errno 1] Operation not permitted"),
    ("allocate_10gb", "MemoryError"),
    ("sleep_forever", "wall-clock limit: still running after 2s (killed)"),
])
def test_sandboxed_user_rewards_that_try_to_escape_are_contained(fn, error, tmp_path):
    task = task_with(reward_fn=f"{FNS}:{fn}", reward_sandbox="true", reward_timeout_s=2)
    target = tmp_path / "escaped.txt"
    value, err = score(task, Prompt("p", "a", {"target": str(target)}), "x")
    assert value == 0.0 and err.startswith(error), err
    assert not target.exists()


def test_python_output_task_runs_the_completion_and_compares_its_stdout():
    task = task_with(name="python_output", reward_timeout_s=5)
    prompt = task.sample_prompts(random.Random(0), 1)[0]
    expression = prompt.text.rsplit(" ", 1)[1].strip()
    assert prompt.text == f"# Python 3: print the value of {expression}\n" and str(eval(expression)) == prompt.answer
    assert score(task, prompt, f"print({expression})") == (1.0, None)
    assert score(task, prompt, f"Here you go:\n```python\nx = {expression}\nprint(x)\n```\nDone.") == (1.0, None)
    assert score(task, prompt, f"print({expression} + 1)") == (0.0, None)  # wrong output: no error
    value, err = score(task, prompt, "import time\ntime.sleep(60)")
    assert value == 0.0 and err == "program failed: wall-clock limit: still running after 5s (killed)"
    value, err = score(task, prompt, "print(")
    assert value == 0.0 and err.startswith("program failed: exit status 1: SyntaxError")


def test_python_output_reward_scores_other_tasks_and_reads_stdin():
    task = task_with(reward_fn="python_output")
    assert score(task, Prompt("reverse it", "cba", {"stdin": "abc"}), "print(input()[::-1])") == (1.0, None)
    assert extract_code("```py\nprint(1)\n```") == "print(1)\n" and extract_code("print(2)") == "print(2)"


def test_unknown_rewards_are_named():
    with pytest.raises(ValueError, match="unknown built-in reward 'exactmatch'.*python_output"):
        task_with(reward_fn="exactmatch")


# ------------------------------------------------------------ the start-up check (megarl train, sampler 0)

@pytest.mark.parametrize("fn, error", [
    ("wrong_signature", "TypeError: wrong_signature() takes 2 positional arguments but 4 were given"),
    ("raises", "ValueError: cannot score '"),
    ("not_a_number", "TypeError: reward must be a real number, got str '1.0'"),
    ("returns_none", "TypeError: reward must be a real number, got NoneType None"),
    ("returns_nan", "ValueError: reward must be finite, got nan"),
    ("nope", f"ValueError: '{FNS}:nope': "),
])
def test_the_start_up_check_refuses_a_reward_that_fails_on_real_prompts_naming_the_key(fn, error):
    with pytest.raises(ValueError) as info:
        check_reward(task_with(reward_fn=f"{FNS}:{fn}"), f"{FNS}:{fn}")
    message = str(info.value)
    assert message.startswith(f"task.reward_fn={FNS}:{fn} failed on a real prompt of the task (") and error in message
    assert message.endswith("called as fn(prompt, completion, answer, meta) and returns a real number (docs/rewards.md)")
    if fn == "raises":  # the traceback summary: where in the user's code it raised
        assert re.search(r"\(at .*/tests/rollout/reward_fns\.py:\d+ in raises\)", message), message


def test_the_start_up_check_passes_a_good_reward_and_stops_at_a_timeout_without_refusing():
    assert check_reward(task_with(reward_fn=f"{FNS}:exact"), f"{FNS}:exact") == (
        f"task.reward_fn={FNS}:exact: called on 4 real prompt(s) with their answers as completions: rewards 1, 1, 1, 1")
    line = check_reward(task_with(reward_fn=f"{FNS}:sleep_forever", reward_timeout_s=0.5), f"{FNS}:sleep_forever")
    assert line == (f"task.reward_fn={FNS}:sleep_forever: called on 1 real prompt(s) with their answers as completions: "
                    f"rewards none; then one timed out, so the check stopped there (TimeoutError: {FNS}:sleep_forever "
                    f"did not return within 0.5s (its worker process was killed; the next call starts a new one))")


def test_the_worked_example_of_docs_rewards_md_is_found_in_the_working_directory(embedded_model_dir, tmp_path):
    """The user's module lies in the directory `megarl` is started from; no PYTHONPATH, the console script."""
    doc = (REPO / "docs" / "rewards.md").read_text()
    (tmp_path / "my_rewards.py").write_text(doc.split("```python\n", 1)[1].split("```", 1)[0])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(Path(sys.executable).with_name("megarl")), "train", "--dry-run",
                           str(REPO / "configs" / "demo.yaml"), f"model.path={embedded_model_dir}", "task.name=arithmetic",
                           "task.reward_fn=my_rewards:score"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert ("megarl: task.reward_fn=my_rewards:score: called on 4 real prompt(s) with their answers as completions: "
            "rewards 1, 1, 1, 1") in proc.stdout


# ------------------------------------------------------------------------- budgets and the error share

def test_a_group_s_rewards_share_a_budget_after_which_the_rest_fail_fast():
    task = task_with(reward_fn=f"{FNS}:hang_on_nine", reward_timeout_s=0.5)
    assert score(task, Prompt("1+1=", "2"), "2") == (1.0, None)  # the worker started (not the groups' time below)
    start = time.monotonic()
    hung = score_group(task, Prompt("9+9=", "18"), ["18"] * 8, budget_s=1.0)
    # budget + one call's timeout + the second call's new worker (its start-up has its own deadline)
    assert time.monotonic() - start < 1.0 + 0.5 + START_TIMEOUT_S
    assert all(value == 0.0 and error.startswith("TimeoutError: ") for value, error in hung.scores)
    assert hung.skipped >= 5 and all(error.startswith("TimeoutError: not scored: this group's rewards already took ")
                                     and error.endswith("s (task.reward_group_budget_s=1)")
                                     for _, error in hung.scores[-hung.skipped:])
    # The next group's first call starts a new worker, whose start-up is the group's time (not the call's): a budget
    # that holds a start-up on a loaded machine.
    fine = score_group(task, Prompt("1+2=", "3"), ["3", "4"], budget_s=START_TIMEOUT_S)
    assert fine.scores == [(1.0, None), (0.0, None)] and fine.skipped == 0


def sample(error=None):
    return Sample(group_id="0/0", prompt="1+1=", completion="2", prompt_ids=[1], token_ids=[2], logprobs=[0.0],
                  versions=[0], reward=0.0, finish_reason="stop", sampler_rank=1, reward_error=error)


def test_the_run_stops_once_failed_rewards_exceed_their_share_of_a_batch_showing_the_first():
    window = RewardErrorWindow(size=20, max_frac=0.1)
    window.add([sample()] * 18 + [sample("ValueError: first (at r.py:3 in f)")] + [sample()])
    window.add([sample("ValueError: second")] + [sample()] * 3)  # 2 of the last 20: not more than 10%
    with pytest.raises(RuntimeError, match=re.escape(
            "rewards: 3 of the last 20 samples' rewards failed, more than task.max_reward_error_frac=0.1 of a batch "
            "(20 samples); the first of them (prompt '1+1='): ValueError: first (at r.py:3 in f). Fix task.reward_fn")):
        window.add([sample("TypeError: third")])
    early = RewardErrorWindow(size=20, max_frac=0.1)  # a reward failing on every call: stops before a batch is full
    with pytest.raises(RuntimeError, match="3 of the last 3 samples"):
        early.add([sample("TimeoutError: x")] * 3)
    never = RewardErrorWindow(size=4, max_frac=1.0)
    never.add([sample("TimeoutError: x")] * 10)


def test_a_run_whose_reward_always_hangs_stops_at_the_defaults_saying_why(embedded_model_dir, tmp_path):
    """A reward that hangs on every call: the run stops within its budget and says why, rather than standing still
    printing nothing."""
    proc = run_python("-m", "megarl.cli", "train", str(REPO / "configs" / "demo.yaml"), f"run.dir={tmp_path / 'run'}",
                      f"model.path={embedded_model_dir}", "task.name=arithmetic", "task.think_mean=0",
                      f"task.reward_fn={FNS}:sleep_forever", "run.steps=3", "algo.prompts_per_step=4",
                      "algo.group_size=4", "sampling.max_new_tokens=8", "learner.micro_batch_size=16",
                      "observe.trackers=[]",
                      # Each group waits out the reward budget (~4.5 s), and the sampler scores every group that
                      # finishes in one engine step before it sends any: one batch in flight (max_lag 0, not the
                      # demo's 3 batches) and no held-out evaluation (320 samples scored before the first training
                      # group) keep that to one batch's 4 groups before the learner receives the first and stops (~18 s,
                      # not ~110 s).
                      "algo.max_lag=0", "eval.sets=[]", timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "then one timed out, so the check stopped there" in proc.stdout  # start-up: warned, not refused
    assert re.search(r"megarl: sampler 0: the rewards of one group took [\d.]+s, over task.reward_group_budget_s=4; "
                     r"\d of its 4 samples failed without a call \(first error: TimeoutError: .*\); 1 such group\(s\) so far",
                     proc.stdout), out[-3000:]
    assert re.search(r"rewards: \d+ of the last \d+ samples' rewards failed, more than task.max_reward_error_frac=0.1 "
                     r"of a batch \(16 samples\); the first of them \(prompt '[^']*'\): TimeoutError: "
                     rf"{FNS}:sleep_forever did not return within 2s", proc.stderr), out[-3000:]
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not train_records([json.loads(line) for line in metrics.read_text().splitlines()])
