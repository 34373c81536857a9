"""algo.queue_order: which scored groups a sampler sends now (megarl/rollout/send_order.py)."""
import random

import pytest

from megarl.rollout.send_order import Unsent, groups_to_send


def unsent(*groups: tuple[bool, int]) -> list[Unsent]:
    return [Unsent(scored, start_version) for scored, start_version in groups]


def test_finish_sends_every_scored_group_and_start_only_those_before_the_first_unfinished():
    groups = unsent((True, 0), (False, 0), (True, 0), (True, 1))
    assert groups_to_send(groups, "finish", in_pipe=0, version=0, share=4, max_lag=1) == [0, 2, 3]
    assert groups_to_send(groups, "start", in_pipe=0, version=0, share=4, max_lag=1) == [0]
    assert groups_to_send(unsent((True, 0), (True, 0)), "start", 0, 0, 4, 1) == [0, 1]
    with pytest.raises(ValueError, match="queue order 'random'"):
        groups_to_send(groups, "random", 0, 0, 4, 1)


def test_deadline_lets_younger_groups_overtake_while_the_older_one_still_lands_in_time():
    # share 4, max_lag 1: a group started at version 0 must be in batch 0 or 1, i.e. among the first 8
    # the learner takes from version 0 on. Ahead of the unfinished one: at most 7.
    groups = unsent((False, 0), *[(True, 0)] * 10)
    assert groups_to_send(groups, "deadline", in_pipe=0, version=0, share=4, max_lag=1) == list(range(1, 8))
    # Three already on their way to the learner leave room for four.
    assert groups_to_send(groups, "deadline", in_pipe=3, version=0, share=4, max_lag=1) == [1, 2, 3, 4]
    # The learner has moved on to version 1 (and retired what it trained): the last batch it may land in.
    assert groups_to_send(groups, "deadline", in_pipe=0, version=1, share=4, max_lag=1) == [1, 2, 3]
    # Every unfinished group counts: the second one must land by batch 1 too, behind the first.
    assert groups_to_send(unsent((False, 0), (False, 0), *[(True, 0)] * 10), "deadline", 0, 0, 4, 1) == \
        list(range(2, 8))
    # Nothing is held when no older group is unfinished, or finished older groups go first anyway.
    assert groups_to_send(unsent((True, 0), (True, 0)), "deadline", 0, 0, 4, 1) == [0, 1]


def test_deadline_is_not_held_back_by_a_group_that_will_be_stale_anyway():
    groups = unsent((False, 0), (True, 3), (True, 3))
    assert groups_to_send(groups, "deadline", in_pipe=0, version=3, share=4, max_lag=1) == [1, 2]
    # nor does it take a place ahead of the others (the learner will drop it, not train it).
    groups = unsent((False, 0), (False, 3), *[(True, 3)] * 10)
    assert groups_to_send(groups, "deadline", in_pipe=0, version=3, share=4, max_lag=0) == [2, 3, 4]
    # ... but one that can just make it holds everything behind it.
    assert groups_to_send(unsent((False, 3), (True, 3)), "deadline", in_pipe=3, version=3, share=4, max_lag=0) == []


def simulate(order: str, seed: int, share: int = 4, max_lag: int = 1, steps: int = 60) -> dict:
    """One sampler under the staleness budget ((max_lag + 1) * share outstanding), groups taking a random,
    long-tailed number of ticks; a learner that trains a step as soon as `share` usable groups are in its
    queue (dropping stale ones, as learner_main does) and retires them. Per group: when it was scored and
    when it was sent."""
    rng = random.Random(seed)
    budget = (max_lag + 1) * share
    version = started = retired = sent = 0
    groups: list[dict] = []  # start order
    queue: list[dict] = []
    dropped = trained = tick = 0
    waits = []
    while version < steps:
        while started - retired < budget:
            groups.append({"start": version, "ready_at": tick + min(int(rng.paretovariate(1.2)), 40), "sent": False})
            started += 1
        pending = [g for g in groups if not g["sent"]]
        due = groups_to_send([Unsent(g["ready_at"] <= tick, g["start"]) for g in pending], order,
                             sent - retired, version, share, max_lag)
        for i in due:
            pending[i]["sent"] = True
            waits.append(tick - pending[i]["ready_at"])
            queue.append(pending[i])
            sent += 1
        usable = []
        while queue and len(usable) < share:
            group = queue.pop(0)
            if version - group["start"] > max_lag:
                dropped += 1
                retired += 1
            else:
                usable.append(group)
        if len(usable) == share:
            version, retired, trained = version + 1, retired + share, trained + share
        else:
            queue[:0] = usable
        tick += 1
    return {"dropped": dropped, "trained": trained, "mean_wait": sum(waits) / len(waits), "ticks": tick}


@pytest.mark.parametrize("seed", range(5))
def test_under_the_budget_deadline_and_start_order_drop_nothing_and_deadline_holds_groups_less(seed):
    finish, start, deadline = (simulate(order, seed) for order in ("finish", "start", "deadline"))
    assert finish["dropped"] > 0  # long groups overtaken go stale: what the orders are for
    assert start["dropped"] == 0 and deadline["dropped"] == 0
    assert deadline["mean_wait"] < start["mean_wait"]
    assert deadline["ticks"] <= start["ticks"]
