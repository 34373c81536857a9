import random
import re

import pytest

from megarl.protocols import Prompt, Task
from megarl.config.schema import TaskConfig
from megarl.rollout.tasks import (COUNT_ALPHABET, ArithmeticTask, CountTask, build_task, exact_match, strip_thinking,
                                  task_from_config)


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


def test_thinking_is_off_by_default_and_configurable_by_name():
    assert ArithmeticTask().think_mean == 0.0
    rng = random.Random(0)
    state = rng.getstate()
    assert ArithmeticTask().sample_think_length(rng) == 0 and rng.getstate() == state  # no draw: old targets
    task = build_task("arithmetic", max_operand=9, think_mean=10)
    assert task.think_mean == 10.0 and isinstance(task.think_mean, float) and task.answer_range() == (0, 18)
    with pytest.raises(ValueError, match="think_mean"):
        ArithmeticTask(think_mean=-1.0)


def test_thinking_lengths_are_geometric_with_the_given_mean():
    task = ArithmeticTask(think_mean=10.0)
    rng = random.Random(0)
    ks = [task.sample_think_length(rng) for _ in range(20000)]
    assert abs(sum(ks) / len(ks) - 10.0) < 0.3
    assert abs(ks.count(0) / len(ks) - 1 / 11) < 0.01  # constant stop probability 1 / (1 + mean)
    assert abs(sum(k >= 10 for k in ks) / len(ks) - (10 / 11) ** 10) < 0.015  # memoryless tail
    capped = [task.sample_think_length(rng, max_len=20) for _ in range(2000)]
    assert max(capped) <= 20
    p = task.make_prompt(12, "+", 7)
    for _ in range(50):
        target = task.target_completion(p, rng, max_think=44)
        assert re.fullmatch(r"\.{0,44}19", target) and task.reward(p, target) == 1.0


@pytest.mark.parametrize("completion, reward", [
    ("..........19<|endoftext|>", 1.0), (".19", 1.0), ("19", 1.0), (" ...19 ", 1.0), ("...19 <|endoftext|>", 1.0),
    ("..........", 0.0), ("....<|endoftext|>", 0.0), ("...18", 0.0), ("19..", 0.0), ("1.9", 0.0), (".19.", 0.0),
    ("..19<|endoftext|>x", 0.0), ("...019", 0.0), ("..190", 0.0),
])
def test_reward_ignores_the_thinking_filler_only(completion, reward):
    for task in (ArithmeticTask(think_mean=10.0), ArithmeticTask()):
        assert task.reward(task.make_prompt(12, "+", 7), completion) == reward
    assert strip_thinking("..19<|endoftext|>") == "19" and strip_thinking("...") == ""


def test_count_prompts_name_a_run_whose_length_is_long_tailed():
    task = build_task("count")
    assert isinstance(task, CountTask) and isinstance(task, Task)
    prompts = task.sample_prompts(random.Random(0), 20000)
    for p in prompts[:500]:
        start, length = p.meta["start"], p.meta["length"]
        assert p.answer == COUNT_ALPHABET[start:start + length] and len(p.answer) == length
        assert p.text == f"{p.answer[0]}-{p.answer[-1]}="
    lengths = sorted(p.meta["length"] for p in prompts)
    mean, p99 = sum(lengths) / len(lengths), lengths[int(0.99 * len(lengths))]
    assert 7.5 < mean < 8.5 and 1 == lengths[0] and lengths[-1] <= 48, (mean, lengths[-1])
    assert p99 / mean >= 4.0, (p99, mean)  # the tail a sync batch waits for
    assert len({p.meta["start"] for p in prompts if p.meta["length"] == 1}) == len(COUNT_ALPHABET)
    assert task.sample_prompts(random.Random(3), 20) == task.sample_prompts(random.Random(3), 20)


@pytest.mark.parametrize("completion, reward", [
    ("defghijk", 1.0), ("defghijk<|endoftext|>", 1.0), (" defghijk \n", 1.0),
    ("defghij", 0.0), ("defghijkl", 0.0), ("", 0.0), ("<|endoftext|>", 0.0), ("efghijk", 0.0), ("DEFGHIJK", 0.0),
    ("defghijk<|endoftext|>x", 0.0), ("d e f g h i j k", 0.0),
])
def test_count_reward_is_exact_match_of_the_whole_run(completion, reward):
    # Stopping early loses the reward: RL cannot trim a long completion.
    task = CountTask()
    assert task.reward(task.make_prompt(3, 8), completion) == reward


def test_count_near_misses_stop_off_the_end_letter_inside_the_alphabet():
    task, rng = CountTask(), random.Random(0)
    for start, length in [(3, 8), (0, 1), (48, 4), (50, 2)]:
        p = task.make_prompt(start, length)
        misses = {task.near_miss(p, rng, 3) for _ in range(200)}
        assert p.answer not in misses and all(m and COUNT_ALPHABET.startswith(m, start) for m in misses), misses
        assert {abs(len(m) - length) for m in misses} <= {1, 2, 3}


def test_count_task_keys_come_from_the_config_and_bad_values_fail():
    task = task_from_config(TaskConfig(name="count", length_mean=4.0, max_length=10))
    assert task == CountTask(length_mean=4.0, max_length=10)
    assert max(p.meta["length"] for p in task.sample_prompts(random.Random(0), 2000)) == 10
    with pytest.raises(ValueError, match="max_length"):
        CountTask(max_length=53)
    with pytest.raises(ValueError, match="length_mean"):
        CountTask(length_mean=0.5)
