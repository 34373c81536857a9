"""On-policy distillation: a frozen teacher scores the student's own sampled tokens, and the per-token
reverse KL to the teacher becomes the advantage of megarl's per-token importance-ratio policy loss.

For a token x_t the student sampled, the sampled-token estimate of the reverse KL KL(pi_theta || pi_T) at
that position is k_t = log pi_theta(x_t) - log pi_T(x_t), and the distillation advantage is its negative:

    A_t = reward_weight * A_rl_t  -  coef * (sg(log pi_theta(x_t)) - log pi_T(x_t))      (0 off the mask)

fed to megarl.algo.losses.policy_loss unchanged (per-token ratio against the token's own behaviour log-prob,
clip, aggregation, lag metrics). With reward_weight = 0 this is pure on-policy distillation (Thinking Machines'
"on-policy distillation", prime-rl `algo.type=opd`); reward_weight > 0 mixes in the task's group advantage.
docs/algorithms.md#on-policy-distillation says why the student term is the learner's current log-prob (not the
behaviour log-prob) and why the sampled-token estimate rather than the full-vocabulary KL.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


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


def distill_advantages(learner_logprobs: Tensor, teacher_logprobs: Tensor, rl_advantages: Tensor, mask: Tensor,
                       cfg: DistillConfig) -> Tensor:
    """Per-token advantages [B, S] of on-policy distillation (module docstring), 0 off the mask.

    learner_logprobs: the student's log-probs of the sampled tokens (detached here: the advantage is a constant
    of the policy gradient); teacher_logprobs: the teacher's, same alignment; rl_advantages: the batch's group
    advantages. Off-mask positions (prompt, padding, environment tokens) may hold anything and give 0.
    """
    dtype = torch.promote_types(learner_logprobs.dtype, torch.float32)
    reverse_kl = learner_logprobs.detach().to(dtype) - teacher_logprobs.to(dtype)
    adv = cfg.reward_weight * rl_advantages.to(dtype) - cfg.coef * reverse_kl
    return torch.where(mask > 0, adv, 0.0)
