"""The stop rule for skipped (non-finite) optimizer steps: in a row, and a run that skipped every step."""
import math

import pytest

from megarl.learner.nonfinite import NonfiniteSteps

FINITE = {"skipped_nonfinite": 0.0, "loss": 0.5, "grad_norm": 1.0}
SKIPPED = {"skipped_nonfinite": 1.0, "loss": math.inf, "grad_norm": math.nan}


def run(steps: list[dict], max_in_row: int = 5) -> NonfiniteSteps:
    rule = NonfiniteSteps(max_in_row, "learner", "Lower learner.lr or check the rewards and data.")
    for step, metrics in enumerate(steps):
        rule.count(metrics, step, last=step == len(steps) - 1)
    return rule


def test_a_short_run_that_skipped_every_step_stops_instead_of_ending_done():
    # Three steps of a reward that is inf in float32: each skipped, fewer than max_nonfinite_in_row in a row.
    with pytest.raises(RuntimeError) as exc:
        run([SKIPPED] * 3)
    assert str(exc.value) == (
        "learner: every one of the run's 3 optimizer steps had a non-finite loss or grad norm (last: loss=inf, "
        "grad_norm=nan) and was skipped, so the run trained nothing (it ended before learner.max_nonfinite_in_row=5 "
        "in a row). Lower learner.lr or check the rewards and data.")


def test_skipped_steps_in_a_row_stop_at_the_limit_and_a_run_that_trained_ends_normally():
    with pytest.raises(RuntimeError, match=r"^learner: 2 optimizer steps in a row had a non-finite loss or grad norm "
                                           r"\(last: loss=inf, grad_norm=nan\) and were skipped; stopping at step 4 "
                                           r"\(learner.max_nonfinite_in_row=2\)"):
        run([FINITE, SKIPPED, FINITE, SKIPPED, SKIPPED, FINITE], max_in_row=2)
    rule = run([SKIPPED, FINITE, SKIPPED, SKIPPED])  # one step trained: not every step skipped
    assert (rule.steps, rule.skipped, rule.in_row) == (4, 3, 2)
    run([FINITE])


def test_a_critic_warmup_step_without_a_policy_grad_norm_counts():
    """The DeepSpeed learner's critic warm-up steps run no policy backward, so their metrics have no grad_norm
    (megarl.learner.deepspeed); the rule must count them, not fail on the missing key."""
    warmup = {"skipped_nonfinite": 0.0, "loss": 0.5, "critic/warmup": 1.0}
    rule = run([warmup, FINITE])
    assert (rule.steps, rule.skipped) == (2, 0)
