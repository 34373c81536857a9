"""LapCountTask: the prompt fixes a long, long-tailed completion; exact match; the config builds it."""
from __future__ import annotations

import random
import statistics

import pytest

from megarl.config.schema import TaskConfig
from megarl.rollout.lap_count import LapCountTask, completion_tokens
from megarl.rollout.tasks import COUNT_ALPHABET, EOS_TEXT, task_from_config


def test_answer_counts_laps_down_and_stops_at_the_prompts_letter():
    task = LapCountTask()
    p = task.make_prompt(2, 3)
    assert p.text == "2d="
    assert p.answer == "2" + COUNT_ALPHABET + "1" + COUNT_ALPHABET + "0abcd"
    assert len(p.answer) + 1 == completion_tokens(2, 3)
    assert task.reward(p, p.answer + EOS_TEXT) == 1.0
    assert task.reward(p, p.answer[:-1]) == 0.0 and task.reward(p, p.answer + "e") == 0.0
    assert task.max_completion_tokens() == 9 * 53 + 54  # nine full laps, lap 0 to "Z", EOS


def test_lengths_are_long_tailed_and_seeded():
    task = LapCountTask()
    prompts = task.sample_prompts(random.Random(0), 5000)
    assert prompts[:20] == task.sample_prompts(random.Random(0), 20)
    lengths = sorted(len(p.answer) + 1 for p in prompts)
    mean, p99 = statistics.mean(lengths), lengths[int(0.99 * len(lengths))]
    assert 90 < mean < 120 and p99 / mean > 3.5 and lengths[-1] <= task.max_completion_tokens()
    assert all(0 <= p.meta["laps"] <= task.max_laps for p in prompts)


def test_near_miss_is_wrong_but_close():
    task, rng = LapCountTask(), random.Random(2)
    for p in task.sample_prompts(random.Random(1), 200):
        miss = task.near_miss(p, rng, 3)
        assert task.reward(p, miss) == 0.0 and 1 <= abs(len(miss) - len(p.answer)) <= 3


def test_built_from_the_config_and_checked():
    task = task_from_config(TaskConfig(name="lap_count", lap_mean=0.5, max_laps=3))
    assert task == LapCountTask(lap_mean=0.5, max_laps=3)
    with pytest.raises(ValueError, match="task.max_laps"):
        LapCountTask(max_laps=10)
