"""One torchrun rank of the DeepSpeed learner tests: for each case, the whole learner life cycle.

argv: out_dir batches.pt cases.json.  Each case {name, model_dir, learner: LearnerConfig kwargs (with
`deepspeed` and `lora` as dicts), loss: LossConfig kwargs, critic: CriticConfig kwargs or None}: publish before any
step, log-probs, step 1, checkpoint (megarl's learner_state, DeepSpeed's files), step 2; then a second learner
resumed from the checkpoint redoes step 2; rank 0 exports the checkpoint to an HF directory; last, a non-finite step.
Every rank writes `{name}.rank{r}.pt` with what it saw.
"""
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.algo.config import CriticConfig, LossConfig
from megarl.checkpoint import learner_state
from megarl.checkpoint.export import export_hf
from megarl.config.schema import DeepSpeedConfig, LearnerConfig, LoraConfig
from megarl.distributed.lifetime import exit_process
from megarl.learner.deepspeed import DeepSpeedLearner
from megarl.learner.lora_publish import MergedLoraSource



def snapshot(learner) -> dict[str, torch.Tensor]:
    """The published weights as they are now (publish_tensors' tensors are valid until the next step)."""
    return {name: tensor.clone() for name, tensor in learner.publish_tensors()}


out_dir, batches, cases = Path(sys.argv[1]), torch.load(sys.argv[2], weights_only=False), json.loads(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
for case in cases:
    learner_kwargs = dict(case["learner"], deepspeed=DeepSpeedConfig(**case["learner"].get("deepspeed", {})),
                          lora=LoraConfig(**case["learner"].get("lora", {})))
    cfg, loss_cfg = LearnerConfig(backend="deepspeed", **learner_kwargs), LossConfig(**case["loss"])
    critic_cfg = CriticConfig(**case["critic"]) if case.get("critic") else None

    def build():
        return DeepSpeedLearner(case["model_dir"], cfg, loss_cfg, publish_bucket_mb=case.get("bucket_mb", 16.0),
                                critic_cfg=critic_cfg)

    learner = build()
    record = {"initial": snapshot(learner), "logprobs": learner.logprobs(batches[0].input_ids),
              "spec": learner.publish_spec()}
    frozen = {n: getattr(p, "ds_tensor", p).detach().clone()  # (ZeRO-3: this rank's partition)
              for n, p in learner.module.named_parameters() if not p.requires_grad}
    record["step1"] = learner.train_step(batches[0])
    record["after_step1"] = snapshot(learner)
    if learner.lora is not None:  # the frozen base did not move; the log-probs the export must reproduce
        record["base_moved"] = [n for n, p in learner.module.named_parameters()
                                if n in frozen and not torch.equal(getattr(p, "ds_tensor", p).detach(), frozen[n])]
        record["trainable"] = sorted(n for n, p in learner.module.named_parameters() if p.requires_grad)
        record["logprobs_after_step1"] = learner.logprobs(batches[0].input_ids)
        # What a version is on SGLang: the adapted weights merged, the base gathered from the ZeRO-3 partitions.
        record["merged_after_step1"] = dict(MergedLoraSource(learner, cfg.lora, keep=True).publish_tensors())
    root = out_dir / f"{case['name']}.ckpt"
    learner_state.save(learner, root, step=1, keep=2, model_dir=case["model_dir"])
    if critic_cfg is not None:  # the values the exported critic must give
        with torch.no_grad():
            record["critic_values_step1"] = learner.critic.model(batches[1].input_ids).cpu()
    record["step2"] = learner.train_step(replace(batches[1], learner_version=learner.version))
    record["after_step2"] = snapshot(learner)
    del learner

    resumed = build()
    manifest = learner_state.load(resumed, root)
    record["resumed_version"] = resumed.version
    if critic_cfg is not None:
        record["resumed_critic_steps"] = resumed.critic.steps
    record["resumed_step2"] = resumed.train_step(replace(batches[1], learner_version=resumed.version))
    record["resumed_after_step2"] = snapshot(resumed)
    if rank == 0:
        export_hf(root, out_dir / f"{case['name']}.export")
    dist.barrier()
    nan = replace(batches[1], advantages=torch.full_like(batches[1].advantages, float("nan")),
                  rewards=torch.full_like(batches[1].rewards, float("nan")) if batches[1].rewards is not None else None,
                  learner_version=resumed.version)
    record["nonfinite"] = resumed.train_step(nan)
    record["version_after_nonfinite"] = resumed.version
    record["after_nonfinite"] = snapshot(resumed)
    torch.save(record, out_dir / f"{case['name']}.rank{rank}.pt")
    del resumed
dist.destroy_process_group()
exit_process(0)  # not a plain exit: see megarl.distributed.lifetime
