"""Off-policy health metrics: is the behaviour-vs-learner correction healthy, overall and by token lag?

The learner computes the loss per micro-batch and on several DP ranks, so metrics are produced in
two stages:

1. `token_partials(...)` turns one micro-batch's per-token quantities into *partial* statistics:
   detached float64 scalars whose key starts with how they combine, `sum/`, `max/` or `min/`.
   The key set depends only on the config, never on the data (an empty micro-batch emits the same
   keys), so partials from different micro-batches and ranks line up and can be all-reduced.
2. `merge_partials` combines a list of partials (sum/max/min by prefix); `finalize` turns the
   combined partials into the step's scalar metrics (`ratio/mean`, `ess`, `lag3/clip_frac`, ...).

The behaviour ratio rho = pi / mu is taken per token against that token's own behaviour log-prob.
Metrics that average over tokens are omitted from `finalize` when no token contributed, rather than
reported as 0 or NaN.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor

# exp(40) ~ 2e17: far beyond any ratio a sound run produces, yet finite in fp32 even when squared in
# fp64, so a corrupted log-prob gives a huge but finite loss/metric rather than inf -> NaN gradients.
MAX_LOG_RATIO = 40.0

# Per-token flags/values the loss may pass to `token_partials`, and the metric reporting their
# token mean.  Flags that are not configured are simply not passed (and not reported).
TOKEN_MEANS = {
    "ratio": "ratio/mean",
    "gap_abs": "logprob_gap/abs_mean",
    "k3": "logprob_gap/k3",
    "clip_low": "clip/frac_low",
    "clip_high": "clip/frac_high",
    "clip": "clip/frac",
    "clip_dual": "clip/frac_dual",
    "tis_capped": "tis/frac_capped",
    "drop_ratio": "mask/ratio_band_frac",
    "drop_lag": "mask/lag_frac",
    "dropped": "mask/dropped_frac",
    "entropy": "entropy/mean",
    "ref_kl": "kl_ref/mean",
}
# The subset broken down by lag bucket, with its per-lag metric name.
LAG_MEANS = {
    "ratio": "ratio_mean",
    "gap_abs": "logprob_gap_abs",
    "k3": "k3",
    "clip": "clip_frac",
    "dropped": "dropped_frac",
}


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(p || ref) from tokens sampled from p (Schulman's k1/k2/k3).

    k1 = log p - log ref (unbiased, high variance, can be negative); k2 = (log p - log ref)^2 / 2
    (biased, low variance); k3 = ref/p - 1 - log(ref/p) (unbiased, always >= 0; GRPO's choice).
    """
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kl_estimator={estimator!r}: must be one of k1, k2, k3")


def token_lag(versions: Tensor, learner_version: int, mask: Tensor) -> Tensor:
    """Lag of each trained token (learner_version - its version), 0 off the mask.

    A negative lag (a token newer than the learner) cannot happen in a sound run; clamping it to 0
    keeps lag_decay ** lag a down-weight and the lag buckets well defined.
    """
    lag = (learner_version - versions.long()).clamp(min=0)
    return torch.where(mask > 0, lag, torch.zeros_like(lag))


def lag_bucket_names(max_lag_bucket: int) -> list[str]:
    """Names of the lag buckets: lag0 .. lag{max-1}, then lag{max}+ for everything older."""
    return [f"lag{k}" for k in range(max_lag_bucket)] + [f"lag{max_lag_bucket}+"]


