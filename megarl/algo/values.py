"""Critic math as pure functions of per-token tensors: GAE advantages, value targets (on-policy GAE returns or
off-policy V-trace targets), the clipped value loss and its partial statistics.

Every tensor is [B, S], aligned with input_ids like the policy loss's: column t holds what belongs to the
choice of token t — values[:, t] = V(s_t), the critic's estimate in the state *before* token t (computed from
the hidden state at position t-1), rewards[:, t] the reward for choosing it.

**The steps of the MDP are the masked (model) tokens only.** A multi-turn episode's environment tokens (tool
output, user turns) are observations, not actions: they get no value loss and no advantage, and the
recursions skip them — the step after the last model token of a turn is the first model token of the next
turn (its value V(s) already sees the environment's tokens in between), discounted by ONE gamma, as if the
environment span were part of the transition. After a sequence's last model token the episode ends: V = 0.

    GAE (Schulman et al. 2016), over the model tokens t < t' < ... of one row:
        delta_t = r_t + gamma V(s_t') - V(s_t)                     (V(s_t') = 0 after the last one)
        A_t     = delta_t + gamma lam A_t'
        G_t     = A_t + V(s_t)                                     the on-policy value target ("gae")

    V-trace (Espeholt et al. 2018), with the learner's pi and the token's own behaviour log-prob mu:
        rho_t = min(rho_bar, pi_t / mu_t)     c_t = lam min(c_bar, pi_t / mu_t)
        v_t - V(s_t) = rho_t delta_t + gamma c_t (v_t' - V(s_t'))   the off-policy value target ("vtrace")

The importance weights are per token, against that token's own mu, so a rollout whose tokens came from
several policy versions needs no special case at a version boundary.  With pi = mu (on-policy) and
c_bar, rho_bar >= 1, v_t equals the GAE return G_t.

Terminal rewards only and gamma = lam = 1 (every megarl task today): G_t = R for every token, and
A_t = R - V(s_t): REINFORCE with a learned per-token baseline (docs/algorithms.md).
"""
from __future__ import annotations

import torch
from torch import Tensor

from megarl.algo import metrics


def terminal_rewards(sample_rewards: Tensor, mask: Tensor) -> Tensor:
    """[B, S] per-token rewards: each row's sample reward on its last model token, 0 elsewhere (a row with no
    model token gets none)."""
    on = mask > 0
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(on, positions, -1).max(dim=1).values
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = torch.nonzero(last >= 0).squeeze(1)
    rewards[rows, last[rows]] = sample_rewards.to(rewards.dtype).to(mask.device)[rows]
    return rewards


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """(advantages, returns) [B, S] by GAE over each row's model tokens (mask > 0); 0 off the mask."""
    return _backward(rewards, values, mask, gamma, lam, ratios=None, c_bar=1.0, rho_bar=1.0)


def vtrace_targets(rewards: Tensor, values: Tensor, mask: Tensor, log_ratio: Tensor, gamma: float, lam: float,
                   c_bar: float, rho_bar: float) -> Tensor:
    """V-trace value targets v_t [B, S] (0 off the mask); log_ratio = log pi - log mu per token (detached)."""
    return _backward(rewards, values, mask, gamma, lam, ratios=log_ratio, c_bar=c_bar, rho_bar=rho_bar)[1]


