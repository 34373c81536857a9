"""policy_loss against an independent reference: python loops over tokens in float64, closed-form
per-token branches (no clamp/maximum), analytic gradients."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from megarl.algo.config import LossConfig, validate_loss_config
from megarl.algo.losses import LossInputs, merge_stats, policy_loss
from tests.algo import LEARNER_VERSION, Batch, make_batch


def loss_inputs(b: Batch, rows=slice(None), totals: Batch | None = None) -> LossInputs:
    totals = totals or b
    return LossInputs(
        behaviour_logprobs=b.behaviour[rows],
        advantages=b.advantages[rows],
        mask=b.mask[rows],
        versions=b.versions[rows],
        learner_version=LEARNER_VERSION,
        total_tokens=totals.total_tokens,
        total_seqs=totals.total_seqs,
        proximal_logprobs=b.proximal[rows],
        ref_logprobs=b.ref[rows],
        entropy=b.entropy[rows],
    )


def normaliser(b: Batch, cfg: LossConfig) -> torch.Tensor:
    """What each token's loss is divided by under cfg.aggregation, as a [B, S] (or [B, 1]) tensor."""
    return {
        "token_mean": torch.full_like(b.mask, b.total_tokens),
        "seq_mean": b.mask.sum(-1, keepdim=True).clamp(min=1) * b.total_seqs,
        "constant": torch.full_like(b.mask, cfg.norm_constant * b.total_seqs),
    }[cfg.aggregation]


def reference(b: Batch, cfg: LossConfig) -> tuple[float, list[list[float]]]:
    """Batch loss and d loss / d logp, one token at a time."""
    logp, mu, prox, ref = (t.detach().double().tolist() for t in (b.logp, b.behaviour, b.proximal, b.ref))
    ent, adv, mask, ver = b.entropy.double().tolist(), b.advantages.double().tolist(), b.mask.tolist(), b.versions.tolist()
    n_tokens, n_seqs = b.total_tokens, b.total_seqs
    loss, grad = 0.0, [[0.0] * len(row) for row in logp]
    for i in range(len(logp)):
        toks = [t for t in range(len(logp[i])) if mask[i][t] > 0]
        if not toks:
            continue
        coef = {
            "token_mean": 1.0 / n_tokens,
            "seq_mean": 1.0 / (len(toks) * n_seqs),
            "constant": 1.0 / (cfg.norm_constant * n_seqs),
        }[cfg.aggregation]
        anchor = prox[i] if cfg.decoupled else mu[i]
        seq_log_ratio = sum(logp[i][t] - anchor[t] for t in toks) / len(toks)
        for t in toks:
            a = adv[i][t]
            r = math.exp(seq_log_ratio if cfg.ratio_level == "sequence" else logp[i][t] - anchor[t])
            rho = math.exp((prox[i][t] if cfg.decoupled else logp[i][t]) - mu[i][t])
            lag = max(LEARNER_VERSION - ver[i][t], 0)
            keep = not (
                (cfg.mask_ratio_low is not None and rho < cfg.mask_ratio_low)
                or (cfg.mask_ratio_high is not None and rho > cfg.mask_ratio_high)
                or (cfg.max_token_lag is not None and lag > cfg.max_token_lag)
            )
            weight = float(keep) * (cfg.lag_decay**lag if cfg.lag_decay is not None else 1.0)
            if cfg.tis_cap is not None and not cfg.decoupled:
                w = min(r, cfg.tis_cap)
                value, dvalue = -w * a, -w * a  # w is a constant; d(-w a log pi)/d log pi
            else:
                if a > 0:
                    value, dr = (-a * r, -a) if r < 1 + cfg.eps_high else (-a * (1 + cfg.eps_high), 0.0)
                elif a < 0:
                    value, dr = (-a * r, -a) if r > 1 - cfg.eps_low else (-a * (1 - cfg.eps_low), 0.0)
                    if cfg.dual_clip_c is not None and value > -cfg.dual_clip_c * a:
                        value, dr = -cfg.dual_clip_c * a, 0.0
                else:
                    value, dr = 0.0, 0.0
                dvalue = dr * r  # d r / d log pi_t = r, for the token and the GSPO-token ratio alike
                if cfg.decoupled:
                    w = math.exp(prox[i][t] - mu[i][t])
                    w = min(w, cfg.tis_cap) if cfg.tis_cap is not None else w
                    value, dvalue = value * w, dvalue * w
            value, dvalue = weight * value, weight * dvalue
            if cfg.kl_coef:
                x = logp[i][t] - ref[i][t]
                k, dk = {"k1": (x, 1.0), "k2": (x * x / 2, x), "k3": (math.exp(-x) + x - 1, 1 - math.exp(-x))}[
                    cfg.kl_estimator
                ]
                value, dvalue = value + cfg.kl_coef * k, dvalue + cfg.kl_coef * dk
            value -= cfg.entropy_coef * ent[i][t]
            loss += coef * value
            grad[i][t] += coef * dvalue
    return loss, grad


