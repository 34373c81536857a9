"""On-policy distillation's objective (megarl.algo.distill through megarl.learner.step.micro_batch_loss)
against independent float64 references: the advantages one token at a time in python, the policy loss by
test_losses' loop reference, the on-policy gradient in closed form, and the teacher-KL metrics by lag."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from megarl.algo.config import LossConfig
from megarl.algo.config import DistillConfig, validate_distill_config
from megarl.algo.losses import merge_stats
from megarl.learner.step import micro_batch_loss
from tests.algo import LEARNER_VERSION, make_batch
from tests.algo.test_losses import reference


def teacher_of(b, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return b.logp.detach() + 0.7 * torch.randn(b.logp.shape, generator=g, dtype=torch.float64)


def step_loss(b, teacher, loss_cfg, distill, rows=slice(None)):
    mb = {"mask": b.mask[rows], "behaviour_logprobs": b.behaviour[rows], "advantages": b.advantages[rows],
          "versions": b.versions[rows], "teacher_logprobs": teacher[rows]}
    return micro_batch_loss(b.logp[rows], mb, LEARNER_VERSION, (b.total_tokens, b.total_seqs), loss_cfg,
                            distill=distill)


def loop_advantages(b, teacher, distill: DistillConfig) -> list[list[float]]:
    logp, t, adv, mask = (x.detach().double().tolist() for x in (b.logp, teacher, b.advantages, b.mask))
    return [[distill.reward_weight * adv[i][s] - distill.coef * (logp[i][s] - t[i][s]) if mask[i][s] > 0 else 0.0
             for s in range(len(mask[i]))] for i in range(len(mask))]


DISTILLS = {"pure": DistillConfig(teacher="t", coef=1.0), "scaled": DistillConfig(teacher="t", coef=0.3),
            "mixed": DistillConfig(teacher="t", coef=0.5, reward_weight=1.0)}
LOSSES = {"ppo_token_mean": LossConfig(), "ppo_seq_mean": LossConfig(aggregation="seq_mean"),
          "tis": LossConfig(tis_cap=2.0), "max_lag": LossConfig(max_token_lag=3)}


@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("distill_name", DISTILLS)
def test_matches_loop_reference(distill_name, loss_name):
    """Loss and gradient equal the per-token importance-ratio loss (the loop reference) with the advantage
    computed token by token: the student term is a constant, so no gradient flows through the advantage."""
    b = make_batch(seed=len(distill_name) * 7 + len(loss_name))
    teacher = teacher_of(b, seed=3)
    loss, _ = step_loss(b, teacher, LOSSES[loss_name], DISTILLS[distill_name])
    (grad,) = torch.autograd.grad(loss, b.logp)
    expected = replace(b, advantages=torch.tensor(loop_advantages(b, teacher, DISTILLS[distill_name]),
                                                  dtype=torch.float64))
    ref_loss, ref_grad = reference(expected, LOSSES[loss_name])
    assert loss.item() == pytest.approx(ref_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-9, atol=1e-12)


def test_on_policy_gradient_is_the_reverse_kl_policy_gradient():
    """Sampled on-policy (behaviour = learner, every ratio 1, no clip binding), the token-mean gradient is
    coef * (log pi - log pi_T) / N at every trained token: the score-function gradient of the reverse KL."""
    b = make_batch(seed=11, extreme=False)
    b = replace(b, behaviour=torch.where(b.mask > 0, b.logp.detach(), 0.0))
    teacher = teacher_of(b, seed=4)
    distill = DistillConfig(teacher="t", coef=0.7)
    loss, _ = step_loss(b, teacher, LossConfig(), distill)
    (grad,) = torch.autograd.grad(loss, b.logp)
    logp, t, mask = b.logp.detach().tolist(), teacher.tolist(), b.mask.tolist()
    expected = [[distill.coef * (logp[i][s] - t[i][s]) / b.total_tokens if mask[i][s] > 0 else 0.0
                 for s in range(len(mask[i]))] for i in range(len(mask))]
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-12)


def test_teacher_kl_metrics_by_lag_add_up_over_micro_batches():
    b = make_batch(seed=21)
    teacher = teacher_of(b, seed=5)
    cfg = LossConfig(max_lag_bucket=4)
    distill = DistillConfig(teacher="t")
    out = merge_stats([step_loss(b, teacher, cfg, distill, rows=rows)[1]
                       for rows in (slice(0, 2), slice(2, 3), slice(3, None))])
    logp, t, mask, ver = b.logp.detach().tolist(), teacher.tolist(), b.mask.tolist(), b.versions.tolist()
    by_lag: dict[str, list[float]] = {}
    k3 = []
    for i in range(len(mask)):
        for s in range(len(mask[i])):
            if mask[i][s] > 0:
                x = logp[i][s] - t[i][s]
                lag = max(LEARNER_VERSION - ver[i][s], 0)
                by_lag.setdefault(f"lag{lag}" if lag < 4 else "lag4+", []).append(x)
                k3.append(math.exp(-x) - 1 + x)
    every = [x for xs in by_lag.values() for x in xs]
    assert out["distill/teacher_kl"] == pytest.approx(sum(every) / len(every), rel=1e-12)
    assert out["distill/teacher_kl_k3"] == pytest.approx(sum(k3) / len(k3), rel=1e-12)
    assert {k for k in out if k.endswith("/teacher_kl") and k.startswith("lag")} == {f"{n}/teacher_kl" for n in by_lag}
    for name, xs in by_lag.items():
        assert out[f"{name}/teacher_kl"] == pytest.approx(sum(xs) / len(xs), rel=1e-12)


def test_missing_teacher_logprobs_is_a_clear_error():
    b = make_batch(seed=2)
    mb = {"mask": b.mask, "behaviour_logprobs": b.behaviour, "advantages": b.advantages, "versions": b.versions}
    with pytest.raises(ValueError, match="teacher_logprobs"):
        micro_batch_loss(b.logp, mb, LEARNER_VERSION, (b.total_tokens, b.total_seqs), LossConfig(),
                         distill=DistillConfig(teacher="t"))


@pytest.mark.parametrize("field,value", [("coef", -1.0), ("coef", math.inf), ("reward_weight", -0.5),
                                         ("coef", 0.0)])
def test_validate_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^distill\.{field}="):
        validate_distill_config(replace(DistillConfig(teacher="t"), **{field: value}))


@pytest.mark.parametrize("overrides,key", [
    (["algo.distill.teacher=x", "algo.distill.coef=-1"], "algo.distill.coef"),
    (["algo.distill.teacher=x", "algo.distill.coef=0"], "algo.distill.coef"),
    (["algo.distill.teacher=x", "algo.advantage.filter_zero_variance=true"], "algo.advantage.filter_zero_variance"),
])
def test_the_run_config_refuses_naming_the_key(overrides, key):
    from megarl.config.load import ConfigError, load_config
    from tests.helpers import REPO

    with pytest.raises(ConfigError, match=rf"^{key}"):
        load_config(REPO / "configs" / "demo.yaml", overrides)
    # Mixed with the reward, dropping zero-variance groups is the user's call (it drops teacher signal too): allowed.
    load_config(REPO / "configs" / "demo.yaml", ["algo.distill.teacher=x", "algo.distill.reward_weight=1",
                                                  "algo.advantage.filter_zero_variance=true"])