def token_partials(
    *,
    log_rho: Tensor,
    mask: Tensor,
    lag: Tensor,
    max_lag_bucket: int,
    flags: dict[str, Tensor],
) -> dict[str, Tensor]:
    """Partial statistics of one micro-batch (see module docstring).

    log_rho: detached behaviour log-ratio log pi - log mu per token; mask: float [B, S];
    lag: long [B, S] from `token_lag`; flags: per-token bool/float tensors named as in TOKEN_MEANS.
    "clip" and "dropped" are derived here from clip_low/clip_high and drop_ratio/drop_lag.
    """
    on = mask > 0
    log_rho = log_rho.detach().double()[on]
    ratio = log_rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    values = {
        "ratio": ratio,
        "gap_abs": log_rho.abs(),
        # KL(mu || pi) from tokens sampled from mu: rho - 1 - log rho, the k3 estimator.
        "k3": torch.expm1(log_rho.clamp(max=MAX_LOG_RATIO)) - log_rho,
    }
    values.update({name: t.detach().double()[on] for name, t in flags.items()})
    values["clip"] = _any_of(values, ("clip_low", "clip_high"), like=ratio)
    values["dropped"] = _any_of(values, ("drop_ratio", "drop_lag"), like=ratio)

    f64 = dict(dtype=torch.float64, device=mask.device)
    partials = {
        "sum/tokens": torch.tensor(float(ratio.numel()), **f64),
        "sum/seqs": on.any(dim=-1).sum().to(torch.float64),
        "sum/ratio_sq": ratio.square().sum(),
        "max/ratio": ratio.max() if ratio.numel() else torch.tensor(-math.inf, **f64),
        "min/ratio": ratio.min() if ratio.numel() else torch.tensor(math.inf, **f64),
    }
    partials.update({f"sum/{name}": v.sum() for name, v in values.items() if name in TOKEN_MEANS})

    # By-lag sums as one [Q, N] @ [N, K] product against the one-hot lag bucket: a single kernel,
    # and deterministic on GPU (unlike bincount / index_add with weights).
    one_hot = torch.nn.functional.one_hot(lag[on].clamp(max=max_lag_bucket), max_lag_bucket + 1)
    quantities = ["tokens", *LAG_MEANS]
    per_lag = torch.stack([torch.ones_like(ratio), *(values[q] for q in LAG_MEANS)]) @ one_hot.double()
    for k, name in enumerate(lag_bucket_names(max_lag_bucket)):
        for i, q in enumerate(quantities):
            partials[f"sum/{name}/{q}"] = per_lag[i, k]
    return partials


def route_matches(sampler_routes: Tensor, learner_routes: Tensor) -> Tensor:
    """[B, S] per position: how many of the sampler's routing decisions ([B, S, L, k] expert indices, one
    set of k per MoE layer) the learner's router made too (the same expert in the same layer's top-k;
    the order within a top-k does not change the layer's output). Summed over the given layers, so a
    pipeline stage counts its own and the stages' counts add up."""
    same = (sampler_routes.long().unsqueeze(-1) == learner_routes.long().unsqueeze(-2)).any(dim=-1)
    return same.sum(dim=(-1, -2))


def router_partials(matches: Tensor, decisions: int, mask: Tensor, versions: Tensor, learner_version: int,
                    max_lag_bucket: int) -> dict[str, Tensor]:
    """Partial statistics of router agreement for one micro-batch (merged like token_partials').

    matches: [B, S] from route_matches over every MoE layer; decisions: routing decisions per position
    (MoE layers * top_k). A trained token t is predicted from position t-1, computed in the same engine
    forward that sampled t: its routes are position t-1's, its lag that of token t."""
    on = mask[:, 1:] > 0
    matched = matches[:, :-1][on].double()
    lag = token_lag(versions, learner_version, mask)[:, 1:][on]
    values = torch.stack([torch.ones_like(matched), matched / decisions, (matched < decisions).double()])
    one_hot = torch.nn.functional.one_hot(lag.clamp(max=max_lag_bucket), max_lag_bucket + 1).double()
    per_lag = values @ one_hot
    partials = {"sum/router/tokens": values[0].sum(), "sum/router/agree": values[1].sum(),
                "sum/router/differ": values[2].sum()}
    for k, name in enumerate(lag_bucket_names(max_lag_bucket)):
        for i, q in enumerate(("tokens", "agree", "differ")):
            partials[f"sum/router/{name}/{q}"] = per_lag[i, k]
    return partials


def teacher_partials(learner_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, versions: Tensor,
                     learner_version: int, max_lag_bucket: int) -> dict[str, Tensor]:
    """Partial statistics of the student's divergence from a distillation teacher on one micro-batch (merged like
    token_partials'): per trained token the sampled-token reverse-KL estimate k1 = log pi - log pi_T (what the
    distillation advantage negates) and k3 = pi_T/pi - 1 - log(pi_T/pi) (>= 0), overall and by lag."""
    on = mask > 0
    log_ratio = (learner_logprobs.detach().double() - teacher_logprobs.double())[on]
    k3 = torch.expm1((-log_ratio).clamp(max=MAX_LOG_RATIO)) + log_ratio
    lag = token_lag(versions, learner_version, mask)[on]
    values = torch.stack([torch.ones_like(log_ratio), log_ratio, k3])
    per_lag = values @ torch.nn.functional.one_hot(lag.clamp(max=max_lag_bucket), max_lag_bucket + 1).double()
    partials = {"sum/teacher/tokens": values[0].sum(), "sum/teacher/kl": values[1].sum(),
                "sum/teacher/k3": values[2].sum()}
    for k, name in enumerate(lag_bucket_names(max_lag_bucket)):
        for i, q in enumerate(("tokens", "kl", "k3")):
            partials[f"sum/teacher/{name}/{q}"] = per_lag[i, k]
    return partials


