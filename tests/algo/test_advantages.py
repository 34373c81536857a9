"""Group advantages and filters against per-group python loops (float64, `statistics`)."""
from __future__ import annotations

import statistics

import pytest
import torch

from megarl.algo.advantages import compute_advantages, filter_groups, group_index_of, overlong_penalty
from megarl.algo.config import AdvantageConfig, validate_advantage_config


def random_groups(seed: int):
    """Shuffled samples of groups with non-contiguous ids, sizes 1..6, one constant-reward group."""
    g = torch.Generator().manual_seed(seed)
    rewards, ids = [], []
    for gid, size in zip((40, 3, 17, 99, 5, 8), (4, 1, 6, 3, 5, 2)):
        values = torch.randint(0, 3, (size,), generator=g).double() / 2 + torch.rand(size, generator=g, dtype=torch.float64) * (gid % 2)
        if gid == 17:
            values = torch.full((size,), 0.5, dtype=torch.float64)
        rewards += values.tolist()
        ids += [gid] * size
    perm = torch.randperm(len(ids), generator=g)
    return torch.tensor(rewards, dtype=torch.float64)[perm], torch.tensor(ids)[perm]


def reference_advantages(rewards, ids, cfg: AdvantageConfig) -> list[float]:
    out = []
    for i, (r, gid) in enumerate(zip(rewards.tolist(), ids.tolist())):
        group = [x for x, h in zip(rewards.tolist(), ids.tolist()) if h == gid]
        if cfg.estimator == "rloo":
            others = [x for j, (x, h) in enumerate(zip(rewards.tolist(), ids.tolist())) if h == gid and j != i]
            out.append(r - statistics.fmean(others) if others else 0.0)
            continue
        centred = r - statistics.fmean(group)
        if cfg.estimator == "grpo" and cfg.std_normalize:
            std = statistics.stdev(group) if len(group) > 1 else 0.0
            centred /= std + cfg.eps
        out.append(centred)
    return out


ESTIMATORS = [
    AdvantageConfig(estimator="grpo"),
    AdvantageConfig(estimator="grpo", std_normalize=False),
    AdvantageConfig(estimator="grpo", eps=0.1),
    AdvantageConfig(estimator="drgrpo"),
    AdvantageConfig(estimator="rloo"),
]


@pytest.mark.parametrize("cfg", ESTIMATORS, ids=lambda c: f"{c.estimator}-std{c.std_normalize}-eps{c.eps}")
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference(cfg, seed):
    rewards, ids = random_groups(seed)
    got = compute_advantages(rewards, ids, cfg)
    torch.testing.assert_close(got, torch.tensor(reference_advantages(rewards, ids, cfg), dtype=torch.float64))


@pytest.mark.parametrize("cfg", ESTIMATORS, ids=lambda c: f"{c.estimator}-std{c.std_normalize}-eps{c.eps}")
def test_constant_group_has_zero_advantage(cfg):
    rewards = torch.tensor([0.5, 0.5, 0.5, 1.0, 0.0])
    got = compute_advantages(rewards, torch.tensor([2, 2, 2, 9, 9]), cfg)
    assert got[:3].tolist() == [0.0, 0.0, 0.0]
    assert got[3] > 0 > got[4]


@pytest.mark.parametrize("cfg", ESTIMATORS, ids=lambda c: f"{c.estimator}-std{c.std_normalize}-eps{c.eps}")
@pytest.mark.parametrize("level", [3e38, -1e6, 1e6 + 0.5, 0.1])
def test_equal_rewards_give_exactly_zero_at_any_magnitude(cfg, level):
    """A float32 mean of equal values is not always the value (8 x 3e38 overflows; 0.1 sums inexactly), so a
    group of equal rewards would train on rounding noise scaled by 1/(std + eps) -- up to 0.9 -- if computed there."""
    rewards = torch.tensor([level] * 8 + [level, 0.0], dtype=torch.float32)
    got = compute_advantages(rewards, torch.tensor([1] * 8 + [2, 2]), cfg)
    assert got[:8].tolist() == [0.0] * 8 and torch.isfinite(got).all()


def test_advantages_sum_to_zero_per_group_and_float32_out():
    rewards, ids = random_groups(3)
    for cfg in ESTIMATORS:
        adv = compute_advantages(rewards.float(), ids, cfg)
        assert adv.dtype == torch.float32
        for gid in ids.unique():
            assert adv[ids == gid].sum().item() == pytest.approx(0.0, abs=1e-5)


