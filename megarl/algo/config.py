"""Configuration of the RL objective: which ratio, clipping, advantages and aggregation the learner uses.

Every dataclass here is an OmegaConf structured config (under `algo.loss`, `algo.advantage`, `algo.critic`,
`algo.distill` of the run config), so every field has a plain type and a default.  Defaults reproduce the spine
behaviour: PPO clip with clip-higher (eps 0.2 / 0.28) against the per-token behaviour log-prob,
token-level mean, GRPO advantages with std normalisation, nothing filtered.

`validate_loss_config` / `validate_advantage_config` reject impossible values at start with a message
naming the field, and warn (`ObjectiveWarning`) about sound combinations that do not mean what their
names promise; docs/algorithms.md explains every objective and which paper uses it.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional

RATIO_LEVELS = ("token", "sequence")
AGGREGATIONS = ("token_mean", "seq_mean", "constant")
KL_ESTIMATORS = ("k1", "k2", "k3")
ADVANTAGE_ESTIMATORS = ("grpo", "drgrpo", "rloo", "gae")
VALUE_TARGETS = ("gae", "vtrace")


@dataclass
class LossConfig:
    # PPO-style clip of the per-token ratio pi_theta / mu_behaviour, with separate low/high
    # epsilons (clip-higher, DAPO): the ratio is clipped to [1 - eps_low, 1 + eps_high].
    eps_low: float = 0.2
    eps_high: float = 0.28
    # How per-token losses are reduced to one number: "token_mean" (every completion token in the
    # batch weighs the same), "seq_mean" (mean over each sequence's tokens, then over sequences),
    # "constant" (sum divided by `norm_constant` * number of sequences, Dr.GRPO style).
    aggregation: str = "token_mean"
    norm_constant: float = 1.0
    # "token": one ratio per token.  "sequence": GSPO, the geometric mean of a sequence's token
    # ratios, shared by all its tokens (clip with much smaller eps, e.g. 3e-4 / 4e-4).
    ratio_level: str = "token"
    # Dual clip (Ye et al. 2020): for negative advantages the per-token loss is capped at
    # -dual_clip_c * A, so a huge ratio cannot blow the step up.  Must be > 1.  None = off.
    dual_clip_c: Optional[float] = None
    # Truncated importance sampling: a detached weight min(rho, tis_cap) on each token.  With
    # `decoupled` it truncates the behaviour weight pi_prox / mu; without, it replaces the PPO clip
    # (truncated-IS policy gradient).  math.inf = untruncated.  None = off.
    tis_cap: Optional[float] = None
    # IcePop / masked importance sampling: tokens whose behaviour ratio leaves
    # [mask_ratio_low, mask_ratio_high] get no gradient (and are counted).  None = that side off.
    mask_ratio_low: Optional[float] = None
    mask_ratio_high: Optional[float] = None
    # Lag-aware weighting, lag = learner_version - token version: drop tokens older than
    # `max_token_lag` and/or weight each token by lag_decay ** lag.  None = off.
    max_token_lag: Optional[int] = None
    lag_decay: Optional[float] = None
    # Decoupled PPO (AReaL): clip against the proximal policy (learner log-probs at step start,
    # LossInputs.proximal_logprobs) and weight by the detached behaviour ratio pi_prox / mu.
    decoupled: bool = False
    # KL penalty to a reference policy (LossInputs.ref_logprobs), per-token estimator k1|k2|k3.
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # see kl_coef
    # Entropy bonus (LossInputs.entropy): loss -= entropy_coef * mean entropy.
    entropy_coef: float = 0.0
    # Report the policy's mean entropy over the trained tokens (entropy/mean) even without the bonus: a collapsing
    # entropy is RL's usual early warning. Computed without gradient, in slices of positions (its cost: docs/learner.md).
    entropy_metric: bool = True
    # Metrics are broken down by token lag 0..max_lag_bucket-1, plus one bucket "lag{max}+".
    max_lag_bucket: int = 8


@dataclass
class AdvantageConfig:
    # "grpo": reward minus the group mean, divided by the group std when `std_normalize`.
    # "drgrpo": reward minus the group mean (Dr.GRPO: no std, `std_normalize` ignored).
    # "rloo": reward minus the mean of the *other* samples of its group (`std_normalize` ignored).
    # "gae": per-token GAE with a learned critic (`algo.critic`, megarl.algo.values); the group
    # baseline is not used (`std_normalize` ignored; `algo.critic.whiten` normalises instead).
    estimator: str = "grpo"
    std_normalize: bool = True
    eps: float = 1e-6  # added to the group's reward std before dividing by it
    # DAPO dynamic sampling: drop groups whose rewards are all equal (they carry no signal).
    filter_zero_variance: bool = False
    # DAPO overlong filtering: samples cut off by the length limit get zero weight.
    drop_truncated: bool = False
    # DAPO soft overlong punishment: a sample whose length L (tokens after the prompt) comes within
    # `overlong_buffer` tokens of its limit L_max gets overlong_penalty * (L - (L_max - buffer)) / buffer taken
    # off its reward before the group baseline (a sample at its limit, the whole penalty). 0 = off.
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0


@dataclass
class CriticConfig:
    """The learned critic of `advantage.estimator=gae` (megarl.learner.critic, docs/algorithms.md#ppo-with-a-critic)."""

    # HF model directory of the value model's trunk ("" = the policy's model.path); a linear value head
    # (zero-initialised) is put on its last hidden state, or kept from a critic directory a run exported
    # (`<export>/critic/`, transformers' token-classification format). It must share the policy's tokenizer.
    model: str = ""
    # Discount and GAE lambda per model token (environment tokens are not steps: megarl.algo.values).
    gamma: float = 1.0
    lam: float = 0.95  # see gamma
    # The value target: "gae" (the GAE return A + V with the current critic, as the peers do) or
    # "vtrace" (V-trace, per-token truncated importance weights against each token's behaviour log-prob).
    target: str = "gae"
    # V-trace truncation levels: c_t = lam * min(c_bar, pi/mu) (trace), rho_t = min(rho_bar, pi/mu) (TD error).
    c_bar: float = 1.0
    rho_bar: float = 1.0
    # The critic's own AdamW optimizer (a separate model: a loss coefficient would only rescale its lr).
    lr: float = 1e-4
    weight_decay: float = 0.0  # see lr
    grad_clip: float = 1.0  # see lr: the critic's gradient norm is clipped to this
    # PPO value clip: V is clipped to old_V +- value_clip in the loss (None = off).
    value_clip: Optional[float] = None
    # The first `warmup_steps` optimizer steps train only the critic (the policy is not updated).
    warmup_steps: int = 0
    # Normalise the batch's GAE advantages to mean 0, std 1 over its model tokens (verl/OpenRLHF's whitening).
    whiten: bool = True


@dataclass(frozen=True)
class NLLConfig:
    """The supervised objective of `megarl sft`: the masked token-mean negative log-likelihood
    (megarl.algo.losses.nll_loss). Not a run-config section (megarl sft builds it); its fields are
    the ones every learner backend asks of its objective, fixed: no proximal pass, no reference
    model, no entropy."""

    decoupled: bool = False
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    entropy_metric: bool = False


class ObjectiveWarning(UserWarning):
    """A valid objective that differs from the method its settings are named after."""


def _fail(field: str, value, why: str) -> None:
    raise ValueError(f"{field}={value!r}: {why}")


def _check_choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(field, value, f"must be one of {', '.join(choices)}")


def validate_loss_config(cfg: LossConfig) -> None:
    """Raise ValueError naming the field if `cfg` cannot describe a sound objective."""
    _check_choice("loss.ratio_level", cfg.ratio_level, RATIO_LEVELS)
    _check_choice("loss.aggregation", cfg.aggregation, AGGREGATIONS)
    _check_choice("loss.kl_estimator", cfg.kl_estimator, KL_ESTIMATORS)
    # The lower clip bound 1 - eps_low must stay positive or the clip admits ratio <= 0.
    if not 0.0 <= cfg.eps_low < 1.0:
        _fail("loss.eps_low", cfg.eps_low, "must be in [0, 1)")
    if not 0.0 <= cfg.eps_high < math.inf:
        _fail("loss.eps_high", cfg.eps_high, "must be finite and >= 0")
    if not 0.0 < cfg.norm_constant < math.inf:
        _fail("loss.norm_constant", cfg.norm_constant, "must be finite and > 0")
    # A dual clip at or below 1 would cap losses the ordinary clip already allows.
    if cfg.dual_clip_c is not None and not cfg.dual_clip_c > 1.0:
        _fail("loss.dual_clip_c", cfg.dual_clip_c, "must be > 1 (or None to disable)")
    if cfg.tis_cap is not None and not cfg.tis_cap > 0.0:
        _fail("loss.tis_cap", cfg.tis_cap, "must be > 0 (math.inf = untruncated, None = off)")
    if cfg.mask_ratio_low is not None and not 0.0 <= cfg.mask_ratio_low <= 1.0:
        _fail("loss.mask_ratio_low", cfg.mask_ratio_low, "must be in [0, 1]")
    if cfg.mask_ratio_high is not None and not cfg.mask_ratio_high >= 1.0:
        _fail("loss.mask_ratio_high", cfg.mask_ratio_high, "must be >= 1")
    if cfg.max_token_lag is not None and cfg.max_token_lag < 0:
        _fail("loss.max_token_lag", cfg.max_token_lag, "must be >= 0")
    if cfg.lag_decay is not None and not 0.0 < cfg.lag_decay <= 1.0:
        _fail("loss.lag_decay", cfg.lag_decay, "must be in (0, 1]")
    if not 0.0 <= cfg.kl_coef < math.inf:
        _fail("loss.kl_coef", cfg.kl_coef, "must be finite and >= 0")
    if not 0.0 <= cfg.entropy_coef < math.inf:
        _fail("loss.entropy_coef", cfg.entropy_coef, "must be finite and >= 0")
    if cfg.max_lag_bucket < 1:
        _fail("loss.max_lag_bucket", cfg.max_lag_bucket, "must be >= 1")
    # A warning, not a refusal: length-weighted sequence ratios are a sound objective that some setups
    # want; but whoever asks for GSPO by its ratio gets its 1/G sequence weighting only with seq_mean.
    if cfg.ratio_level == "sequence" and cfg.aggregation != "seq_mean":
        warnings.warn(f"algo.loss.ratio_level=sequence (GSPO) with algo.loss.aggregation={cfg.aggregation}: each "
                      f"sequence's loss is weighted by its length, whereas GSPO weighs the sequences of a batch "
                      f"alike; set algo.loss.aggregation=seq_mean for GSPO (docs/algorithms.md)",
                      ObjectiveWarning, stacklevel=2)


def validate_advantage_config(cfg: AdvantageConfig) -> None:
    """Raise ValueError naming the field if `cfg` cannot describe an advantage estimator."""
    _check_choice("advantage.estimator", cfg.estimator, ADVANTAGE_ESTIMATORS)
    if not 0.0 <= cfg.eps < math.inf:
        _fail("advantage.eps", cfg.eps, "must be finite and >= 0")
    if cfg.overlong_buffer < 0:
        _fail("advantage.overlong_buffer", cfg.overlong_buffer, "must be >= 0 (tokens; 0 = off)")
    if not 0.0 <= cfg.overlong_penalty < math.inf:
        _fail("advantage.overlong_penalty", cfg.overlong_penalty, "must be finite and >= 0")


def validate_critic_config(cfg: CriticConfig) -> None:
    """Raise ValueError naming the field if `cfg` cannot describe a critic; warn (ObjectiveWarning) when
    gamma = lam = 1 on terminal rewards makes GAE the plain reward-minus-value baseline."""
    _check_choice("critic.target", cfg.target, VALUE_TARGETS)
    for name in ("gamma", "lam"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            _fail(f"critic.{name}", getattr(cfg, name), "must be in [0, 1]")
    for name in ("c_bar", "rho_bar", "lr"):
        if not getattr(cfg, name) > 0.0:
            _fail(f"critic.{name}", getattr(cfg, name), "must be > 0 (math.inf = untruncated for c_bar/rho_bar)")
    # V-trace's fixed point is the value of the policy min(rho_bar mu, pi) normalised: rho_bar < c_bar
    # would make the trace cut less than the TD error is truncated (Espeholt et al. 2018, sec. 4.1).
    if cfg.target == "vtrace" and cfg.c_bar > cfg.rho_bar:
        _fail("critic.c_bar", cfg.c_bar, f"must be <= critic.rho_bar ({cfg.rho_bar}) (V-trace assumes c_bar <= rho_bar)")
    if cfg.value_clip is not None and not cfg.value_clip > 0.0:
        _fail("critic.value_clip", cfg.value_clip, "must be > 0 (None = off)")
    if not 0.0 <= cfg.weight_decay < math.inf:
        _fail("critic.weight_decay", cfg.weight_decay, "must be finite and >= 0")
    if not 0.0 < cfg.grad_clip < math.inf:
        _fail("critic.grad_clip", cfg.grad_clip, "must be finite and > 0")
    if cfg.warmup_steps < 0:
        _fail("critic.warmup_steps", cfg.warmup_steps, "must be >= 0")
    if cfg.gamma == 1.0 and cfg.lam == 1.0:
        warnings.warn("algo.critic.gamma=1 and algo.critic.lam=1 with terminal rewards (every megarl task): GAE "
                      "reduces to A_t = R - V(s_t), the sample reward minus a learned per-token baseline, and the "
                      "value target is R for every token (docs/algorithms.md#ppo-with-a-critic)",
                      ObjectiveWarning, stacklevel=2)


@dataclass
class DistillConfig:
    # The frozen teacher: "" = no distillation; an HF-format model directory or "embedded:<name>". It must share
    # the student's tokenizer (vocabulary and special tokens): refused before launch otherwise.
    teacher: str = ""
    # Weight of the per-token reverse-KL advantage -(log pi_student - log pi_teacher) of every sampled token.
    coef: float = 1.0
    # Weight of the task's group advantage (algo.advantage) mixed in: 0 = pure distillation, 1 = RL + distillation.
    reward_weight: float = 0.0


def validate_distill_config(cfg: DistillConfig) -> None:
    """ValueError naming the field (`distill.<field>`) if `cfg` cannot describe a distillation objective."""
    if not 0.0 <= cfg.coef < math.inf:
        raise ValueError(f"distill.coef={cfg.coef!r}: must be finite and >= 0")
    if not 0.0 <= cfg.reward_weight < math.inf:
        raise ValueError(f"distill.reward_weight={cfg.reward_weight!r}: must be finite and >= 0")
    if cfg.teacher and cfg.coef == 0.0 and cfg.reward_weight == 0.0:
        raise ValueError("distill.coef=0.0: with distill.reward_weight=0.0 every advantage is 0 and nothing trains")
