"""The learning-rate schedule (megarl.learner.lr_schedule) against transformers' own schedulers, which megarl's
equals after the warm-up; during it megarl's step s trains at transformers' step s + 1 (no step at lr 0)."""
import pytest
import torch
from transformers import (get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup,
                          get_linear_schedule_with_warmup)

from megarl.config.schema import LearnerConfig
from megarl.learner import with_decay_steps
from megarl.learner.lr_schedule import lr_at

LR, WARMUP, TOTAL = 0.01, 5, 40


def transformers_lr(make, **kwargs) -> list[float]:
    """The lr transformers' scheduler gives steps 0..TOTAL-1 (its LambdaLR factor times the optimizer's lr)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    factor = make(optimizer, num_warmup_steps=WARMUP, **kwargs).lr_lambdas[0]
    return [LR * factor(s) for s in range(TOTAL + 1)]


@pytest.mark.parametrize("decay, min_ratio, make, kwargs", [
    ("constant", 0.0, get_constant_schedule_with_warmup, {}),
    ("linear", 0.0, get_linear_schedule_with_warmup, {"num_training_steps": TOTAL}),
    ("cosine", 0.0, get_cosine_with_min_lr_schedule_with_warmup, {"num_training_steps": TOTAL, "min_lr_rate": 0.0}),
    ("cosine", 0.1, get_cosine_with_min_lr_schedule_with_warmup, {"num_training_steps": TOTAL, "min_lr_rate": 0.1}),
])
def test_the_schedule_is_transformers_after_the_warmup_and_one_step_ahead_during_it(decay, min_ratio, make, kwargs):
    cfg = LearnerConfig(lr=LR, lr_warmup_steps=WARMUP, lr_decay=decay, lr_decay_steps=TOTAL, lr_min_ratio=min_ratio)
    ref = transformers_lr(make, **kwargs)
    ours = [lr_at(s, cfg) for s in range(TOTAL)]
    assert ours[:WARMUP] == pytest.approx(ref[1:WARMUP + 1], rel=1e-12)
    assert ours[WARMUP:] == pytest.approx(ref[WARMUP:TOTAL], rel=1e-12, abs=1e-15)
    assert ours[0] == LR / WARMUP and ours[WARMUP - 1] == LR  # the warm-up's first step is not spent at lr 0
    assert lr_at(TOTAL, cfg) == pytest.approx(LR * (1.0 if decay == "constant" else min_ratio))
    assert lr_at(10 * TOTAL, cfg) == lr_at(TOTAL, cfg)  # past lr_decay_steps the floor holds


def test_a_linear_decay_with_a_floor_ends_at_the_floor():
    cfg = LearnerConfig(lr=LR, lr_decay="linear", lr_decay_steps=4, lr_min_ratio=0.2)
    assert [lr_at(s, cfg) for s in range(5)] == pytest.approx([0.01, 0.008, 0.006, 0.004, 0.002])


def test_lr_decay_steps_0_spans_the_run_and_a_decay_ending_before_its_warmup_is_refused():
    assert with_decay_steps(LearnerConfig(lr_decay="cosine"), 100).lr_decay_steps == 100
    assert with_decay_steps(LearnerConfig(lr_decay="cosine", lr_decay_steps=30), 100).lr_decay_steps == 30
    with pytest.raises(ValueError, match=r"learner.lr_decay=linear needs learner.lr_decay_steps \(0: the run's 8 "
                                         r"optimizer steps\) > learner.lr_warmup_steps \(10\)"):
        with_decay_steps(LearnerConfig(lr_decay="linear", lr_warmup_steps=10), 8)
    assert with_decay_steps(LearnerConfig(lr_warmup_steps=10), 8).lr_decay_steps == 8  # constant: warm-up only