OBJECTIVES = {
    "ppo": LossConfig(),
    "ppo_symmetric": LossConfig(eps_low=0.2, eps_high=0.2),
    "dual_clip": LossConfig(dual_clip_c=3.0),
    "gspo": LossConfig(ratio_level="sequence", eps_low=3e-4, eps_high=4e-4),
    "gspo_wide": LossConfig(ratio_level="sequence"),
    "tis": LossConfig(tis_cap=2.0),
    "tis_inf": LossConfig(tis_cap=math.inf),
    "tis_sequence": LossConfig(tis_cap=2.0, ratio_level="sequence"),
    "decoupled": LossConfig(decoupled=True),
    "decoupled_tis": LossConfig(decoupled=True, tis_cap=2.0),
    "decoupled_sequence": LossConfig(decoupled=True, ratio_level="sequence"),
    "icepop": LossConfig(mask_ratio_low=0.5, mask_ratio_high=2.0),
    "icepop_high_only": LossConfig(mask_ratio_high=1.5, dual_clip_c=3.0),
    "max_lag": LossConfig(max_token_lag=3),
    "lag_decay": LossConfig(lag_decay=0.8),
    "kl_k1": LossConfig(kl_coef=0.1, kl_estimator="k1"),
    "kl_k2": LossConfig(kl_coef=0.1, kl_estimator="k2"),
    "kl_k3": LossConfig(kl_coef=0.1, kl_estimator="k3"),
    "entropy": LossConfig(entropy_coef=0.01),
    "everything": LossConfig(
        decoupled=True, tis_cap=3.0, dual_clip_c=2.5, mask_ratio_low=0.2, mask_ratio_high=5.0,
        max_token_lag=9, lag_decay=0.9, kl_coef=0.05, entropy_coef=0.01,
    ),
}
AGGREGATIONS = {
    "token_mean": dict(aggregation="token_mean"),
    "seq_mean": dict(aggregation="seq_mean"),
    "constant": dict(aggregation="constant", norm_constant=7.0),
}
# Objectives whose every term is a ratio correction: with behaviour == proximal == learner they
# must reduce to the plain policy gradient.
RATIO_ONLY = [
    "ppo", "dual_clip", "gspo", "gspo_wide", "tis", "tis_inf", "tis_sequence",
    "decoupled", "decoupled_tis", "decoupled_sequence", "icepop", "icepop_high_only",
]


def run(b: Batch, cfg: LossConfig, rows=slice(None)):
    loss, stats = policy_loss(b.logp[rows], loss_inputs(b, rows, totals=b), cfg)
    (grad,) = torch.autograd.grad(loss, b.logp, allow_unused=True)
    return loss, (torch.zeros_like(b.logp) if grad is None else grad), stats


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("name", OBJECTIVES)
def test_matches_reference(name, agg):
    cfg = replace(OBJECTIVES[name], **AGGREGATIONS[agg])
    b = make_batch(seed=len(name) * 31 + len(agg))
    loss, grad, _ = run(b, cfg)
    ref_loss, ref_grad = reference(b, cfg)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert loss.item() == pytest.approx(ref_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["ppo", "gspo_wide", "decoupled_tis", "everything"])
