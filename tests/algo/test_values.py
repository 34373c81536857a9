"""GAE and V-trace value targets (megarl.algo.values) against an independent float64 plain-Python reference.

The reference walks each row's model tokens (mask > 0) as a list, from the last to the first, with Python
floats and the textbook formulas written out per step; nothing is shared with the vectorised code.
"""
import math
import random

import pytest
import torch

from megarl.algo import values as V


def _steps(mask_row):
    return [t for t, m in enumerate(mask_row) if m > 0]


def ref_gae(rewards, vals, mask, gamma, lam):
    adv = [[0.0] * len(r) for r in rewards]
    ret = [[0.0] * len(r) for r in rewards]
    for b in range(len(rewards)):
        steps = _steps(mask[b])
        for i in reversed(range(len(steps))):
            t = steps[i]
            v_next = vals[b][steps[i + 1]] if i + 1 < len(steps) else 0.0
            a_next = adv[b][steps[i + 1]] if i + 1 < len(steps) else 0.0
            delta = rewards[b][t] + gamma * v_next - vals[b][t]
            adv[b][t] = delta + gamma * lam * a_next
            ret[b][t] = adv[b][t] + vals[b][t]
    return adv, ret


def ref_vtrace(rewards, vals, mask, logp, mu, gamma, lam, c_bar, rho_bar):
    """Espeholt et al. (2018) eq. 1, summed explicitly: v_s = V(s) + sum_{t>=s} gamma^{t-s} (prod_{s<=i<t} c_i)
    rho_t delta_t (not the recursion the code uses)."""
    out = [[0.0] * len(r) for r in rewards]
    for b in range(len(rewards)):
        steps = _steps(mask[b])
        ratio = {t: math.exp(logp[b][t] - mu[b][t]) for t in steps}
        for i, s in enumerate(steps):
            total, trace = 0.0, 1.0
            for j in range(i, len(steps)):
                t = steps[j]
                v_next = vals[b][steps[j + 1]] if j + 1 < len(steps) else 0.0
                delta = min(rho_bar, ratio[t]) * (rewards[b][t] + gamma * v_next - vals[b][t])
                total += gamma ** (j - i) * trace * delta
                trace *= lam * min(c_bar, ratio[t])
            out[b][s] = vals[b][s] + total
    return out


def _case(seed, rows=4, width=12, env_span=True):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, width)
    for b in range(rows):
        start = 2 + b % 2
        end = width - b  # rows of different lengths, right padding
        mask[b, start:end] = 1.0
        if env_span and b % 2 == 0:
            mask[b, start + 3:start + 5] = 0.0  # an environment span inside the completion
    rewards = torch.randn(rows, width, generator=g, dtype=torch.float64) * mask
    vals = torch.randn(rows, width, generator=g, dtype=torch.float64)
    logp = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    mu = logp + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.7
    return rewards, vals, mask, logp, mu


def _close(actual, expected, mask):
    expected = torch.tensor(expected, dtype=torch.float64) * (mask > 0)
    torch.testing.assert_close(actual.double(), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.97, 0.9), (0.8, 0.0), (1.0, 0.5)])
def test_gae_matches_reference_with_environment_spans(gamma, lam):
    rewards, vals, mask, _, _ = _case(0)
    adv, ret = V.gae(rewards, vals, mask, gamma, lam)
    ref_adv, ref_ret = ref_gae(rewards.tolist(), vals.tolist(), mask.tolist(), gamma, lam)
    _close(adv, ref_adv, mask)
    _close(ret, ref_ret, mask)


def test_environment_tokens_are_skipped_not_steps():
    """Across an environment span the next state is the next MODEL token's: one gamma, its value; the
    environment positions' values and rewards play no part."""
    rewards, vals, mask, _, _ = _case(1)
    adv, ret = V.gae(rewards, vals, mask, 0.9, 0.8)
    env = (mask == 0)
    vals2 = torch.where(env, torch.full_like(vals, 1e6), vals)
    adv2, ret2 = V.gae(rewards + env * 1e3, vals2, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, adv2)
    torch.testing.assert_close(ret, ret2)
    assert float(adv[env].abs().sum()) == 0.0 and float(ret[env].abs().sum()) == 0.0


