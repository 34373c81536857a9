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

import torch
from torch import Tensor

from megarl.algo.config import DistillConfig


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
