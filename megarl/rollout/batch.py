"""Batch assembly: scored groups from the queue -> staleness filter -> group advantages -> TrainBatch.

Staleness (`algo.max_lag`, `algo.stale`): a token is stale when the version that sampled it is more than max_lag
versions behind the learner. "drop_group" drops a group holding any stale token, whole; "mask_tokens" keeps a group
that holds a fresh token (its stale ones get no policy gradient: the loss's lag bound, loss.max_token_lag, which
megarl.config.load sets to max_lag) and drops only a group with none. Versions only grow along a rollout (a publish
lands in flight), so what a long rollout loses under mask_tokens is its oldest tokens, the beginning.

Pure functions: no I/O, no process groups; the learner loop calls them.
"""
from __future__ import annotations

import torch

from megarl.algo.advantages import compute_advantages, filter_groups, overlong_penalty
from megarl.algo.config import AdvantageConfig
from megarl.algo.values import terminal_rewards
from megarl.config.length_limit import LengthLimit
from megarl.config.schema import STALE_POLICIES
from megarl.protocols import RouteShape, Sample, TrainBatch, sample_shape_problem
from megarl.rollout.routes import pack_routes


def shaped_rewards(samples: list[Sample], adv_cfg: AdvantageConfig,
                   length_limit: LengthLimit | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rewards the advantages are computed from (float64 [N]) and the length penalty in them: the task's reward
    plus advantage.overlong_buffer's soft overlong punishment (zeros when it is off)."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    if adv_cfg.overlong_buffer == 0:
        return rewards, torch.zeros_like(rewards)
    if length_limit is None:
        raise ValueError("advantage.overlong_buffer > 0 needs each sample's length limit (a LengthLimit)")
    lengths = torch.tensor([len(s.token_ids) for s in samples])
    limits = torch.tensor([length_limit.of_prompt(len(s.prompt_ids)) for s in samples])
    penalty = overlong_penalty(lengths, limits, adv_cfg.overlong_buffer, adv_cfg.overlong_penalty)
    return rewards + penalty, penalty


def group_lag(group: list[Sample], learner_version: int) -> int:
    """Versions between the learner and the oldest token of the group."""
    return learner_version - min(s.oldest_version for s in group)


def is_stale(group: list[Sample], learner_version: int, max_lag: int, policy: str = "drop_group") -> bool:
    """Whether the group is dropped as stale. A group's advantages are relative to each other, so it is never
    cut into samples: "drop_group" drops it when any token is stale, "mask_tokens" only when every one is."""
    if policy not in STALE_POLICIES:
        raise ValueError(f"stale policy {policy!r}: must be one of {STALE_POLICIES}")
    if policy == "drop_group":
        return group_lag(group, learner_version) > max_lag
    newest = max((v for s in group for v in s.policy_versions), default=-1)
    return learner_version - newest > max_lag


def is_zero_variance(group: list[Sample], adv_cfg: AdvantageConfig, length_limit: LengthLimit | None = None) -> bool:
    """All rewards equal, as the advantages see them (length-shaped when overlong_buffer is set): every advantage
    is 0 and the group teaches nothing (DAPO dynamic sampling)."""
    return len(set(shaped_rewards(group, adv_cfg, length_limit)[0].tolist())) == 1


def assemble_batch(groups: list[list[Sample]], adv_cfg: AdvantageConfig, pad_id: int,
                   learner_version: int, route_shape: RouteShape | None = None,
                   routes_required: bool = False,
                   length_limit: LengthLimit | None = None) -> tuple[TrainBatch, dict[str, float]]:
    """The TrainBatch of these groups, and counts of what the advantage filters left out.

    Samples a filter drops (e.g. truncated ones with advantage.drop_truncated) stay in the batch
    with loss_mask 0: their rewards still count in their group's baseline. A multi-turn episode's
    environment tokens are in input_ids (the model saw them) with loss_mask 0 (it did not choose them);
    its advantage covers every model token of every turn. For an MoE model (route_shape) the samples'
    recorded routes are packed (megarl.rollout.routes); with routes_required (routing replay) a sample
    without valid routes raises ValueError naming its sampler rank. With advantage.overlong_buffer the rewards are
    length-shaped first (`shaped_rewards`, each sample's limit from `length_limit`).
    """
    samples = [s for g in groups for s in g]
    rewards, penalty = shaped_rewards(samples, adv_cfg, length_limit)
    group_index = torch.tensor([i for i, g in enumerate(groups) for _ in g], dtype=torch.long)
    advantages = compute_advantages(rewards, group_index, adv_cfg).to(torch.float32)
    keep, counts = filter_groups(rewards, group_index, [s.finish_reason for s in samples], adv_cfg)
    if adv_cfg.overlong_buffer:
        counts["reward/overlong_penalty_mean"] = penalty.mean().item()
        counts["samples/overlong_penalised"] = float((penalty < 0).sum())
    for s in samples:  # the wire's invariants: one short per-token record would shift every later sample's tokens
        if (problem := sample_shape_problem(s)) is not None:  # decode_group checked the value ranges
            raise ValueError(f"a sample of sampler {s.sampler_rank}: {problem}")
    # Every sample's tokens land with one indexed write per field, not a handful of small tensors per sample
    # (128 samples cost ~14 ms on the learner's critical path that way).
    prompt_lens = torch.tensor([len(s.prompt_ids) for s in samples])
    completion_lens = torch.tensor([len(s.token_ids) for s in samples])
    lens = prompt_lens + completion_lens
    n, width = len(samples), int(lens.max())
    rows, cols = _positions(lens, torch.zeros_like(lens))
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    input_ids[rows, cols] = torch.tensor([t for s in samples for t in (*s.prompt_ids, *s.token_ids)], dtype=torch.long)
    rows, cols = _positions(completion_lens, prompt_lens)  # the completion tokens: what the loss sees
    loss_mask = torch.zeros(n, width)
    keep = torch.as_tensor(keep, dtype=torch.float32)
    loss_mask[rows, cols] = keep[rows] * torch.tensor([m for s in samples for m in s.model_token_mask()],
                                                      dtype=torch.float32)
    behaviour = torch.zeros(n, width)
    behaviour[rows, cols] = torch.tensor([lp for s in samples for lp in s.logprobs], dtype=torch.float32)
    versions = torch.full((n, width), -1, dtype=torch.long)
    versions[rows, cols] = torch.tensor([v for s in samples for v in s.versions], dtype=torch.long)
    adv = torch.zeros(n, width)
    adv[rows, cols] = advantages[rows]
    batch = TrainBatch(input_ids=input_ids, loss_mask=loss_mask, behaviour_logprobs=behaviour,
                       versions=versions, advantages=adv, learner_version=learner_version, samples=samples,
                       routes=pack_routes(samples, width, route_shape, routes_required),
                       rewards=terminal_rewards(rewards, loss_mask) if adv_cfg.estimator == "gae" else None)
    return batch, counts


def _positions(counts: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every position when row i holds counts[i] positions from column starts[i] on, rows in
    order: the index pair that writes a concatenation of per-row runs into a padded [rows, width] tensor."""
    rows = torch.repeat_interleave(torch.arange(len(counts)), counts)
    first = torch.cumsum(counts, 0) - counts  # each row's offset in the concatenation
    cols = torch.arange(int(counts.sum())) - torch.repeat_interleave(first - starts, counts)
    return rows, cols
