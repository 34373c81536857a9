"""Learner backends (megarl.protocols.Learner): megatron-core (megatron.py, the default) and DeepSpeed
ZeRO (deepspeed.py), chosen by `learner.backend`; step.py is the part of a step they share.

Importing this package is cheap: each backend imports its framework only when it is built.
"""
from __future__ import annotations


def build_learner(model_dir: str, cfg):
    """The learner of `cfg.learner.backend` for the HF model directory `model_dir` (cfg: megarl Config)."""
    temperature = cfg.sampling.temperature or 1.0
    if cfg.learner.backend == "deepspeed":
        from megarl.learner.deepspeed import DeepSpeedLearner

        return DeepSpeedLearner(model_dir, cfg.learner, cfg.algo.loss, temperature=temperature,
                                publish_bucket_mb=cfg.publish.bucket_mb)
    from megarl.learner.megatron import MegatronLearner

    return MegatronLearner(model_dir, cfg.learner, cfg.algo.loss, temperature=temperature)
