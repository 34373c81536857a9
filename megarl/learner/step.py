"""The backend-independent half of a learner step: which rows a DP rank trains, how they are cut into
micro-batches, one micro-batch's loss from its per-token log-probs, and the step's metrics over DP.

Every learner backend (megarl.learner.megatron, megarl.learner.deepspeed) calls these, so the loss,
advantages and metrics of a step do not depend on the backend: a backend only turns a micro-batch's
input_ids into per-token log-probs (and entropy) with gradients, and reduces the gradients.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from megarl.algo import metrics
from megarl.algo.config import DistillConfig, LossConfig, NLLConfig
from megarl.algo.distill import distill_advantages
from megarl.algo.losses import LossInputs, merge_stats, nll_loss, policy_loss
from megarl.learner import packing
from megarl.protocols import TrainBatch

# The per-token tensors of a batch a micro-batch carries (keys of the `fields` dicts below).
FIELDS = ("input_ids", "mask", "behaviour_logprobs", "advantages", "versions")


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, S] log-probs of input_ids[:, t] from logits[:, t-1] / T over the full vocabulary; column 0 is 0.

    Cross-entropy runs over every position, each scored against the next column's token (the last against
    column 0, then discarded), so the [B, S, V] logits are read in place: slicing off the last position first
    would copy them, and so would dividing by a temperature of 1."""
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    targets = torch.roll(input_ids, -1, dims=1)
    nll = torch.nn.functional.cross_entropy(scaled.reshape(-1, scaled.shape[-1]), targets.reshape(-1),
                                            reduction="none").view(input_ids.shape)
    return torch.nn.functional.pad(-nll[:, :-1], (1, 0))


def row_logprobs(logits: torch.Tensor, mb: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """[B, S] log-probs of the micro-batch's row tokens from the logits of what the model ran on (packed rows:
    read from each token's predicting position, megarl.learner.packing.token_logprobs); column 0 is 0."""
    if "unpack_index" in mb:
        return packing.token_logprobs(logits, mb, temperature)
    return token_logprobs(logits, mb["input_ids"].to(logits.device), temperature)


def position_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, S] entropy of the predictive distribution at each position (of the token after it:
    packing.next_token_values reads it per row token)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


# Positions x vocabulary entries whose entropy one no-grad slice computes at a time (a reported entropy of a long
# micro-batch must not hold a second full-size float copy of its logits).
ENTROPY_SLICE_ELEMENTS = 2**26


