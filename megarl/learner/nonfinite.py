"""When optimizer steps skipped as non-finite stop a run (megarl train's learner loop and megarl sft).

A learner skips a step whose loss or grad norm is NaN or inf (no update, version unchanged,
`skipped_nonfinite=1` in its metrics). A skipped step changes nothing, so a run whose steps keep being
skipped trains nothing while it looks alive. It stops with an error, never "done":
  * after `learner.max_nonfinite_in_row` skipped steps in a row, or
  * at its last step when every step it ran was skipped (a run shorter than that limit: three steps of a
    reward that is inf in float32 would otherwise end "done, 3 steps" with exit status 0).
The error is raised before the step is recorded, so the closing summary is not printed; every learner rank
sees the same metrics, so all of them stop together.
"""
from __future__ import annotations


class NonfiniteSteps:
    """Counts one run's optimizer steps (since this launch: a resumed run counts from its checkpoint)."""

    def __init__(self, max_in_row: int, who: str, advice: str):
        self.max_in_row, self.who, self.advice = max_in_row, who, advice  # who: the error's prefix
        self.steps = self.skipped = self.in_row = 0

    def count(self, metrics: dict, step: int, last: bool) -> None:
        """One optimizer step's metrics (`step`: the run's step; `last`: its final optimizer step); RuntimeError
        when the run must stop."""
        skipped = bool(metrics["skipped_nonfinite"])
        self.steps += 1
        self.skipped += skipped
        self.in_row = self.in_row + 1 if skipped else 0
        # (a DeepSpeed critic warm-up step runs no policy backward: it has no grad_norm)
        values = f"(last: loss={metrics['loss']}, grad_norm={metrics.get('grad_norm')})"
        if self.in_row >= self.max_in_row:
            raise RuntimeError(
                f"{self.who}: {self.in_row} optimizer steps in a row had a non-finite loss or grad norm {values} and "
                f"were skipped; stopping at step {step} (learner.max_nonfinite_in_row={self.max_in_row}). {self.advice}")
        if last and self.skipped == self.steps:
            raise RuntimeError(
                f"{self.who}: every one of the run's {self.steps} optimizer steps had a non-finite loss or grad norm "
                f"{values} and was skipped, so the run trained nothing (it ended before "
                f"learner.max_nonfinite_in_row={self.max_in_row} in a row). {self.advice}")
