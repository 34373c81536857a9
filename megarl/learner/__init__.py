"""Learner backends (megarl.protocols.Learner): megatron-core (megatron.py, the default) and DeepSpeed
ZeRO (deepspeed.py), chosen by `learner.backend`; step.py is the part of a step they share.

Importing this package is cheap: each backend imports its framework only when it is built.
"""
from __future__ import annotations

from dataclasses import replace


def build_learner(model_dir: str, cfg, loss_cfg=None, temperature: float | None = None):
    """The learner of `cfg.learner.backend` for the HF model directory `model_dir` (cfg: megarl Config).

    `loss_cfg` / `temperature` default to the RL run's (cfg.algo.loss, cfg.sampling.temperature);
    megarl sft passes megarl.algo.config.NLLConfig() and 1.0. An RL run with algo.distill.teacher gets its
    teacher checked (again: a raw torchrun launch skipped `megarl train`'s check) and loaded by the learner."""
    if loss_cfg is None:  # an RL run: the lr schedule's decay, unless set, spans its optimizer steps
        cfg = replace(cfg, learner=with_decay_steps(cfg.learner, cfg.run.steps * cfg.algo.sync_epochs))
    distill = _distill(model_dir, cfg) if loss_cfg is None and cfg.algo.distill.teacher else None
    critic_cfg = cfg.algo.critic if loss_cfg is None and cfg.algo.advantage.estimator == "gae" else None
    loss_cfg = cfg.algo.loss if loss_cfg is None else loss_cfg
    temperature = (cfg.sampling.temperature or 1.0) if temperature is None else temperature
    if cfg.learner.backend == "deepspeed":
        from megarl.learner.deepspeed import DeepSpeedLearner

        return DeepSpeedLearner(model_dir, cfg.learner, loss_cfg, temperature=temperature,
                                publish_bucket_mb=cfg.publish.bucket_mb, routing_replay=cfg.algo.routing_replay,
                                distill=distill, critic_cfg=critic_cfg)
    from megarl.learner.megatron import MegatronLearner

    return MegatronLearner(model_dir, cfg.learner, loss_cfg, temperature=temperature,
                           routing_replay=cfg.algo.routing_replay, distill=distill,
                           critic_cfg=critic_cfg)


def with_decay_steps(learner_cfg, total_steps: int):
    """learner_cfg with lr_decay_steps=0 resolved to the run's `total_steps` optimizer steps (megarl.learner.
    lr_schedule); a decay that would end before its warm-up does is refused, naming both keys."""
    lc = learner_cfg if learner_cfg.lr_decay_steps else replace(learner_cfg, lr_decay_steps=total_steps)
    if lc.lr_decay != "constant" and lc.lr_decay_steps <= lc.lr_warmup_steps:
        steps = f"{lc.lr_decay_steps}" if learner_cfg.lr_decay_steps else f"0: the run's {total_steps} optimizer steps"
        raise ValueError(f"learner.lr_decay={lc.lr_decay} needs learner.lr_decay_steps ({steps}) > "
                         f"learner.lr_warmup_steps ({lc.lr_warmup_steps}): the decay starts where the warm-up ends")
    return lc


def import_backend(backend: str) -> None:
    """Import learner.backend's framework ahead of building it: a rank started behind the launch gate does this
    while `megarl train` still checks the run (megarl.distributed.launch_gate). Building imports what it needs
    either way; this only moves the seconds."""
    import torch._dynamo  # noqa: F401 - torch.optim's optimizers import it at construction (~0.4 s)

    if backend == "deepspeed":
        import deepspeed  # noqa: F401
        from transformers import AutoModelForCausalLM  # noqa: F401
    else:
        from megarl.learner.megatron import import_framework

        import_framework()


def _distill(model_dir: str, cfg):
    """cfg.algo.distill with its teacher resolved to a checked HF directory (an embedded one built if needed)."""
    from dataclasses import replace

    from megarl.learner.teacher import check_teacher
    from megarl.embedded.registry import resolve_model_path

    teacher_dir = resolve_model_path(cfg.algo.distill.teacher, cfg.model.cache_dir)
    check_teacher(teacher_dir, model_dir, cfg.sampler.max_seq_len)
    return replace(cfg.algo.distill, teacher=str(teacher_dir))
