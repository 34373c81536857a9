import random

import pytest

from megarl.protocols import Prompt, Task
from megarl.rollout.tasks import ArithmeticTask, build_task, exact_match


def test_default_task_prompts_and_answers():
    task = build_task("arithmetic")
    assert isinstance(task, Task)
    prompts = task.sample_prompts(random.Random(0), 200)
    assert len(prompts) == 200 and all(isinstance(p, Prompt) for p in prompts)
    for p in prompts:
        a, b = p.meta["a"], p.meta["b"]
        assert p.text == f"{a}+{b}=" and p.answer == str(a + b) and 0 <= a <= 19 and 0 <= b <= 19
    assert len(task.all_prompts()) == 400 and task.answer_range() == (0, 38)


def test_sampling_is_deterministic_given_the_rng():
    task = ArithmeticTask()
    assert task.sample_prompts(random.Random(7), 50) == task.sample_prompts(random.Random(7), 50)
    assert task.sample_prompts(random.Random(7), 50) != task.sample_prompts(random.Random(8), 50)


def test_other_ops_and_ranges():
    task = build_task("arithmetic", min_operand=2, max_operand=5, ops=["-", "*"])
    assert task.answer_range() == (-3, 25)
    assert task.make_prompt(2, "-", 5) == Prompt("2-5=", "-3", {"a": 2, "op": "-", "b": 5})
    assert {p.meta["op"] for p in task.sample_prompts(random.Random(0), 100)} == {"-", "*"}
    assert len(task.all_prompts()) == 2 * 4 * 4


@pytest.mark.parametrize("completion, reward", [
    ("19", 1.0), ("19<|endoftext|>", 1.0), (" 19 \n", 1.0), ("19 <|endoftext|>", 1.0),
    ("18", 0.0), ("190", 0.0), ("1", 0.0), ("", 0.0), ("<|endoftext|>", 0.0), ("19<|endoftext|>x", 0.0),
    ("019", 0.0), ("19.0", 0.0),
])
def test_reward_is_exact_match(completion, reward):
    task = ArithmeticTask()
    assert task.reward(task.make_prompt(12, "+", 7), completion) == reward
    assert exact_match(completion, "19") == reward


def test_bad_task_names_and_arguments():
    with pytest.raises(ValueError, match="unknown task 'nope'.*arithmetic"):
        build_task("nope")
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops=("/",))
    with pytest.raises(ValueError, match="min_operand"):
        ArithmeticTask(min_operand=5, max_operand=1)
