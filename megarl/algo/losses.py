"""The off-policy policy-gradient objective, as a pure function of per-token tensors.

In Pipeline RL one rollout mixes tokens from several policy versions, so every importance ratio is
per token against that token's own behaviour log-prob mu_t (never one denominator per sequence):

    rho_t = pi_theta(a_t) / mu_t                       behaviour ratio (metrics, TIS, IcePop band)
    r_t   = pi_theta(a_t) / anchor_t                   ratio inside the surrogate
            anchor = mu (default) or pi_prox (decoupled); per token, or GSPO's sequence geometric mean
    l_t   = max(-A r_t, -A clip(r_t, 1-eps_low, 1+eps_high))   [min(., -c A) for A < 0: dual clip]
            * sg(min(pi_prox/mu, cap))                         [decoupled]
         or -sg(min(r_t, cap)) A log pi_theta                  [truncated IS, no clip]
    loss  = agg(keep_t * decay^lag_t * l_t) + kl_coef * agg(KL_t) - entropy_coef * agg(H_t)

`policy_loss` is called once per micro-batch.  Its loss is that micro-batch's *contribution*:
aggregations divide by the global totals carried in LossInputs, so the micro-batch losses of a step
(over all DP ranks) add up to the batch loss.  docs/algorithms.md gives each option's formula, the
paper that introduced it and what its metrics should look like.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megarl.algo import metrics
from megarl.algo.config import LossConfig, validate_loss_config


@dataclass
class LossInputs:
    behaviour_logprobs: Tensor  # [B,S]
    advantages: Tensor  # [B,S]
    mask: Tensor  # [B,S] float
    versions: Tensor  # [B,S] long, -1 off-mask
    learner_version: int
    total_tokens: float  # masked tokens in the WHOLE batch (all micro-batches, all DP ranks)
    total_seqs: float  # sequences with >=1 masked token in the whole batch
    proximal_logprobs: Tensor | None = None  # decoupled objective: learner logprobs at step start
    ref_logprobs: Tensor | None = None  # KL to a reference policy
    entropy: Tensor | None = None  # per-token entropy of the learner policy, for the bonus/metrics


def policy_loss(logprobs: Tensor, inputs: LossInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch's contribution to the batch loss, and its partial statistics.

    logprobs: learner log-probs [B, S] with grad, aligned like every other per-token tensor.
    Whole sequences are never split across micro-batches (seq_mean and GSPO rely on it).
    """
    validate_loss_config(cfg)
    _check_inputs(inputs, cfg)
    # Ratios of nearly equal log-probs lose everything below bf16's 3 digits: work in >= fp32.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    logp = logprobs.to(dtype)
    mask = inputs.mask.to(dtype)
    on = mask > 0
    mu = inputs.behaviour_logprobs.to(dtype)
    adv = inputs.advantages.to(dtype)
    prox = inputs.proximal_logprobs.detach().to(dtype) if cfg.decoupled else None

    # Off-mask positions (prompt, padding) get log-ratio 0 *before* exp: garbage there must not
    # produce inf, whose 0 * inf gradient would be NaN.
    log_rho = torch.where(on, (prox if cfg.decoupled else logp.detach()) - mu, 0.0)
    log_r = _surrogate_log_ratio(logp, prox if cfg.decoupled else mu, mask, cfg.ratio_level)
    ratio = log_r.exp()

    flags: dict[str, Tensor] = {}
    if cfg.tis_cap is not None and not cfg.decoupled:
        # Truncated-IS policy gradient: value -w A, gradient -w A grad log r, w = sg(min(r, cap)).
        w = ratio.detach().clamp(max=cfg.tis_cap)
        flags["tis_capped"] = ratio.detach() > cfg.tis_cap
        pg = -adv * w * torch.exp(log_r - log_r.detach())
    else:
        pg = _ppo_clip(ratio, adv, cfg, flags)
        if cfg.decoupled:
            # Behaviour correction for the proximal policy's own staleness: a detached weight.
            w = log_rho.clamp(max=metrics.MAX_LOG_RATIO).exp()
            if cfg.tis_cap is not None:
                flags["tis_capped"] = w > cfg.tis_cap
                w = w.clamp(max=cfg.tis_cap)
            pg = pg * w

    lag = metrics.token_lag(inputs.versions, inputs.learner_version, mask)
    weight = _token_weight(log_rho, lag, on, cfg, flags).to(dtype)
    pg_tokens = torch.where(weight > 0, pg * weight, 0.0)

    def agg(per_token: Tensor) -> Tensor:
        return aggregate(per_token, mask, inputs.total_tokens, inputs.total_seqs, cfg)

    parts = {"loss/pg": agg(pg_tokens)}
    if inputs.ref_logprobs is not None:
        kl = torch.where(on, metrics.kl_estimate(logp, inputs.ref_logprobs.to(dtype), cfg.kl_estimator), 0.0)
        flags["ref_kl"] = kl
        if cfg.kl_coef > 0:
            parts["loss/kl"] = cfg.kl_coef * agg(kl)
    if inputs.entropy is not None:
        entropy = torch.where(on, inputs.entropy.to(dtype), 0.0)
        flags["entropy"] = entropy
        if cfg.entropy_coef > 0:
            parts["loss/entropy"] = -cfg.entropy_coef * agg(entropy)
    loss = torch.stack(list(parts.values())).sum()

    stats = metrics.token_partials(
        log_rho=log_rho, mask=mask, lag=lag, max_lag_bucket=cfg.max_lag_bucket, flags=flags
    )
    stats.update({f"sum/{name}": value.detach().double() for name, value in parts.items()})
    stats["sum/loss/total"] = loss.detach().double()
    return loss, stats