def test_rloo_is_scaled_drgrpo():
    rewards, ids = random_groups(4)
    sizes = torch.tensor([(ids == i).sum().item() for i in ids], dtype=torch.float64)
    rloo = compute_advantages(rewards, ids, AdvantageConfig(estimator="rloo"))
    dr = compute_advantages(rewards, ids, AdvantageConfig(estimator="drgrpo"))
    torch.testing.assert_close(rloo, torch.where(sizes > 1, dr * sizes / (sizes - 1).clamp(min=1), 0.0))


def test_filter_zero_variance_and_truncated():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 2.0])
    ids = torch.tensor([7, 7, 7, 3, 3, 5, 5])
    reasons = ["stop", "length", "stop", "stop", "length", "length", "stop"]
    cfg = AdvantageConfig(filter_zero_variance=True, drop_truncated=True)
    keep, counts = filter_groups(rewards, ids, reasons, cfg)
    assert keep.tolist() == [False, False, False, True, False, False, True]
    assert counts == {
        "groups/total": 3.0,
        "samples/total": 7.0,
        "groups/zero_variance_dropped": 1.0,
        "samples/zero_variance_dropped": 3.0,
        "samples/truncated": 3.0,
        "samples/truncated_dropped": 2.0,  # the truncated sample of group 7 was already dropped
        "samples/kept": 2.0,
    }


def test_filters_off_keep_everything_but_count_truncation():
    rewards = torch.tensor([1.0, 1.0, 0.0])
    keep, counts = filter_groups(rewards, torch.tensor([0, 0, 1]), ["length", "stop", "stop"], AdvantageConfig())
    assert keep.all() and counts["samples/truncated"] == 1.0 and "groups/zero_variance_dropped" not in counts
    keep, counts = filter_groups(rewards, torch.tensor([0, 0, 1]), None, AdvantageConfig())
    assert keep.all() and counts["samples/kept"] == 3.0


@pytest.mark.parametrize("reasons,cfg", [(["stop"], AdvantageConfig()), (None, AdvantageConfig(drop_truncated=True))])
def test_filter_rejects_missing_or_misaligned_finish_reasons(reasons, cfg):
    with pytest.raises(ValueError, match="finish_reasons"):
        filter_groups(torch.zeros(3), torch.zeros(3, dtype=torch.long), reasons, cfg)


def test_group_index_of_strings():
    assert group_index_of(["b", "a", "b", "c", "a"]).tolist() == [0, 1, 0, 2, 1]


@pytest.mark.parametrize("field,value", [("estimator", "ppo"), ("eps", -1.0), ("overlong_buffer", -1),
                                         ("overlong_penalty", -0.5), ("overlong_penalty", float("inf"))])
def test_validate_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"advantage.{field}="):
        validate_advantage_config(AdvantageConfig(**{field: value}))


def dapo_length_reward(length: int, max_len: int, cache: int) -> float:
    """DAPO (Yu et al. 2025), eq. 13, as printed: R_length(y) for |y| = length, L_max = max_len, L_cache = cache."""
    if length <= max_len - cache:
        return 0.0
    if length <= max_len:
        return ((max_len - cache) - length) / cache
    return -1.0


def test_overlong_penalty_is_dapo_s_soft_overlong_punishment_scaled_by_the_penalty():
    lengths = torch.arange(0, 21)
    got = overlong_penalty(lengths, torch.full_like(lengths, 20), buffer=8, penalty=0.5)
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx([0.5 * dapo_length_reward(n, 20, 8) for n in range(21)])
    assert got[12] == 0 and got[16] == -0.25 and got[20] == -0.5  # the ramp: from limit - buffer to the limit
    assert overlong_penalty(lengths, torch.full_like(lengths, 20), buffer=0, penalty=0.5).abs().sum() == 0


def test_a_limit_below_the_buffer_ramps_over_the_whole_limit():
    """A long prompt left the request 4 tokens of room: reaching them costs the whole penalty, as at a full limit."""
    limits = torch.tensor([4, 4, 4, 20])
    got = overlong_penalty(torch.tensor([0, 2, 4, 20]), limits, buffer=8, penalty=1.0)
    assert got.tolist() == [0.0, -0.5, -1.0, -1.0]
