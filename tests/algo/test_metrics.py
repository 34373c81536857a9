"""Off-policy health metrics against python loops over tokens (float64)."""
from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from megarl.algo import metrics
from megarl.algo.config import LossConfig
from megarl.algo.losses import merge_stats, policy_loss
from tests.algo import LEARNER_VERSION, Batch, make_batch
from tests.algo.test_losses import loss_inputs


def reference_metrics(b: Batch, cfg: LossConfig) -> dict[str, float]:
    logp, mu, prox, ref = (t.detach().double().tolist() for t in (b.logp, b.behaviour, b.proximal, b.ref))
    adv, mask, ver, ent = b.advantages.tolist(), b.mask.tolist(), b.versions.tolist(), b.entropy.tolist()
    rows = []  # one dict per trained token
    for i in range(len(mask)):
        for t in range(len(mask[i])):
            if mask[i][t] <= 0:
                continue
            gap = (prox[i][t] if cfg.decoupled else logp[i][t]) - mu[i][t]
            rho = math.exp(gap)
            r = math.exp(logp[i][t] - (prox[i][t] if cfg.decoupled else mu[i][t]))
            lag = LEARNER_VERSION - ver[i][t]
            band = (cfg.mask_ratio_low is not None and rho < cfg.mask_ratio_low) or (
                cfg.mask_ratio_high is not None and rho > cfg.mask_ratio_high
            )
            old = cfg.max_token_lag is not None and lag > cfg.max_token_lag
            low = r < 1 - cfg.eps_low and adv[i][t] < 0
            high = r > 1 + cfg.eps_high and adv[i][t] > 0
            x = logp[i][t] - ref[i][t]
            rows.append(
                dict(
                    rho=rho, gap=abs(gap), k3=rho - 1 - gap, low=low, high=high, clip=low or high,
                    band=band, old=old, dropped=band or old, entropy=ent[i][t], ref_kl=math.exp(-x) + x - 1,
                    bucket=f"lag{lag}" if lag < cfg.max_lag_bucket else f"lag{cfg.max_lag_bucket}+",
                    capped=cfg.tis_cap is not None and rho > cfg.tis_cap,
                )
            )
    n = len(rows)

    def mean(key, subset=rows):
        return sum(float(row[key]) for row in subset) / len(subset)

    rhos = [row["rho"] for row in rows]
    out = {
        "mask/tokens": float(n),
        "mask/seqs": float(sum(any(m > 0 for m in row) for row in mask)),
        "ratio/mean": mean("rho"),
        "ratio/max": max(rhos),
        "ratio/min": min(rhos),
        "ratio/std": math.sqrt(sum((x - mean("rho")) ** 2 for x in rhos) / n),
        "ess": sum(rhos) ** 2 / (n * sum(x * x for x in rhos)),
        "logprob_gap/abs_mean": mean("gap"),
        "logprob_gap/k3": mean("k3"),
        "clip/frac_low": mean("low"),
        "clip/frac_high": mean("high"),
        "clip/frac": mean("clip"),
        "mask/dropped_frac": mean("dropped"),
        "entropy/mean": mean("entropy"),
        "kl_ref/mean": mean("ref_kl"),
    }
    if cfg.mask_ratio_low is not None or cfg.mask_ratio_high is not None:
        out["mask/ratio_band_frac"] = mean("band")
    if cfg.max_token_lag is not None:
        out["mask/lag_frac"] = mean("old")
    if cfg.tis_cap is not None:
        out["tis/frac_capped"] = mean("capped")
    by_lag = defaultdict(list)
    for row in rows:
        by_lag[row["bucket"]].append(row)
    for lag, subset in by_lag.items():
        out[f"{lag}/token_share"] = len(subset) / n
        out[f"{lag}/ratio_mean"] = mean("rho", subset)
        out[f"{lag}/logprob_gap_abs"] = mean("gap", subset)
        out[f"{lag}/k3"] = mean("k3", subset)
        out[f"{lag}/clip_frac"] = mean("clip", subset)
        out[f"{lag}/dropped_frac"] = mean("dropped", subset)
    return out