def nll_loss(logprobs: Tensor, mask: Tensor, total_tokens: float) -> tuple[Tensor, dict[str, Tensor]]:
    """The supervised objective (`megarl sft`): one micro-batch's share of the batch's masked token-mean
    negative log-likelihood, sum_t mask_t * -log pi(a_t) / total_tokens, and its partial statistics.

    logprobs: learner log-probs [B, S] with grad (temperature 1); mask: [B, S], 1 on the trained tokens
    (a completion and its EOS, or the assistant turns); total_tokens: the masked tokens of the WHOLE
    batch, so the shares of all micro-batches and DP ranks add up to the batch's token mean (as
    `policy_loss`'s do). The statistics merge with `merge_stats`: `loss/nll`, `mask/tokens`, `mask/seqs`.
    """
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    mask = mask.to(dtype)
    # Off-mask positions may hold anything (padding): where, not a product, so an inf there stays out.
    nll = torch.where(mask > 0, -logprobs.to(dtype) * mask, 0.0)
    loss = nll.sum() / max(total_tokens, 1.0)
    stats = {"sum/tokens": mask.sum().detach().double(), "sum/seqs": (mask.sum(dim=-1) > 0).sum().double(),
             "sum/loss/nll": loss.detach().double(), "sum/loss/total": loss.detach().double()}
    return loss, stats


def merge_stats(stats_list: list[dict[str, Tensor]]) -> dict[str, float]:
    """The step's scalar metrics from the stats of all its micro-batches (see megarl.algo.metrics).

    With data parallelism, merge locally with metrics.merge_partials, all-reduce each entry with the
    op its prefix names (sum/max/min; the key set is identical on every rank), then metrics.finalize.
    """
    return metrics.finalize(metrics.merge_partials(stats_list))


def aggregate(per_token: Tensor, mask: Tensor, total_tokens: float, total_seqs: float, cfg: LossConfig) -> Tensor:
    """Reduce per-token losses (already 0 off the mask) to this micro-batch's share of the batch loss.

    token_mean: sum / total_tokens                    (DAPO: every token weighs the same)
    seq_mean:   sum_i (sum_t l_it / n_i) / total_seqs (GRPO: every sequence weighs the same)
    constant:   sum / (norm_constant * total_seqs)    (Dr.GRPO: no length normalisation)
    n_i counts sequence i's masked tokens; a sequence lies wholly in one micro-batch, so it is local.
    Totals are clamped to >= 1 so a batch with no trained token gives loss 0, not 0/0.
    """
    if cfg.aggregation == "token_mean":
        return per_token.sum() / max(total_tokens, 1.0)
    if cfg.aggregation == "seq_mean":
        seq_tokens = mask.sum(dim=-1).clamp(min=1.0)
        return (per_token.sum(dim=-1) / seq_tokens).sum() / max(total_seqs, 1.0)
    if cfg.aggregation == "constant":
        return per_token.sum() / (cfg.norm_constant * max(total_seqs, 1.0))
    raise ValueError(f"loss.aggregation={cfg.aggregation!r}: unknown")


