"""Which finished groups a sampler sends to the learner now: algo.queue_order.

The learner trains the groups in the order they reach it, `prompts_per_step` per step, and drops a group
whose oldest token is more than `max_lag` versions old (algo.stale=drop_group, the default; under mask_tokens
those tokens get no gradient instead). A sampler starts groups while its staleness budget
allows ((max_lag + 1) batches outstanding); if it sent each group as soon as it was scored, short groups
would overtake long ones started before them, and the long ones would reach the learner stale and be
dropped: the trained batches would lean towards short completions (benchmarks/stale_bias.py measured 13% of
the demo's groups dropped, nearly all long). Three orders:

  "finish"    every scored group at once (overtaking allowed; stale ones are dropped).
  "start"     in the order the sampler started them: a scored group waits for every older one. With the
              budget, no group of a sampler that keeps its share of the learner's pace goes stale, but
              every group waits for the stragglers before it, so the trained tokens are older on average.
  "deadline"  a scored group goes ahead of older, unfinished ones only while each of those can still reach
              the learner in time: at the earliest it lands in batch version + (groups ahead of it) // share,
              and it must land by its own deadline, start version + max_lag. No group that could be trained
              in time is pushed past its deadline, and no scored group waits when no older one needs it to.

Pure: `groups_to_send` sees the unsent groups in start order and what the sampler knows of the learner.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.config.schema import QUEUE_ORDERS

ORDERS = QUEUE_ORDERS  # algo.queue_order


@dataclass(frozen=True)
class Unsent:
    """A group a sampler started and has not sent."""
    scored: bool  # finished and scored: ready to send
    # The version of its oldest token, or for a group still running the version its first token will be
    # generated under at the earliest. Not an earlier version "to be safe": a group thought older than it
    # is may be judged too late to make it, and stop holding younger groups back.
    start_version: int


def groups_to_send(unsent: list[Unsent], order: str, in_pipe: int, version: int, share: float,
                   max_lag: int) -> list[int]:
    """Indices into `unsent` (in start order) of the scored groups to send now, in that order.

    in_pipe: groups this sampler sent that the learner has not retired yet (they are ahead in its queue);
    version: the learner's version as the sampler last heard it, with the retired count in_pipe was
    taken from (the version whose batch the learner is collecting); share: this sampler's groups per
    learner batch (prompts_per_step / samplers)."""
    if order not in ORDERS:
        raise ValueError(f"queue order {order!r}: expected one of {ORDERS}")
    if order == "finish":
        return [i for i, group in enumerate(unsent) if group.scored]
    if order == "start":
        return list(range(next((i for i, group in enumerate(unsent) if not group.scored), len(unsent))))
    send: list[int] = []
    # The fewest further sends any older unfinished group still allows: an unfinished group with `waiting`
    # unfinished ones before it lands in batch version + (in_pipe + sends + waiting) // share at the earliest,
    # in time while in_pipe + sends + waiting < (its deadline - version + 1) * share. One that cannot make it
    # whatever is sent will be dropped: it neither holds groups back nor takes a place in a batch.
    slack, waiting = math.inf, 0
    for i, group in enumerate(unsent):
        if not group.scored:
            room = (group.start_version + max_lag - version + 1) * share - (in_pipe + len(send) + waiting)
            if room > 0:
                slack = min(slack, room)
                waiting += 1
        elif slack > 1:
            send.append(i)
            slack -= 1
    return send