def token_entropy(position_entropy, logits: torch.Tensor, mb: dict[str, torch.Tensor],
                  loss_cfg, to_rows=None) -> torch.Tensor | None:
    """The policy's entropy at each row token of the micro-batch (packing.next_token_values of
    `position_entropy(logits)`, the backend's [B, S] per-position entropy): with gradient for the entropy bonus
    (loss.entropy_coef > 0), without (slices of positions, no graph) when it is only reported (loss.entropy_metric),
    else None. `to_rows` (context parallelism: a rank's positions -> the whole rows', megarl.learner.megatron)
    maps the per-position entropies first."""
    to_rows = to_rows or (lambda values: values)
    if loss_cfg.entropy_coef > 0:
        return packing.next_token_values(to_rows(position_entropy(logits)), mb)
    if not loss_cfg.entropy_metric:
        return None
    positions = max(1, ENTROPY_SLICE_ELEMENTS // max(1, logits.shape[0] * logits.shape[-1]))
    with torch.no_grad():
        detached = logits.detach()
        per_position = torch.cat([position_entropy(detached[:, i:i + positions])
                                  for i in range(0, detached.shape[1], positions)], dim=1)
    return packing.next_token_values(to_rows(per_position), mb)


def batch_totals(batch: TrainBatch) -> tuple[float, float]:
    """(masked tokens, sequences with >= 1 masked token) of the WHOLE batch: the loss's normalisers."""
    mask = batch.loss_mask.float()
    return float(mask.sum()), float((mask.sum(dim=1) > 0).sum())


def dp_share(batch: TrainBatch, dp: int, dp_rank: int) -> dict[str, torch.Tensor]:
    """This DP rank's contiguous share of the rows, sorted longest first (stable).

    Longest rows first, so each micro-batch holds rows of similar length and is trimmed to its own
    longest row: with long-tailed completions most padding is never computed.
    """
    rows = torch.arange(batch.input_ids.shape[0]).tensor_split(dp)[dp_rank]
    if len(rows) == 0:
        raise ValueError(f"batch of {batch.input_ids.shape[0]} rows is smaller than dp={dp}")
    fields = {"input_ids": batch.input_ids, "mask": batch.loss_mask.float(),
              "behaviour_logprobs": batch.behaviour_logprobs, "advantages": batch.advantages,
              "versions": batch.versions}
    if batch.rewards is not None:  # advantage.estimator=gae: per-token rewards for the critic
        fields["rewards"] = batch.rewards
    if batch.routes is not None:  # MoE: [B, S, L, k] recorded routes, travelling with their rows
        fields["routes"] = batch.routes
    fields = {k: v[rows] for k, v in fields.items()}
    order = torch.argsort(sequence_lengths(fields["mask"]), descending=True, stable=True)
    return {k: v[order] for k, v in fields.items()}


def micro_batches(fields: dict[str, torch.Tensor], max_rows: int, max_tokens: int = 0,
                  pack: bool = False, share_prefixes: bool = False) -> list[dict[str, torch.Tensor]]:
    """Split rows (sorted longest first) into micro-batches, each cut to its own longest row.

    Unpacked: `micro_batch_rows` cuts where the work is least. Packed (megarl.learner.packing): every row goes
    into packed rows as wide as the longest row (first-fit decreasing; with share_prefixes, in lexicographic
    order reusing the positions of common prefixes), and consecutive packed rows form the micro-batches: at most
    `max_rows` packed rows each (and, with max_tokens > 0, packed rows * width <= max_tokens), so a packed
    micro-batch is never larger than the unpacked bound."""
    lengths = sequence_lengths(fields["mask"])

    def rows_of(idx: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v[idx, :int(lengths[idx].max())] for k, v in fields.items()}

    if not pack:
        return [rows_of(idx) for idx in micro_batch_rows(lengths, max_rows, max_tokens)]
    width = int(lengths.max())
    per_micro = max(1, min(max_rows, max_tokens // width if max_tokens > 0 else max_rows))
    share = packing.shares_prefixes(fields, share_prefixes)
    bins = packing.plan_bins(fields["input_ids"], lengths.tolist(), width, share)
    micro = []
    for start in range(0, len(bins), per_micro):
        group = bins[start:start + per_micro]
        idx = torch.tensor(sorted(i for b in group for i in b))
        local = {int(row): j for j, row in enumerate(idx)}
        micro.append(packing.pack(rows_of(idx), lengths[idx], [[local[i] for i in b] for b in group], share))
    return micro


def needs_proximal_logprobs(loss_cfg: LossConfig, critic=None) -> bool:
    """Whether a step needs the policy's no-grad log-probs at its start (`proximal_logprobs`): the decoupled
    objective's pi_prox, and the V-trace value targets' pi (a critic with target=vtrace: megarl.learner.critic)."""
    return loss_cfg.decoupled or (critic is not None and critic.needs_policy_logprobs)


def attach_extra_logprobs(micro: list[dict[str, torch.Tensor]], passes: dict, forward_logprobs) -> None:
    """No-grad log-probs of each micro-batch's rows under each model of `passes` (key -> model or None),
    stored in the micro-batch under that key, before the step: the decoupled objective's proximal policy
    (the weights at the start of this step) and the frozen reference (KL penalty).
    `forward_logprobs(model, micro)` is the backend's own forward over the micro-batches (their input_ids,
    and their routes where the backend replays them)."""
    for key, model in passes.items():
        if model is not None:
            model.eval()
            for mb, lp in zip(micro, forward_logprobs(model, micro)):
                mb[key] = lp


def router_partials(micro: list[dict[str, torch.Tensor]], matches: list[torch.Tensor], decisions: int,
                    learner_version: int, loss_cfg: LossConfig) -> list[dict[str, torch.Tensor]]:
    """Per micro-batch, the router-agreement partials of its trained tokens (megarl.algo.metrics.router_partials)
    from `matches` ([B, S] per micro-batch: megarl.algo.metrics.route_matches of the sampler's recorded routes
    and the learner's own top-k, over every MoE layer); `decisions` = MoE layers * top_k."""
    from megarl.algo import metrics

    return [metrics.router_partials(m, decisions, mb["mask"], mb["versions"], learner_version,
                                    getattr(loss_cfg, "max_lag_bucket", 8)) for m, mb in zip(matches, micro)]


def pad_micro_batches(micro: list[dict[str, torch.Tensor]], count: int,
                      share_prefixes: bool = False) -> list[dict[str, torch.Tensor]]:
    """The same rows in exactly `count` micro-batches (count >= len(micro)), for layers whose collectives
    pair the ranks micro-batch by micro-batch (expert parallelism's alltoall): the micro-batch with the
    most rows is split in two while one has more than a row; past that, one-row micro-batches repeating
    the first row with nothing trained (mask, advantages 0: no loss, no gradient) are appended."""
    if "unpack_index" in micro[0]:  # packed: split the rows, then pack each part again
        return [packing.pack(mb, sequence_lengths(mb["mask"]), share_prefixes=share_prefixes)
                for mb in pad_micro_batches([packing.unpacked(mb) for mb in micro], count)]
    micro = list(micro)
    while len(micro) < count:
        widest = max(range(len(micro)), key=lambda i: micro[i]["input_ids"].shape[0])
        rows = micro[widest]["input_ids"].shape[0]
        if rows > 1:
            first, second = ({k: v[part] for k, v in micro[widest].items()}
                             for part in (slice(0, rows // 2), slice(rows // 2, rows)))
            micro[widest:widest + 1] = [first, second]
        else:
            filler = {k: v[:1].clone() for k, v in micro[0].items()}
            filler["mask"].zero_()
            filler["advantages"].zero_()
            micro.append(filler)
    return micro


def micro_batch_loss(logprobs: torch.Tensor, mb: dict[str, torch.Tensor], learner_version: int,
                     totals: tuple[float, float], loss_cfg: LossConfig,
                     entropy: torch.Tensor | None = None,
                     distill: DistillConfig | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's share of the batch loss (global normalisers: the shares of a step, over all
    micro-batches and DP ranks, add up to the batch loss) and its partial statistics.

    `mb` holds the FIELDS on the logits' device, plus `proximal_logprobs` / `ref_logprobs` when the
    objective needs them (no-grad passes before the step), and `teacher_logprobs` under on-policy distillation
    (`distill`: the advantages become megarl.algo.distill's, the teacher-KL partials join the statistics).
    With `NLLConfig` (megarl sft) the loss is the supervised one, `nll_loss`, on the same masks and normalisers."""
    if isinstance(loss_cfg, NLLConfig):
        return nll_loss(logprobs, mb["mask"], totals[0])
    advantages, teacher_stats = mb["advantages"], {}
    if distill is not None:
        if "teacher_logprobs" not in mb:
            raise ValueError("on-policy distillation needs each micro-batch's teacher_logprobs (the learner attaches "
                             "them before the step: megarl.learner.teacher.Teacher.attach)")
        advantages = distill_advantages(logprobs, mb["teacher_logprobs"], advantages, mb["mask"], distill)
        teacher_stats = metrics.teacher_partials(logprobs, mb["teacher_logprobs"], mb["mask"], mb["versions"],
                                                 learner_version, loss_cfg.max_lag_bucket)
    inputs = LossInputs(
        behaviour_logprobs=mb["behaviour_logprobs"], advantages=advantages, mask=mb["mask"],
        versions=mb["versions"], learner_version=learner_version,
        total_tokens=totals[0], total_seqs=totals[1],
        proximal_logprobs=mb.get("proximal_logprobs"), ref_logprobs=mb.get("ref_logprobs"),
        entropy=entropy,
    )
    loss, stats = policy_loss(logprobs, inputs, loss_cfg)
    return loss, {**stats, **teacher_stats}


def dp_merged_stats(stats_list: list[dict[str, torch.Tensor]], dp: int, group=None) -> dict[str, float]:
    """The step's loss metrics from every DP rank's micro-batch statistics (collective over `group`
    when dp > 1: every DP rank saw its own rows, so all of their partial sums are merged)."""
    if dp > 1:
        gathered = [None] * dp
        dist.all_gather_object(gathered, [{k: v.cpu() for k, v in st.items()} for st in stats_list], group=group)
        stats_list = [st for rank_stats in gathered for st in rank_stats]
    return merge_stats(stats_list)


def position_metrics(fields: dict[str, torch.Tensor], micro: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """`padding_frac`: the share of the computed positions (the micro-batches' trimmed or packed shapes) that hold
    no row's token; `shared_frac`: the share of the rows' positions computed once for several rows (packed rows
    sharing prefixes)."""
    computed = sum(mb.get("packed_ids", mb["input_ids"]).numel() for mb in micro)
    positions = float(sequence_lengths(fields["mask"]).sum())
    placed = sum(float((mb["packed_owner"] >= 0).sum()) if "packed_owner" in mb  # each placed position, once
                 else float(sequence_lengths(mb["mask"]).sum()) for mb in micro)
    return {"padding_frac": 1.0 - placed / computed, "shared_frac": 1.0 - placed / positions}


# What one more micro-batch costs, in computed positions: besides its per-position work a micro-batch's
# forward and backward pay a fixed cost (module calls, autograd bookkeeping, the loss's small ops, kernel
# launches on a GPU). Measured on the demo model on one CPU core: ~14 ms per micro-batch against ~26 us per
# position (docs/learner.md, "Cutting a batch into micro-batches"), i.e. ~540 positions.
MICRO_BATCH_COST_POSITIONS = 512


def micro_batch_rows(lengths: torch.Tensor, max_rows: int, max_tokens: int = 0,
                     cost_positions: int = MICRO_BATCH_COST_POSITIONS) -> list[torch.Tensor]:
    """Row indices of each micro-batch, for rows sorted longest first: consecutive runs of at most `max_rows`
    rows (and, with a token budget max_tokens > 0, rows * the run's longest row <= max_tokens; a row longer
    than the budget alone), cut where the work is least.

    A micro-batch computes rows x its own longest row positions plus a fixed cost (`cost_positions`), so
    with long-tailed lengths cutting the few long rows off the many short ones saves most of the padding,
    while cutting rows of equal length only adds micro-batches. The cuts minimise that total exactly (a
    shortest path over the cut points, O(rows x max_rows)).
    """
    n = len(lengths)
    width = lengths.numpy().astype(np.float64)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        starts = np.arange(max(0, end - max_rows), end)
        rows = end - starts
        work = best[starts] + rows * width[starts] + cost_positions
        if max_tokens > 0:
            work[(rows > 1) & (rows * width[starts] > max_tokens)] = np.inf
        i = int(np.argmin(work))  # the first minimum: the longest micro-batch among equals
        best[end], cut[end] = work[i], int(starts[i])
    groups, end = [], n
    while end > 0:
        groups.append(torch.arange(cut[end], end))
        end = cut[end]
    return groups[::-1]


def sequence_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Per row, one past the last trained position (completions end their sequence); 1 for a row with
    no trained token, which then costs one position."""
    positions = torch.arange(1, mask.shape[1] + 1).expand_as(mask)
    return (positions * (mask > 0)).max(dim=1).values.clamp(min=1)
