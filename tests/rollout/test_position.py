"""The data position: retired group indices per sampler stream, kept compactly, and what a resumed
sampler issues from them."""
import itertools
import os
import random
import subprocess
import sys

import pytest

from megarl.rollout.position import DataPosition, RetiredIndices, group_id, parse_group_id
from tests.helpers import REPO


def test_group_ids_round_trip_and_reject_strangers():
    assert group_id(3, 17) == "s3-g17"
    assert parse_group_id("s3-g17") == (3, 17)
    for bad in ("s3-g", "g17", "s3-g17/0", "s-1-g2", "x3-g1"):
        with pytest.raises(ValueError, match="not a megarl group id"):
            parse_group_id(bad)


def test_out_of_order_retirement_is_a_cursor_plus_the_few_above_it():
    retired = RetiredIndices()
    for k in (0, 2, 3, 7):
        retired.add(k)
    assert (retired.cursor, retired.above, len(retired)) == (1, {2, 3, 7}, 4)
    retired.add(1)  # fills the gap: the cursor jumps over everything contiguous
    assert (retired.cursor, retired.above, len(retired)) == (4, {7}, 5)
    retired.add(2)  # retiring twice changes nothing
    assert len(retired) == 5
    assert [k in retired for k in range(9)] == [True] * 4 + [False] * 3 + [True, False]


def test_unretired_is_every_missing_index_in_order():
    retired = RetiredIndices.from_dict({"cursor": 3, "above": [4, 6]})
    assert list(itertools.islice(retired.unretired(), 5)) == [3, 5, 7, 8, 9]


def test_random_retirement_orders_agree_with_a_plain_set():
    rng = random.Random(0)
    for _ in range(50):
        order = list(range(40))
        rng.shuffle(order)
        cut = rng.randrange(41)
        retired = RetiredIndices()
        for k in order[:cut]:
            retired.add(k)
        expected = set(order[:cut])
        assert len(retired) == len(expected)
        assert {k for k in range(40) if k in retired} == expected
        missing = list(itertools.islice(retired.unretired(), 40 - cut))
        assert missing == sorted(set(range(40)) - expected)
        assert RetiredIndices.from_dict(retired.to_dict()) == retired


def test_malformed_records_are_refused():
    with pytest.raises(ValueError, match="malformed"):
        RetiredIndices.from_dict({"cursor": 5, "above": [5]})
    with pytest.raises(ValueError, match=">= 0"):
        RetiredIndices().add(-1)


def test_position_tracks_each_stream_and_round_trips_through_json():
    import json

    position = DataPosition()
    for gid in ("s0-g0", "s1-g1", "s0-g2", "s1-g0"):
        position.retire(gid)
    restored = DataPosition.from_dict(json.loads(json.dumps(position.to_dict())))
    assert restored == position
    assert (restored.stream(0).cursor, restored.stream(0).above) == (1, {2})
    assert restored.stream(1).cursor == 2
    assert len(restored.stream(5)) == 0  # a sampler the checkpoint never saw starts from index 0


def test_a_group_prompt_depends_only_on_seed_stream_and_index():
    from megarl.rollout.tasks import ArithmeticTask, prompt_rng

    task = ArithmeticTask()

    def prompt(seed, stream, index):
        return task.sample_prompts(prompt_rng(seed, stream, index), 1)[0].text

    # Drawn in any order, in any process: the same prompt (what lets a resumed sampler re-issue group k).
    forward = [prompt(0, 1, k) for k in range(50)]
    assert [prompt(0, 1, k) for k in reversed(range(50))] == forward[::-1]
    assert len(set(forward)) > 30  # and they do vary with k,
    assert forward != [prompt(0, 2, k) for k in range(50)]  # with the sampler
    assert forward != [prompt(1, 1, k) for k in range(50)]  # and with the run seed
    other = subprocess.run(  # another interpreter, another str-hash seed
        [sys.executable, "-c", "from megarl.rollout.tasks import ArithmeticTask, prompt_rng; "
                               "print(ArithmeticTask().sample_prompts(prompt_rng(0, 1, 7), 1)[0].text)"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONHASHSEED": "123", "PYTHONPATH": str(REPO)})
    assert other.stdout.strip() == forward[7], other.stderr