@pytest.mark.parametrize("c_bar,rho_bar,lam", [(1.0, 1.0, 1.0), (0.9, 1.5, 0.95), (2.0, 0.8, 1.0), (math.inf, math.inf, 0.7)])
def test_vtrace_matches_reference_mixed_versions(c_bar, rho_bar, lam):
    """Each row's tokens come from several behaviour versions (mu differs token by token, as when weights
    land mid-rollout): the weights are per token, so no boundary handling is needed."""
    rewards, vals, mask, logp, mu = _case(2)
    # Version boundaries: a jump in the behaviour policy mid-row (later tokens from a much newer policy).
    mu[:, 7:] = logp[:, 7:] + 0.05
    gamma = 0.95
    got = V.vtrace_targets(rewards, vals, mask, logp - mu, gamma, lam, c_bar, rho_bar)
    ref = ref_vtrace(rewards.tolist(), vals.tolist(), mask.tolist(), logp.tolist(), mu.tolist(), gamma, lam,
                     c_bar, rho_bar)
    _close(got, ref, mask)


def test_vtrace_on_policy_equals_gae_return():
    rewards, vals, mask, logp, _ = _case(3)
    got = V.vtrace_targets(rewards, vals, mask, torch.zeros_like(logp), 0.9, 0.85, c_bar=1.0, rho_bar=1.0)
    _, ret = V.gae(rewards, vals, mask, 0.9, 0.85)
    torch.testing.assert_close(got, ret)


def test_terminal_reward_gamma_lambda_one_reduces_to_reward_minus_value():
    """Only the last model token rewarded, gamma = lam = 1: every token's return is the sample reward R and
    its advantage R - V(s_t) (REINFORCE with a learned per-token baseline)."""
    _, vals, mask, _, _ = _case(4)
    sample_rewards = torch.tensor([1.0, 0.0, -0.5, 2.0], dtype=torch.float64)
    rewards = V.terminal_rewards(sample_rewards, mask)
    adv, ret = V.gae(rewards, vals.float(), mask, 1.0, 1.0)
    on = mask > 0
    expected_ret = sample_rewards[:, None].expand_as(mask).float()
    torch.testing.assert_close(ret[on], expected_ret[on])
    torch.testing.assert_close(adv[on], (expected_ret - vals.float())[on])


def test_terminal_rewards_land_on_last_model_token():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    r = V.terminal_rewards(torch.tensor([2.0, 3.0, -1.0]), mask)
    assert r.tolist() == [[0, 0, 0, 0, 2.0, 0], [0] * 6, [0, -1.0, 0, 0, 0, 0]]


def test_value_loss_clip_and_normaliser():
    vals = torch.tensor([[0.0, 1.0, 3.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0]])
    target = torch.tensor([[0.0, 2.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    plain = V.value_loss(vals, old, target, mask, None, total_tokens=4.0)
    assert float(plain) == pytest.approx(0.5 * (1.0 + 9.0) / 4.0)
    # clip 0.5: token 1 clipped V 0.5 -> error 2.25 > 1; token 2 clipped 0.5 -> 0.25 < 9 (max keeps 9)
    clipped = V.value_loss(vals, old, target, mask, 0.5, total_tokens=4.0)
    assert float(clipped) == pytest.approx(0.5 * (2.25 + 9.0) / 4.0)
    clipped.backward()
    assert vals.grad.tolist() == [[0.0, 0.0, 3.0 / 4.0]]  # the clipped token has no gradient


def test_value_metrics_explained_variance_by_lag():
    rng = random.Random(0)
    g = torch.tensor([[rng.gauss(0, 1) for _ in range(8)] for _ in range(3)], dtype=torch.float64)
    v = g + 0.1 * torch.randn(3, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mask = torch.ones(3, 8)
    lag = torch.tensor([[0] * 8, [1] * 8, [5] * 8])
    from megarl.algo.metrics import merge_partials
    p = merge_partials([V.value_partials(v[:2], g[:2], mask[:2], lag[:2], 2),
                        V.value_partials(v[2:], g[2:], mask[2:], lag[2:], 2)])
    m = V.value_metrics({k: float(x) for k, x in p.items()})
    err, ret = (g - v).flatten(), g.flatten()
    assert m["critic/explained_var"] == pytest.approx(1 - err.var(unbiased=False) / ret.var(unbiased=False))
    assert m["lag0/critic_explained_var"] == pytest.approx(
        1 - (g[0] - v[0]).var(unbiased=False) / g[0].var(unbiased=False))
    assert m["lag2+/critic_return_mean"] == pytest.approx(float(g[2].mean()))
    assert "lag1/critic_mse" in m
