"""Safe reward evaluation: one bad reward call must never stop a run.

`score` wraps `task.reward`. A reward function that raises, or returns something that is not a
finite real number (None, a string, NaN, inf), yields reward 0.0 and an error string; the
caller records the string on the Sample (`Sample.reward_error`) and counts it, so a buggy user
reward shows up in the metrics instead of as a crashed sampler or a NaN loss.
"""
from __future__ import annotations

import math
import numbers

from megarl.protocols import Prompt, Task


def score(task: Task, prompt: Prompt, completion: str) -> tuple[float, str | None]:
    """(reward, None) on success, else (0.0, "<ExceptionType: message>")."""
    try:
        value = task.reward(prompt, completion)
    except Exception as exc:  # noqa: BLE001 - any user-code failure is reported, not raised
        return 0.0, f"{type(exc).__name__}: {exc}"
    # bool is a numbers.Real; accept it (True -> 1.0) since "correct?" predicates are common rewards.
    if not isinstance(value, numbers.Real):
        return 0.0, f"TypeError: reward must be a real number, got {type(value).__name__} {value!r:.80}"
    value = float(value)
    # inf is rejected with NaN: either one turns every group advantage it touches into NaN.
    if not math.isfinite(value):
        return 0.0, f"ValueError: reward must be finite, got {value}"
    return value, None