def test_float32_close_to_float64_reference(name):
    b = make_batch(seed=5, dtype=torch.float32)
    loss, grad, _ = run(b, OBJECTIVES[name])
    ref_loss, ref_grad = reference(b, OBJECTIVES[name])
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref_loss, rel=1e-4)
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=torch.float32), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("name", RATIO_ONLY)
def test_on_policy_reduces_to_policy_gradient(name, agg):
    cfg = replace(OBJECTIVES[name], **AGGREGATIONS[agg])
    b = make_batch(seed=11, extreme=False)
    on = b.mask > 0
    b.behaviour = torch.where(on, b.logp.detach(), 0.0)
    b.proximal = b.logp.detach().clone()
    loss, grad, _ = run(b, cfg)
    # Plain policy gradient: loss -A per token under the aggregation, gradient -A / normaliser.
    expected_grad = -b.advantages * b.mask / normaliser(b, cfg)
    torch.testing.assert_close(loss, expected_grad.sum(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_tis_inf_is_plain_importance_weighting(agg):
    cfg = LossConfig(tis_cap=math.inf, **AGGREGATIONS[agg])
    b = make_batch(seed=3)
    loss, grad, _ = run(b, cfg)
    # The uncorrected importance-weighted loss -pi/mu A, reduced by the same aggregation.
    on = b.mask > 0
    ratio = torch.exp(torch.where(on, b.logp - b.behaviour, 0.0))
    weighted = torch.where(on, -ratio * b.advantages, 0.0)
    expected = (weighted / normaliser(b, cfg)).sum()
    (expected_grad,) = torch.autograd.grad(expected, b.logp)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_gradient_equals_sequence_objective(eps):
    """GSPO's stop-gradient token form has the gradient of GSPO's sequence-level objective."""
    cfg = LossConfig(ratio_level="sequence", eps_low=eps[0], eps_high=eps[1], aggregation="seq_mean")
    b = make_batch(seed=21, extreme=False)
    # A small common shift keeps some sequences inside the clip band for tiny eps.
    b.behaviour = torch.where(b.mask > 0, b.logp.detach() + 1e-4 * torch.randn_like(b.logp), 0.0)
    loss, grad, _ = run(b, cfg)
    on = b.mask > 0
    n = b.mask.sum(-1).clamp(min=1)
    s = torch.exp(torch.where(on, b.logp - b.behaviour, 0.0).sum(-1) / n)  # gradient flows through s
    a = b.advantages.sum(-1) / n
    per_seq = torch.maximum(-a * s, -a * s.clamp(1 - eps[0], 1 + eps[1]))
    objective = (per_seq * (b.mask.sum(-1) > 0)).sum() / b.total_seqs
    (expected_grad,) = torch.autograd.grad(objective, b.logp)
    torch.testing.assert_close(loss, objective, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("name", ["ppo", "gspo_wide", "decoupled_tis", "everything"])
def test_micro_batches_add_up(name, agg):
    cfg = replace(OBJECTIVES[name], **AGGREGATIONS[agg])
    b = make_batch(seed=7)
    full_loss, full_grad, full_stats = run(b, cfg)
    splits = [slice(0, 1), slice(1, 2), slice(2, 5), slice(5, None)]  # slice(1, 2) has no trained token
    parts = [run(b, cfg, rows) for rows in splits]
    torch.testing.assert_close(sum(p[0] for p in parts), full_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(sum(p[1] for p in parts), full_grad, rtol=1e-12, atol=1e-14)
    merged, whole = merge_stats([p[2] for p in parts]), merge_stats([full_stats])
    assert merged.keys() == whole.keys()
    for key in whole:
        assert merged[key] == pytest.approx(whole[key], rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("name", ["ppo", "gspo", "tis", "decoupled_tis", "everything"])
def test_empty_micro_batch_gives_zero_loss(name):
    b = make_batch(seed=2)
    loss, grad, stats = run(b, OBJECTIVES[name], rows=slice(1, 2))  # row 1 has no trained token
    assert loss.item() == 0.0 and torch.count_nonzero(grad) == 0
    metrics = merge_stats([stats])
    assert metrics["mask/tokens"] == 0.0 and all(math.isfinite(v) for v in metrics.values())
    # A whole batch without trained tokens (totals 0) is still finite.
    inputs = replace(loss_inputs(b, slice(1, 2)), total_tokens=0.0, total_seqs=0.0)
    loss, _ = policy_loss(b.logp[1:2], inputs, OBJECTIVES[name])
    assert loss.item() == 0.0


def test_stats_keys_do_not_depend_on_data():
    """Partials must line up across micro-batches and DP ranks, whatever tokens each one holds."""
    b, cfg = make_batch(seed=4), OBJECTIVES["everything"]
    keys = {frozenset(run(b, cfg, rows)[2]) for rows in (slice(0, 1), slice(1, 2), slice(None))}
    assert len(keys) == 1


def test_loss_parts_reported():
    b, cfg = make_batch(seed=8), OBJECTIVES["everything"]
    loss, _, stats = run(b, cfg)
    metrics = merge_stats([stats])
    assert metrics["loss/total"] == pytest.approx(loss.item(), rel=1e-12)
    assert metrics["loss/pg"] + metrics["loss/kl"] + metrics["loss/entropy"] == pytest.approx(loss.item(), rel=1e-12)
    assert metrics["loss/entropy"] < 0 < metrics["loss/kl"]


def test_decoupled_without_proximal_is_a_clear_error():
    b = make_batch(seed=1)
    inputs = replace(loss_inputs(b), proximal_logprobs=None)
    with pytest.raises(ValueError, match="proximal_logprobs"):
        policy_loss(b.logp, inputs, LossConfig(decoupled=True))


@pytest.mark.parametrize("field,missing", [("kl_coef", "ref_logprobs"), ("entropy_coef", "entropy")])
def test_regulariser_without_its_input_is_a_clear_error(field, missing):
    b = make_batch(seed=1)
    with pytest.raises(ValueError, match=missing):
        policy_loss(b.logp, replace(loss_inputs(b), **{missing: None}), LossConfig(**{field: 0.1}))


@pytest.mark.parametrize(
    "field,value",
    [
        ("eps_low", -0.1), ("eps_low", 1.0), ("eps_high", -0.01), ("eps_high", math.inf),
        ("aggregation", "sum"), ("ratio_level", "group"), ("kl_estimator", "k4"),
        ("norm_constant", 0.0), ("dual_clip_c", 1.0), ("tis_cap", 0.0), ("mask_ratio_low", 1.5),
        ("mask_ratio_high", 0.5), ("max_token_lag", -1), ("lag_decay", 0.0), ("lag_decay", 1.5),
        ("kl_coef", -1.0), ("entropy_coef", -0.1), ("max_lag_bucket", 0),
    ],
)
def test_validate_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"loss.{field}="):
        validate_loss_config(replace(LossConfig(), **{field: value}))


def test_gspo_without_seq_mean_warns_naming_both_keys():
    import warnings

    from megarl.algo.config import ObjectiveWarning
    from megarl.config.load import load_config

    for aggregation in ("token_mean", "constant"):
        with pytest.warns(ObjectiveWarning, match=f"algo.loss.ratio_level=sequence \\(GSPO\\) with "
                                                  f"algo.loss.aggregation={aggregation}: each sequence's loss is "
                                                  f"weighted by its length.*set algo.loss.aggregation=seq_mean"):
            load_config(None, ["algo.loss.ratio_level=sequence", f"algo.loss.aggregation={aggregation}"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ObjectiveWarning)  # GSPO as the paper weighs it, and token ratios: silent
        load_config(None, ["algo.loss.ratio_level=sequence", "algo.loss.aggregation=seq_mean"])
        load_config(None, ["algo.loss.aggregation=token_mean"])


def test_defaults_are_valid_and_spine_compatible():
    cfg = LossConfig()
    validate_loss_config(cfg)
    assert (cfg.eps_low, cfg.eps_high, cfg.aggregation, cfg.norm_constant) == (0.2, 0.28, "token_mean", 1.0)
    assert (cfg.ratio_level, cfg.decoupled, cfg.tis_cap, cfg.dual_clip_c) == ("token", False, None, None)


def test_config_is_an_omegaconf_structured_config():
    omegaconf = pytest.importorskip("omegaconf")
    merged = omegaconf.OmegaConf.merge(
        omegaconf.OmegaConf.structured(LossConfig), omegaconf.OmegaConf.from_dotlist(["tis_cap=2.0", "max_token_lag=4"])
    )
    cfg = omegaconf.OmegaConf.to_object(merged)
    assert cfg.tis_cap == 2.0 and cfg.max_token_lag == 4 and cfg.lag_decay is None


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_entropy_bonus_gradient(agg):
    cfg = LossConfig(entropy_coef=0.01, **AGGREGATIONS[agg])
    b = make_batch(seed=9)
    b.entropy.requires_grad_()
    loss, _ = policy_loss(b.logp, loss_inputs(b), cfg)
    (grad,) = torch.autograd.grad(loss, b.entropy)
    torch.testing.assert_close(grad, -cfg.entropy_coef * b.mask / normaliser(b, cfg), rtol=1e-12, atol=1e-15)


def test_nll_loss_is_the_masked_token_mean_split_over_micro_batches():
    """The supervised objective (megarl sft): shares of micro-batches add up to the batch's token mean of
    -log pi over the mask; off-mask positions (padding, even -inf) contribute neither value nor gradient."""
    from megarl.algo.losses import nll_loss

    torch.manual_seed(0)
    logp = -torch.rand(4, 6, dtype=torch.float64) * 3
    mask = (torch.rand(4, 6) > 0.4).double()
    mask[3] = 0.0
    logp = logp.masked_fill(mask == 0, -math.inf).requires_grad_()
    total = float(mask.sum())
    expected = sum(-logp[i, t].item() for i in range(4) for t in range(6) if mask[i, t]) / total
    parts = [nll_loss(logp[rows], mask[rows], total) for rows in (slice(0, 1), slice(1, 3), slice(3, 4))]
    loss = sum(p[0] for p in parts)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, -mask / total)
    stats = merge_stats([p[1] for p in parts])
    assert stats["loss/nll"] == pytest.approx(expected, rel=1e-12)
    assert stats["mask/tokens"] == total and stats["mask/seqs"] == 3.0 and "ratio/mean" not in stats
