"""One rank of the context-parallel tests: per layout, log-probs, one step's gradients, a few steps' metrics and the
published weights; `run_layout` is also what the tests' cp = 1 references run in their own process.

argv: model_dir batches.pt out_dir layouts.json. batches.pt holds a list of TrainBatches; a layout's "loss" key goes
to LossConfig, "lora" to LoraConfig, "critic" to CriticConfig (advantage.estimator=gae), "distill" to DistillConfig,
"routing_replay" to the learner, "model_dir" replaces argv's, "steps" sets how many optimizer steps run (over the
batches in turn, again from the first after the last; one per batch without it), the rest to LearnerConfig. Every rank
writes `{layout}.rank{r}.pt`: the log-probs of the first batch before any step, the whole (TP-gathered) gradient of
every trained parameter after the first step, the metrics of every step, what publish_tensors yields after them, its
(tp, cp, pp, dp) ranks; a layout with "save": true saves a checkpoint `{layout}.ckpt` after them and loads it into a
fresh learner of the layout, whose publish_tensors it writes too ("resumed_published").
"""
import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megarl.algo.config import CriticConfig, DistillConfig, LossConfig
from megarl.checkpoint import learner_state
from megarl.config.schema import LearnerConfig, LoraConfig
from megarl.distributed.lifetime import exit_process
from megarl.learner.megatron import MegatronLearner

TEST_KEYS = ("save", "model_dir", "steps")  # a layout's keys that configure the test, not the learner


def learner_of(model_dir: str, layout: dict) -> MegatronLearner:
    """The megatron learner a layout describes (module docstring) on this process's ranks."""
    cfg = {k: v for k, v in layout.items()
           if k not in ("loss", "lora", "critic", "distill", "routing_replay", *TEST_KEYS)}
    critic, distill = layout.get("critic"), layout.get("distill")
    return MegatronLearner(layout.get("model_dir", model_dir),
                           LearnerConfig(**cfg, lora=LoraConfig(**layout.get("lora", {}))),
                           LossConfig(**layout.get("loss", {})), routing_replay=layout.get("routing_replay", "off"),
                           critic_cfg=None if critic is None else CriticConfig(**critic),
                           distill=None if distill is None else DistillConfig(**distill))


def run_layout(model_dir: str, layout: dict, batches: list) -> tuple[MegatronLearner, dict]:
    """(the learner, its results): the log-probs of batches[0] before any step (with its routes), the gradients of the
    trained parameters after the first step (TP-gathered, also under global names), the metrics of every step (one
    per batch, or layout["steps"] over the batches in turn) and the tensors publish_tensors yields after the last."""
    learner = learner_of(model_dir, layout)
    logprobs = learner.logprobs(batches[0].input_ids, batches[0].routes)
    metrics = [learner.train_step(batches[0])]
    grads = {n: learner._tp_gather(n, p.main_grad) for n, p in learner.gpt.named_parameters() if p.requires_grad}
    global_grads = {learner._global_name(n): g for n, g in grads.items()}  # (a PP stage's layers, globally named)
    steps = layout.get("steps", len(batches))
    metrics += [learner.train_step(batches[step % len(batches)]) for step in range(1, steps)]
    published = dict(learner.publish_tensors())
    return learner, {"logprobs": logprobs, "grads": grads, "global_grads": global_grads, "metrics": metrics,
                     "published": published}


if __name__ == "__main__":
    model_dir, batches_path, out_dir, layouts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    batches = torch.load(batches_path, weights_only=False)
    dist.init_process_group("gloo")
    for name, layout in layouts.items():
        learner, result = run_layout(model_dir, layout, batches)
        if layout.get("save"):
            learner_state.save(learner, f"{out_dir}/{name}.ckpt", len(batches), keep=1, model_dir=model_dir)
            resumed = learner_of(model_dir, layout)
            learner_state.load(resumed, f"{out_dir}/{name}.ckpt")
            result["resumed_published"] = dict(resumed.publish_tensors())
        torch.save({**result, "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                    "cp_rank": parallel_state.get_context_parallel_rank(),
                    "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                    "dp_rank": parallel_state.get_data_parallel_rank()},
                   f"{out_dir}/{name}.rank{dist.get_rank()}.pt")
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    exit_process(0)  # not a plain exit: see megarl.distributed.lifetime
