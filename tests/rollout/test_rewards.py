"""Reward scoring: whatever a reward does -- raise, hang, crash, return a non-number, run escaping code --
the sampler gets (0.0, error string) in bounded time and goes on."""
import math
import os
import random
import time

import pytest

from megarl.config.load import load_config
from megarl.protocols import Prompt
from megarl.rollout.rewards import extract_code, score
from megarl.rollout.tasks import ArithmeticTask, task_from_config

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


# ----------------------------------------------------------------- rewards selected by task.reward_fn

def task_with(**keys):
    """The task `megarl train` would build from these task.* keys (on top of the defaults)."""
    return task_from_config(load_config(None, [f"task.{k}={v}" for k, v in keys.items()]).task)


FNS = "tests.rollout.reward_fns"


def test_a_user_reward_runs_by_dotted_path_in_a_worker_process():
    task = task_with(reward_fn=f"{FNS}:exact")
    assert score(task, PROMPT, " 2 ") == (1.0, None) and score(task, PROMPT, "3") == (0.0, None)
    assert score(task_with(reward_fn=f"{FNS}:pid"), PROMPT, "x")[0] not in (0.0, float(os.getpid()))


def test_a_hanging_user_reward_fails_within_its_timeout_and_scoring_goes_on():
    task = task_with(reward_fn=f"{FNS}:hang_on_nine", reward_timeout_s=0.5)
    start = time.monotonic()
    value, error = score(task, Prompt("9+9=", "18"), "18")
    assert value == 0.0 and error.startswith(f"TimeoutError: {FNS}:hang_on_nine did not return within 0.5s")
    assert time.monotonic() - start < 2.0
    assert score(task, Prompt("1+2=", "3"), "3") == (1.0, None)  # a fresh worker


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
