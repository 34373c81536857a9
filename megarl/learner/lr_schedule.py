"""The learning rate of each optimizer step: linear warm-up, then constant, linear or cosine decay to a floor.

    lr(s) = lr * (s + 1) / W                                         s < W      (warm-up, W = lr_warmup_steps)
    lr(s) = lr_min + (lr - lr_min) * f((s - W) / (T - W))            s >= W     (T = lr_decay_steps, clamped at 1)
            f(p) = 1 (constant), 1 - p (linear), (1 + cos(pi p)) / 2 (cosine);  lr_min = lr * lr_min_ratio

`s` counts the optimizer steps the learner has applied (its version: a skipped non-finite step does not move the
schedule, and a resumed learner continues where its checkpoint was, with no state of its own). After warm-up this
is transformers' `get_{linear,cosine}_schedule_with_warmup` (with a floor); during warm-up step s trains at
(s + 1) / W of lr where transformers' trains at s / W, so no step is spent at lr 0.
A pure function: the learner backends (megarl.learner.megatron, megarl.learner.deepspeed) set it on their optimizer
before each step and report it as the step's `lr`.
"""
from __future__ import annotations

import math

from megarl.config.schema import LR_DECAYS


def lr_at(step: int, cfg) -> float:
    """The learning rate of optimizer step `step` (0-based) under cfg (a LearnerConfig: lr, lr_warmup_steps,
    lr_decay, lr_decay_steps, lr_min_ratio; lr_decay_steps already resolved from 0 by megarl.learner.build_learner)."""
    warmup = cfg.lr_warmup_steps
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.lr_decay == "constant":
        return cfg.lr
    if cfg.lr_decay not in LR_DECAYS:
        raise ValueError(f"learner.lr_decay={cfg.lr_decay!r}: must be one of {', '.join(LR_DECAYS)}")
    if cfg.lr_decay_steps <= warmup:
        raise ValueError(f"learner.lr_decay_steps={cfg.lr_decay_steps} must exceed learner.lr_warmup_steps={warmup}")
    progress = min(1.0, (step - warmup) / (cfg.lr_decay_steps - warmup))
    shape = 1.0 - progress if cfg.lr_decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    floor = cfg.lr * cfg.lr_min_ratio
    return floor + (cfg.lr - floor) * shape
