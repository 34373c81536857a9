"""What megarl's learner publishes to SGLang for each model directory given: one rank (tests/forked_ranks.py).

    forked_ranks 1 TIMEOUT megatron publish_worker.py MODEL_DIR [MODEL_DIR ...]

For each MODEL_DIR the megatron learner (TP1) is built on it, and what SGLangPublisher.publish receives from it,
`publish_tensors()` (learner_main hands the publisher the learner itself), is written to MODEL_DIR/publish.safetensors,
with `publish_spec()` (the names, shapes and dtypes in publish order: what SGLangPublisher plans its calls from)
to MODEL_DIR/publish.json. family_loads.py then feeds them to SGLang's model classes.
"""
import json
import sys

import torch.distributed as dist
from safetensors.torch import save_file

from megarl.algo.config import LossConfig
from megarl.config.schema import LearnerConfig
from megarl.distributed.sglang_publish import dtype_name
from megarl.learner.megatron import MegatronLearner

dist.init_process_group("gloo")
for model_dir in sys.argv[1:]:
    learner = MegatronLearner(model_dir, LearnerConfig(), LossConfig())
    spec = learner.publish_spec()
    tensors = dict(learner.publish_tensors())
    assert [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()] == spec, model_dir
    save_file({n: t.contiguous() for n, t in tensors.items()}, f"{model_dir}/publish.safetensors")
    with open(f"{model_dir}/publish.json", "w") as f:
        json.dump([[n, list(s), dtype_name(d)] for n, s, d in spec], f)
    del learner
dist.destroy_process_group()