CONFIGS = {
    "ppo_masks": LossConfig(mask_ratio_low=0.5, mask_ratio_high=2.0, max_token_lag=5),
    "decoupled_tis": LossConfig(decoupled=True, tis_cap=1.5),
    "few_buckets": LossConfig(max_lag_bucket=3, mask_ratio_high=1.2),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_metrics_match_reference(name):
    cfg = CONFIGS[name]
    b = make_batch(seed=13)
    _, stats = policy_loss(b.logp, loss_inputs(b), cfg)
    got = {k: v for k, v in merge_stats([stats]).items() if not k.startswith("loss/")}
    expected = reference_metrics(b, cfg)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert any(k.endswith("+/token_share") for k in got), "the batch should reach the last lag bucket"


def test_ess_bounds():
    mask = torch.ones(1, 8, dtype=torch.float64)
    lag = torch.zeros(1, 8, dtype=torch.long)

    def ess(log_rho):
        return metrics.finalize(metrics.token_partials(log_rho=log_rho, mask=mask, lag=lag, max_lag_bucket=2, flags={}))["ess"]

    assert ess(torch.full((1, 8), 0.7, dtype=torch.float64)) == pytest.approx(1.0)
    one_hot = torch.full((1, 8), -30.0, dtype=torch.float64)
    one_hot[0, 3] = 0.0
    assert ess(one_hot) == pytest.approx(1 / 8, rel=1e-6)


def test_merge_partials_combines_by_prefix():
    a = {"sum/x": torch.tensor(1.0), "max/y": torch.tensor(2.0), "min/z": torch.tensor(-1.0)}
    b = {"sum/x": torch.tensor(4.0), "max/y": torch.tensor(-3.0), "min/z": torch.tensor(5.0)}
    merged = metrics.merge_partials([a, b])
    assert {k: v.item() for k, v in merged.items()} == {"sum/x": 5.0, "max/y": 2.0, "min/z": -1.0}


def test_finalize_of_nothing_reports_counts_only():
    mask = torch.zeros(2, 5)
    partials = metrics.token_partials(
        log_rho=torch.zeros(2, 5), mask=mask, lag=torch.zeros(2, 5, dtype=torch.long), max_lag_bucket=4, flags={}
    )
    assert metrics.finalize(partials) == {"mask/tokens": 0.0, "mask/seqs": 0.0}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_are_unbiased_or_known_bias(estimator):
    """Monte-Carlo over samples of p: k1 and k3 estimate KL(p||q) without bias; k2 is close for near p, q."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    q = torch.softmax(torch.log(p) + 0.1 * torch.randn(6, generator=g, dtype=torch.float64), 0)
    exact = (p * (p.log() - q.log())).sum().item()
    # The expectation over p computed exactly: sum_a p(a) k(a).
    expectation = (p * metrics.kl_estimate(p.log(), q.log(), estimator)).sum().item()
    assert expectation == pytest.approx(exact, rel=1e-9 if estimator != "k2" else 0.1)
    if estimator == "k3":
        assert (metrics.kl_estimate(p.log(), q.log(), "k3") >= 0).all()


def test_token_lag_clamps_and_masks():
    versions = torch.tensor([[-1, 3, 5, 7]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    assert metrics.token_lag(versions, 6, mask).tolist() == [[0, 3, 1, 0]]


def test_router_agreement_counts_sets_per_layer_at_the_position_before_each_trained_token():
    from megarl.algo.metrics import finalize, merge_partials, route_matches, router_partials

    sampler = torch.tensor([[[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[1, 2], [0, 3]], [[0, 1], [0, 1]]]])  # [1, 4, 2, 2]
    learner = sampler.clone()
    learner[0, 0, 0] = torch.tensor([1, 0])  # same set, other order: agrees
    learner[0, 1, 1] = torch.tensor([2, 1])  # one of the two experts differs in layer 1
    learner[0, 2] = torch.tensor([[3, 0], [1, 2]])  # nothing agrees
    matches = route_matches(sampler, learner)
    assert matches.tolist() == [[4, 3, 0, 4]]
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])  # tokens 1..3 trained: their routes are positions 0..2
    versions = torch.tensor([[-1, 5, 4, 4]])  # learner version 5: token 1 at lag 0, tokens 2, 3 at lag 1
    m = finalize(merge_partials([router_partials(matches, 4, mask, versions, 5, max_lag_bucket=2)]))
    assert m["router/agreement"] == pytest.approx((4 + 3 + 0) / 12)
    assert m["router/token_diff_frac"] == pytest.approx(2 / 3)
    assert m["lag0/router_agreement"] == 1.0 and m["lag0/router_token_diff_frac"] == 0.0
    assert m["lag1/router_agreement"] == pytest.approx(3 / 8) and m["lag1/router_token_diff_frac"] == 1.0
    assert "lag2+/router_agreement" not in m
    assert m["router/tokens"] == 3 and m["lag0/router_tokens"] == 1 and m["lag1/router_tokens"] == 2
