"""Shared fixtures of the algo tests: random Pipeline-RL batches that stress the off-policy math.

A batch mixes several policy versions inside one sequence (versions advance along a sequence, as
an in-flight weight swap does), has prompts and right padding off the mask, one sequence with no
trained token, a sequence with zero advantage, lags beyond the last lag bucket, and a few tokens
with extreme behaviour/learner gaps (|log pi - log mu| = 20).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LEARNER_VERSION = 12


@dataclass
class Batch:
    logp: torch.Tensor  # learner log-probs, a leaf with requires_grad
    behaviour: torch.Tensor
    proximal: torch.Tensor
    ref: torch.Tensor
    entropy: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    versions: torch.Tensor

    @property
    def total_tokens(self) -> float:
        return float(self.mask.sum())

    @property
    def total_seqs(self) -> float:
        return float((self.mask.sum(-1) > 0).sum())


def make_batch(seed: int, batch: int = 6, seq: int = 14, dtype=torch.float64, extreme: bool = True) -> Batch:
    g = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    mask = torch.zeros(batch, seq)
    versions = torch.full((batch, seq), -1, dtype=torch.long)
    for b in range(batch):
        prompt = randint(1, 4)
        length = 0 if b == 1 else randint(1, seq - prompt)  # row 1: nothing to train on
        mask[b, prompt : prompt + length] = 1.0
        version = LEARNER_VERSION - randint(0, 11)  # up to lag 11, past the lag8+ bucket edge
        for t in range(prompt, prompt + length):
            versions[b, t] = version
            if randint(0, 3) == 0:  # an in-flight swap: later tokens come from a newer policy
                version = min(version + 1, LEARNER_VERSION)
    on = mask > 0
    logp = -3.0 * torch.rand(batch, seq, generator=g, dtype=torch.float64)
    behaviour = logp + 0.3 * torch.randn(batch, seq, generator=g, dtype=torch.float64)
    if extreme:
        flat = on.flatten().nonzero().flatten()
        picks = flat[torch.randperm(flat.numel(), generator=g)[:3]]
        behaviour.view(-1)[picks[0]] = logp.view(-1)[picks[0]] - 20.0
        behaviour.view(-1)[picks[1]] = logp.view(-1)[picks[1]] + 20.0
        behaviour.view(-1)[picks[2]] = logp.view(-1)[picks[2]] - 19.5
    # Off the mask the behaviour log-prob is 0 by contract and the learner's is garbage; the loss
    # must not let that garbage reach a value or a gradient.
    behaviour = torch.where(on, behaviour, 0.0)
    logp = torch.where(on, logp, 30.0 * torch.randn(batch, seq, generator=g, dtype=torch.float64))
    seq_adv = torch.randn(batch, 1, generator=g, dtype=torch.float64)
    seq_adv[-1] = 0.0
    return Batch(
        logp=logp.to(dtype).clone().requires_grad_(),
        behaviour=behaviour.to(dtype),
        proximal=(logp + 0.2 * torch.randn(batch, seq, generator=g, dtype=torch.float64)).to(dtype),
        ref=(logp + 0.3 * torch.randn(batch, seq, generator=g, dtype=torch.float64)).to(dtype),
        entropy=torch.rand(batch, seq, generator=g, dtype=torch.float64).to(dtype),
        advantages=(seq_adv * mask).to(dtype),
        mask=mask.to(dtype),
        versions=versions,
    )
