import math

from megarl.protocols import Prompt
from megarl.rollout.rewards import score
from megarl.rollout.tasks import ArithmeticTask

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