def _teacher_metrics(p: dict[str, float]) -> dict[str, float]:
    """distill/teacher_kl (k1) and distill/teacher_kl_k3, token means overall, and lag{k}/teacher_kl by lag."""
    out = {}
    n = p.get("sum/teacher/tokens", 0.0)
    if n > 0:
        out["distill/teacher_kl"] = p["sum/teacher/kl"] / n
        out["distill/teacher_kl_k3"] = p["sum/teacher/k3"] / n
    for key, n in p.items():
        if key.startswith("sum/teacher/lag") and key.endswith("/tokens") and n > 0:
            lag = key[len("sum/teacher/"):-len("/tokens")]
            out[f"{lag}/teacher_kl"] = p[f"sum/teacher/{lag}/kl"] / n
    return out


def _router_metrics(p: dict[str, float]) -> dict[str, float]:
    """router/agreement (share of routing decisions the learner's router made as the sampler's did),
    router/token_diff_frac (share of trained tokens with any MoE layer routed differently) and router/tokens (the
    trained tokens they rest on), overall and by lag (lag{k}/router_...); with routing replay on, what the learner's
    router would have chosen, had it not replayed."""
    out = {}
    for scope in ["", *sorted({k.split("/")[2] for k in p if k.startswith("sum/router/lag")})]:
        key = f"sum/router/{scope + '/' if scope else ''}"
        n = p.get(key + "tokens", 0.0)
        if n > 0:
            prefix = f"{scope}/" if scope else ""
            out[f"{prefix}router_agreement" if scope else "router/agreement"] = p[key + "agree"] / n
            out[f"{prefix}router_token_diff_frac" if scope else "router/token_diff_frac"] = p[key + "differ"] / n
            out[f"{prefix}router_tokens" if scope else "router/tokens"] = n
    return out


def _any_of(values: dict[str, Tensor], names: tuple[str, ...], like: Tensor) -> Tensor:
    present = [values[n] for n in names if n in values]
    if not present:
        return torch.zeros_like(like)
    return torch.stack(present).amax(dim=0)


_COMBINE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def merge_partials(partials_list: Iterable[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Combine partials of several micro-batches (or ranks): add `sum/`, max `max/`, min `min/`."""
    merged: dict[str, Tensor] = {}
    for partials in partials_list:
        for key, value in partials.items():
            value = value.detach().double()
            merged[key] = _COMBINE[key.split("/", 1)[0]](merged[key], value) if key in merged else value
    return merged


def finalize(partials: dict[str, Tensor]) -> dict[str, float]:
    """Scalar metrics of a step from its merged partials."""
    # One device->host copy for all partials, not one sync per key.
    values = torch.stack([v.detach().double().reshape(()) for v in partials.values()]).tolist() if partials else []
    p = dict(zip(partials.keys(), values))
    tokens = p.get("sum/tokens", 0.0)
    out = {"mask/tokens": tokens, "mask/seqs": p.get("sum/seqs", 0.0)}
    out.update(_router_metrics(p))
    out.update(_teacher_metrics(p))
    out.update({key[len("sum/"):]: value for key, value in p.items() if key.startswith("sum/loss/")})
    if tokens <= 0 or "max/ratio" not in p:  # (the supervised loss has no ratios: megarl.algo.losses.nll_loss)
        return out
    for name, metric in TOKEN_MEANS.items():
        if f"sum/{name}" in p:
            out[metric] = p[f"sum/{name}"] / tokens
    out["ratio/max"] = p["max/ratio"]
    out["ratio/min"] = p["min/ratio"]
    out["ratio/std"] = math.sqrt(max(p["sum/ratio_sq"] / tokens - out["ratio/mean"] ** 2, 0.0))
    # Kish effective sample size of the importance weights, as a fraction of the tokens: 1 when
    # every weight is equal (on-policy), -> 1/N when one token carries all the weight.
    out["ess"] = p["sum/ratio"] ** 2 / (tokens * p["sum/ratio_sq"]) if p["sum/ratio_sq"] > 0 else 0.0
    for key, n in p.items():
        if key.startswith("sum/lag") and key.endswith("/tokens") and n > 0:
            lag = key[len("sum/"):-len("/tokens")]
            out[f"{lag}/token_share"] = n / tokens
            for q, metric in LAG_MEANS.items():
                out[f"{lag}/{metric}"] = p[f"sum/{lag}/{q}"] / n
    return out
