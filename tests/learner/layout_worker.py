"""One rank of the cross-layout tests (tests/forked_ranks.py launches them): for each layout, log-probs, one step,
published weights.

argv: model_dir batch.pt out_dir layouts.json (a layout's "routing_replay" key goes to the learner, its "critic"
key to a CriticConfig (advantage.estimator=gae), its "lora" key to a LoraConfig, its "model_dir" and "batch" keys
replace argv's for that layout (several models in one launch), the rest to LearnerConfig; the batch's routes, if
any, are replayed in the log-probs too).  Every rank writes `{layout}.rank{r}.pt` with the
log-probs and metrics it saw, its (tp, pp, dp) ranks, the whole HF-named tensors it publishes
(`publish_tensors`; the weight publisher's source per stage is its TP/DP rank 0, so the test can
rebuild the full model from those), and its TP slices of them (`publish_shards`) with their bytes.
A LoRA layout publishes whole adapters only (no shards), and records its SGLang publish (`merged`: the adapted
weights merged over the base it gathers over TP): it trains two steps on the batch (the first moves only B,
from zero; the second trains A through the TP collectives too), records the second's metrics and the log-probs
after it, and saves a checkpoint `{layout}.ckpt` (megarl.checkpoint.learner_state); so does a layout with
"save": true after its step. An MoE model publishes no shards at learner.tp > 1 (whole tensors only), and every
rank also records `expert_tokens` {(global layer, global expert): tokens its experts computed in the step}.
"""
import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megarl.algo.config import CriticConfig, LossConfig
from megarl.checkpoint import learner_state
from megarl.config.schema import LearnerConfig, LoraConfig
from megarl.distributed.lifetime import exit_process
from megarl.learner.lora_publish import MergedLoraSource
from megarl.learner.megatron import MegatronLearner, publish_bytes
from megarl.models.families import whole_tensors_only

default_model_dir, batch_path, out_dir, layouts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
dist.init_process_group("gloo")
for name, layout in layouts.items():
    layout = dict(layout)
    model_dir = layout.pop("model_dir", default_model_dir)
    batch = torch.load(layout.pop("batch", batch_path), weights_only=False)
    replay = layout.pop("routing_replay", "off")
    critic = layout.pop("critic", None)
    lora = layout.pop("lora", None)
    save = layout.pop("save", False)
    learner = MegatronLearner(model_dir, LearnerConfig(**layout, lora=LoraConfig(**(lora or {}))), LossConfig(),
                              routing_replay=replay, critic_cfg=CriticConfig(**critic) if critic is not None else None)
    expert_tokens = {}
    if lora is None:
        logprobs = learner.logprobs(batch.input_ids, batch.routes)
        hooks = []
        for i, decoder_layer in enumerate(learner.gpt.decoder.layers if learner.is_moe else []):
            if not hasattr(decoder_layer.mlp, "experts"):  # (GLM-4.5's first layers are dense)
                continue
            for j, expert in enumerate(decoder_layer.mlp.experts.local_experts):
                key = (learner.layer_offset + i, learner.expert_offset + j)
                expert_tokens[key] = 0
                hooks.append(expert.register_forward_hook(lambda mod, inp, out, key=key: expert_tokens.__setitem__(
                    key, expert_tokens[key] + inp[0].shape[0])))
        metrics = learner.train_step(batch)
        for hook in hooks:
            hook.remove()
        if save:
            learner_state.save(learner, f"{out_dir}/{name}.ckpt", 1, keep=1, model_dir=model_dir)
    else:
        learner.train_step(batch)
        metrics = learner.train_step(batch)
        logprobs = learner.logprobs(batch.input_ids)
        learner_state.save(learner, f"{out_dir}/{name}.ckpt", 2, keep=1, model_dir=model_dir)
    published = dict(learner.publish_tensors())  # both are collective over TP: every rank iterates
    # (LoRA: whole adapters; MoE at TP > 1 and Phi-3's fused projections: whole tensors)
    whole_only = lora is not None or learner.sequence_parallel or whole_tensors_only(learner.hf_config)
    shards = dict(learner.publish_shards()) if not whole_only else {}
    # LoRA on SGLang: the adapted weights merged, the base gathered over TP (collective; every rank keeps it here)
    merged = dict(MergedLoraSource(learner, learner.lora, keep=True).publish_tensors()) if lora is not None else {}
    torch.save({"logprobs": logprobs, "metrics": metrics, "published": published, "shards": shards, "merged": merged,
                "spec": learner.publish_spec(), "expert_tokens": expert_tokens,
                "shard_spec": learner.publish_spec(shards=True) if not whole_only else [],
                "shard_bytes": publish_bytes({n: tuple(t.shape) for n, t in shards.items()}),
                "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                "dp_rank": parallel_state.get_data_parallel_rank()},
               f"{out_dir}/{name}.rank{dist.get_rank()}.pt")
    parallel_state.destroy_model_parallel()
dist.destroy_process_group()
exit_process(0)  # not a plain exit: see megarl.distributed.lifetime
