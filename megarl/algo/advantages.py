"""Group-relative advantages and group filtering, as pure functions of per-sample tensors.

Every prompt is sampled G times; the G samples form a group (`group_index`, any long ids, need not
be contiguous or sorted).  An advantage is the sample's reward minus a baseline built from its own
group, so no value network is needed:

    grpo   A_i = (R_i - mean_g) / (std_g + eps)      std_g unbiased (Bessel), as TRL and verl do;
                                                     without `std_normalize`: R_i - mean_g
    drgrpo A_i = R_i - mean_g                        Dr.GRPO: the std division biases towards
                                                     too-easy / too-hard prompts, so drop it
    rloo   A_i = R_i - mean_{j != i} R_j             = G/(G-1) (R_i - mean_g), leave-one-out

(`gae` is not a group estimator: its advantages are per token, from a learned critic on the learner.)
A group of one sample has no baseline: its advantage is 0.  `overlong_penalty` shapes a reward by the sample's
length before any of this (DAPO's soft overlong punishment).  `filter_groups` decides which samples
are trained on (DAPO's dynamic sampling and overlong filtering) and counts what it drops; the
advantage of a kept sample is computed over its whole group, dropped samples included.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from megarl.algo.config import AdvantageConfig, validate_advantage_config


def group_index_of(group_ids: Sequence[str]) -> Tensor:
    """Long group index [N] for string group ids (e.g. Sample.group_id), in order of first appearance."""
    index: dict[str, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)


def compute_advantages(rewards: Tensor, group_index: Tensor, cfg: AdvantageConfig) -> Tensor:
    """Per-sample advantages [N] (float32, or the rewards' float dtype if wider)."""
    validate_advantage_config(cfg)
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    if cfg.estimator == "gae":  # per token, by the learner's critic (TrainBatch.rewards, megarl.algo.values)
        return torch.zeros_like(rewards, dtype=dtype)
    # The statistics run in float64 over each reward's distance from its group's smallest: a group of equal
    # rewards is then exactly 0 everywhere (in float32, eight equal rewards of 3e38 gave advantages of 0.9).
    inverse, n_groups = _groups(group_index)
    rewards = rewards.to(torch.float64)
    rewards = rewards - _group_reduce(rewards, inverse, n_groups, "amin")[inverse]
    size, mean, std = _group_stats(rewards, group_index)
    centred = rewards - mean
    if cfg.estimator == "rloo":
        # R_i - (G mean - R_i)/(G-1) = G/(G-1) (R_i - mean); singleton groups -> 0.
        advantages = torch.where(size > 1, centred * size / (size - 1).clamp(min=1), 0.0)
    elif cfg.estimator == "grpo" and cfg.std_normalize:
        advantages = centred / (std + cfg.eps)
    else:
        advantages = centred
    return advantages.to(dtype)


def overlong_penalty(lengths: Tensor, limits: Tensor, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), per sample, <= 0: 0 while the length stays at or
    below limit - buffer, then falling linearly to -penalty at the limit (a truncated sample). A request whose
    limit was below `buffer` (a long prompt left less room) ramps over its whole limit, so reaching the limit
    costs the whole penalty whatever the prompt. buffer 0 = off (all zeros)."""
    lengths, limits = lengths.to(torch.float64), limits.to(torch.float64)
    if buffer == 0:
        return torch.zeros_like(lengths)
    start = (limits - buffer).clamp(min=0)
    return -penalty * ((lengths - start) / (limits - start).clamp(min=1)).clamp(0, 1)


def filter_groups(
    rewards: Tensor,
    group_index: Tensor,
    finish_reasons: Sequence[str] | None,
    cfg: AdvantageConfig,
) -> tuple[Tensor, dict[str, float]]:
    """Which samples to train on (bool [N]), and counts of what was dropped and why.

    filter_zero_variance (DAPO dynamic sampling): a group whose rewards are all equal has zero
    advantage everywhere; training on it only dilutes the batch, so the whole group is dropped.
    drop_truncated (DAPO overlong filtering): a sample cut off by the length limit
    (finish_reason == "length") is dropped; its reward still counts in its group's baseline.
    """
    validate_advantage_config(cfg)
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    keep = torch.ones_like(rewards, dtype=torch.bool)
    inverse, n_groups = _groups(group_index)
    counts = {"groups/total": float(n_groups), "samples/total": float(rewards.numel())}
    if cfg.filter_zero_variance:
        spread = _group_reduce(rewards, inverse, n_groups, "amax") - _group_reduce(rewards, inverse, n_groups, "amin")
        flat = spread == 0
        keep &= ~flat[inverse]
        counts["groups/zero_variance_dropped"] = float(flat.sum())
        counts["samples/zero_variance_dropped"] = float(flat[inverse].sum())
    if finish_reasons is None and cfg.drop_truncated:
        raise ValueError("advantage.drop_truncated=True needs finish_reasons (one per sample)")
    if finish_reasons is not None:
        if len(finish_reasons) != rewards.numel():
            raise ValueError(f"finish_reasons has {len(finish_reasons)} entries for {rewards.numel()} rewards")
        truncated = torch.tensor([r == "length" for r in finish_reasons], dtype=torch.bool, device=rewards.device)
        counts["samples/truncated"] = float(truncated.sum())
        if cfg.drop_truncated:
            counts["samples/truncated_dropped"] = float((truncated & keep).sum())
            keep &= ~truncated
    counts["samples/kept"] = float(keep.sum())
    return keep, counts


def _group_stats(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group size, group mean and unbiased group std (0 for a singleton group)."""
    inverse, n_groups = _groups(group_index)
    size = _group_reduce(torch.ones_like(rewards), inverse, n_groups, "sum")
    mean = _group_reduce(rewards, inverse, n_groups, "sum") / size.clamp(min=1)
    sq_dev = _group_reduce((rewards - mean[inverse]).square(), inverse, n_groups, "sum")
    std = (sq_dev / (size - 1).clamp(min=1)).sqrt()
    return size[inverse], mean[inverse], std[inverse]


def _groups(group_index: Tensor) -> tuple[Tensor, int]:
    """Dense group number in [0, n_groups) of every sample, and n_groups."""
    ids, inverse = torch.unique(group_index, return_inverse=True)
    return inverse, ids.numel()


def _group_reduce(values: Tensor, inverse: Tensor, n_groups: int, reduce: str) -> Tensor:
    out = torch.zeros(n_groups, dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, inverse, values, reduce=reduce, include_self=False)