def _backward(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float, ratios: Tensor | None,
              c_bar: float, rho_bar: float) -> tuple[Tensor, Tensor]:
    """The one backward recursion behind both estimators: (A, target) with
    A_t = rho_t delta_t + gamma c_t A_t' and target = A + V; GAE is rho = 1, c = lam."""
    dtype = torch.promote_types(values.dtype, torch.float32)
    rewards, values = rewards.detach().to(dtype), values.detach().to(dtype)
    on = mask > 0
    if ratios is None:
        rho = torch.ones_like(values)
        c = torch.full_like(values, lam)
    else:
        ratio = ratios.detach().to(dtype).clamp(max=metrics.MAX_LOG_RATIO).exp()
        rho, c = ratio.clamp(max=rho_bar), lam * ratio.clamp(max=c_bar)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])  # V(s_t') of the next model token; 0 past the last
    next_adv = torch.zeros_like(values[:, 0])
    for t in range(values.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = rho[:, t] * delta + gamma * c[:, t] * next_adv
        # Off-mask positions (prompt, environment tokens, padding) are not steps: carry t' past them.
        here = on[:, t]
        advantages[:, t] = torch.where(here, adv, 0.0)
        next_value = torch.where(here, values[:, t], next_value)
        next_adv = torch.where(here, adv, next_adv)
    return advantages, torch.where(on, advantages + values, 0.0)


def value_loss(values: Tensor, old_values: Tensor, targets: Tensor, mask: Tensor, clip: float | None,
               total_tokens: float) -> Tensor:
    """One micro-batch's share of the batch's token-mean value loss 1/2 (V - target)^2, with PPO's value clip
    (the larger of the plain and the clipped error, V clipped to old_V +- clip; None = off)."""
    dtype = torch.promote_types(values.dtype, torch.float32)
    values, old_values, targets = values.to(dtype), old_values.detach().to(dtype), targets.detach().to(dtype)
    error = (values - targets).square()
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        error = torch.maximum(error, (clipped - targets).square())
    return 0.5 * torch.where(mask > 0, error, 0.0).sum() / max(total_tokens, 1.0)


def value_partials(values: Tensor, targets: Tensor, mask: Tensor, lag: Tensor, max_lag_bucket: int) -> dict[str, Tensor]:
    """Partial statistics (merged like megarl.algo.metrics.token_partials') of the critic on one micro-batch:
    sums of V, target, V^2, target^2, (target - V)^2, overall and by token lag, for `value_metrics`."""
    on = mask > 0
    v, g = values.detach().double()[on], targets.detach().double()[on]
    quantities = {"tokens": torch.ones_like(v), "v": v, "v_sq": v.square(), "ret": g, "ret_sq": g.square(),
                  "err_sq": (g - v).square()}
    one_hot = torch.nn.functional.one_hot(lag[on].clamp(max=max_lag_bucket), max_lag_bucket + 1).double()
    per_lag = torch.stack(list(quantities.values())) @ one_hot
    partials = {f"sum/critic/{q}": x.sum() for q, x in quantities.items()}
    for k, name in enumerate(metrics.lag_bucket_names(max_lag_bucket)):
        for i, q in enumerate(quantities):
            partials[f"sum/critic/{name}/{q}"] = per_lag[i, k]
    return partials


def value_metrics(partials: dict[str, float]) -> dict[str, float]:
    """critic/value_mean, critic/return_mean, critic/return_std, critic/explained_var = 1 - Var(G - V) / Var(G),
    overall and per lag bucket (lagK/critic_...), from merged-and-summed partials; scopes with no token are
    left out."""
    out = {}
    scopes = [""] + sorted({k.split("/")[2] for k in partials if k.startswith("sum/critic/lag")})
    for scope in scopes:
        key = f"sum/critic/{scope + '/' if scope else ''}"
        n = partials.get(key + "tokens", 0.0)
        if n <= 0:
            continue
        ret_mean, v_mean = partials[key + "ret"] / n, partials[key + "v"] / n
        ret_var = max(partials[key + "ret_sq"] / n - ret_mean ** 2, 0.0)
        # Var(G - V) = E[(G - V)^2] - (E[G] - E[V])^2
        err_var = max(partials[key + "err_sq"] / n - (ret_mean - v_mean) ** 2, 0.0)
        prefix = f"{scope}/critic_" if scope else "critic/"
        out[prefix + "value_mean"] = v_mean
        out[prefix + "return_mean"] = ret_mean
        out[prefix + "return_std"] = ret_var ** 0.5
        out[prefix + "value_std"] = max(partials[key + "v_sq"] / n - v_mean ** 2, 0.0) ** 0.5
        out[prefix + "mse"] = partials[key + "err_sq"] / n
        if ret_var > 0:
            out[prefix + "explained_var"] = 1.0 - err_var / ret_var
    return out