def _check_inputs(inputs: LossInputs, cfg: LossConfig) -> None:
    if cfg.decoupled and inputs.proximal_logprobs is None:
        raise ValueError(
            "loss.decoupled=True needs LossInputs.proximal_logprobs (the learner's log-probs at the "
            "start of the step); compute them before the first micro-batch or set loss.decoupled=False"
        )
    if cfg.kl_coef > 0 and inputs.ref_logprobs is None:
        raise ValueError("loss.kl_coef > 0 needs LossInputs.ref_logprobs (reference policy log-probs)")
    if cfg.entropy_coef > 0 and inputs.entropy is None:
        raise ValueError("loss.entropy_coef > 0 needs LossInputs.entropy (per-token learner entropy)")


def _surrogate_log_ratio(logp: Tensor, anchor: Tensor, mask: Tensor, ratio_level: str) -> Tensor:
    """log r per token (0 off the mask), clamped to +-MAX_LOG_RATIO.

    sequence (GSPO-token form): log s_i = mean_t (log pi - log anchor) over the sequence's masked
    tokens, used as sg(log s_i) + log pi_t - sg(log pi_t): the value is s_i at every token, and the
    gradient of the sequence's token sum is s_i * sum_t grad log pi_t, GSPO's sequence gradient.
    """
    on = mask > 0
    token = torch.where(on, logp - anchor, 0.0)
    if ratio_level == "sequence":
        seq = token.detach().sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
        token = torch.where(on, seq + logp - logp.detach(), 0.0)
    return token.clamp(-metrics.MAX_LOG_RATIO, metrics.MAX_LOG_RATIO)


def _ppo_clip(ratio: Tensor, adv: Tensor, cfg: LossConfig, flags: dict[str, Tensor]) -> Tensor:
    """Per-token clipped surrogate loss; records where a clip cut the gradient in `flags`."""
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high))
    # The clip only binds (zero gradient) on the side the advantage pushes the ratio towards.
    flags["clip_low"] = (ratio.detach() < 1.0 - cfg.eps_low) & (adv < 0)
    flags["clip_high"] = (ratio.detach() > 1.0 + cfg.eps_high) & (adv > 0)
    if cfg.dual_clip_c is not None:
        bound = -cfg.dual_clip_c * adv
        dual = (adv < 0) & (loss.detach() > bound)
        flags["clip_dual"] = dual
        loss = torch.where(dual, bound, loss)
    return loss


def _token_weight(log_rho: Tensor, lag: Tensor, on: Tensor, cfg: LossConfig, flags: dict[str, Tensor]) -> Tensor:
    """Per-token weight of the policy-gradient term: 0 for dropped tokens, decay^lag otherwise.

    Dropped tokens stay in the normalisers (IcePop's convention), so dropping down-weights the
    batch instead of re-inflating the tokens that remain.
    """
    keep = on.clone()
    if cfg.mask_ratio_low is not None or cfg.mask_ratio_high is not None:
        low = math.log(cfg.mask_ratio_low) if cfg.mask_ratio_low else -math.inf
        high = math.inf if cfg.mask_ratio_high is None else math.log(cfg.mask_ratio_high)
        out_of_band = on & ((log_rho < low) | (log_rho > high))
        flags["drop_ratio"] = out_of_band
        keep &= ~out_of_band
    if cfg.max_token_lag is not None:
        too_old = on & (lag > cfg.max_token_lag)
        flags["drop_lag"] = too_old
        keep &= ~too_old
    weight = keep.to(torch.float64)
    if cfg.lag_decay is not None:
        weight = weight * torch.pow(cfg.lag_decay, lag.to(torch.float64))
    return weight
