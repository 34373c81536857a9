"""One torchrun rank of the context-parallel tests: per layout, log-probs, one step's gradients, a few steps' metrics.

argv: model_dir batches.pt out_dir layouts.json. batches.pt holds a list of TrainBatches; a layout's "loss" key goes
to LossConfig, the rest to LearnerConfig. Every rank writes `{layout}.rank{r}.pt`: the log-probs of the first
batch before any step, the whole (TP-gathered) gradient of every parameter after the first step, the metrics of one
step per batch, its (tp, cp, pp, dp) ranks; a layout with "save": true saves a checkpoint `{layout}.ckpt` after them.
"""
import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megarl.algo.config import LossConfig
from megarl.checkpoint import learner_state
from megarl.config.schema import LearnerConfig
from megarl.distributed.lifetime import exit_process
from megarl.learner.megatron import MegatronLearner

model_dir, batches_path, out_dir, layouts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
batches = torch.load(batches_path, weights_only=False)
dist.init_process_group("gloo")
for name, layout in layouts.items():
    layout = dict(layout)
    loss_cfg = LossConfig(**layout.pop("loss", {}))
    save = layout.pop("save", False)
    learner = MegatronLearner(model_dir, LearnerConfig(**layout), loss_cfg)
    logprobs = learner.logprobs(batches[0].input_ids)
    metrics = [learner.train_step(batches[0])]
    grads = {n: learner._tp_gather(n, p.main_grad) for n, p in learner.gpt.named_parameters()}
    global_grads = {learner._global_name(n): g for n, g in grads.items()}  # (a PP stage's layers, globally named)
    metrics += [learner.train_step(b) for b in batches[1:]]
    if save:
        learner_state.save(learner, f"{out_dir}/{name}.ckpt", len(batches), keep=1, model_dir=model_dir)
    torch.save({"logprobs": logprobs, "grads": grads, "global_grads": global_grads, "metrics": metrics,
                "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "cp_rank": parallel_state.get_context_parallel_rank(),
                "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                "dp_rank": parallel_state.get_data_parallel_rank()},
               f"{out_dir}/{name}.rank{dist.get_rank()}.pt")
    parallel_state.destroy_model_parallel()
dist.destroy_process_group()
exit_process(0)  # not a plain exit: see megarl.distributed.lifetime
