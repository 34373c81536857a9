"""How far a held-out pass@k score fell below an earlier one, in standard errors: the console's warning
(megarl.observe.console) that a run is losing what it learned.

A pass@k (megarl.eval.score) is a mean over `prompts` per-prompt values in [0, 1]; a variable in [0, 1] with mean p
has variance at most p(1 - p), so each score's standard error is at most sqrt(p(1 - p) / prompts), the binomial one.
Prompts count, not samples: the samples of one prompt are not independent of each other. Two evaluations are
independent draws, so their difference has the variances' sum.
"""
from __future__ import annotations

import math

# A drop of more than this many standard errors: one chance in ~700 under noise alone. The best score is the
# highest of several evaluations (picked for being high), which the variance bound's slack offsets: a prompt's
# pass@1 over several samples varies less than a single coin does.
WELL_BELOW_SE = 3.0


def drop_in_standard_errors(best: float, now: float, prompts: int) -> float:
    """(best - now) / SE(best - now) for two pass@k scores over `prompts` prompts each (module docstring); +inf for a
    drop between two exact scores (each 0 or 1), 0 for no drop."""
    if now >= best:
        return 0.0
    se = math.sqrt((best * (1.0 - best) + now * (1.0 - now)) / max(1, prompts))
    return (best - now) / se if se > 0 else math.inf
