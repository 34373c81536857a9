"""The learner loop: queue -> staleness filter -> batch -> one optimizer step -> publish -> log.

Pipeline mode: the learner never waits for a generation phase; it takes the next `prompts_per_step`
fresh groups from the queue, drops those older than `max_lag` versions (counted), trains once and
publishes version v+1 to the samplers, which apply it in flight.
Sync mode: the same loop, but the batch is the one the samplers generated under the current
version, and it gets `sync_epochs` optimizer steps before the publish (the recorded behaviour
log-probs of pi_t stay the ratio denominator in every epoch).
"""
from __future__ import annotations

import time
from dataclasses import replace
from collections import Counter
from pathlib import Path

import torch

from megarl.config.schema import Config
from megarl.distributed.publish import WeightPublisher
from megarl.distributed.queue import QueueReceiver
from megarl.distributed.topology import Topology, init_learner_group, publish_group
from megarl.observe.sinks import MetricsSink, ProgressLine, RolloutSink
from megarl.protocols import Sample, TrainBatch
from megarl.rollout.batch import assemble_batch, is_stale, is_zero_variance

STOP_KEY = "stop"


def batch_metrics(batch: TrainBatch) -> dict[str, float]:
    """Reward and token-lag statistics of the batch the step trains on."""
    mask = batch.loss_mask.bool()
    lags = (batch.learner_version - batch.versions)[mask].float()
    rewards = torch.tensor([s.reward for s in batch.samples])
    multi = sum(len(set(s.versions)) > 1 for s in batch.samples)
    return {
        "reward_mean": rewards.mean().item(),
        "lag_mean": lags.mean().item() if lags.numel() else 0.0,
        "lag_max": lags.max().item() if lags.numel() else 0.0,
        "multi_version_frac": multi / len(batch.samples),
        "completion_len_mean": mask.sum(1).float().mean().item(),
        "reward_errors": float(sum(s.reward_error is not None for s in batch.samples)),
    }


def run_learner(cfg: Config, topo: Topology, store, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from megarl.learner.megatron import MegatronLearner

    torch.set_num_threads(cfg.learner.threads)
    init_learner_group(topo, store, cfg.dist.backend, cfg.dist.timeout_s)
    group = publish_group(topo, store, cfg.dist.backend, cfg.publish.timeout_s)
    queue = QueueReceiver(store, cfg.queue.host)
    learner = MegatronLearner(str(model_dir), cfg.learner, cfg.algo.loss, temperature=cfg.sampling.temperature or 1.0)
    publisher = WeightPublisher(group, store, cfg.publish.bucket_mb, cfg.publish.timeout_s, cfg.publish.checksum)
    pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    metrics_sink = MetricsSink(cfg.run.dir, cfg.run.tensorboard)
    rollout_sink = RolloutSink(cfg.run.dir) if cfg.run.log_rollouts else None
    progress = ProgressLine(cfg.run.steps, cfg.run.progress)
    retired: Counter[int] = Counter()  # groups per sampler rank that left the system (trained or dropped)
    dropped_totals: Counter[str] = Counter()
    try:
        last = time.perf_counter()
        for step in range(cfg.run.steps):
            version = learner.version  # differs from `step` once a non-finite step was skipped
            groups, dropped, wait_s = _collect_groups(queue, cfg, version, retired)
            for reason, n in dropped.items():
                dropped_totals[reason] += n
            batch, filter_counts = assemble_batch(groups, cfg.algo.advantage, pad_id, learner_version=version)
            t0 = time.perf_counter()
            for _ in range(cfg.algo.sync_epochs):  # 1 in pipeline mode (validated)
                # Later epochs see the same tokens one more version behind: the lag metrics say so.
                metrics = learner.train_step(replace(batch, learner_version=learner.version))
            t1 = time.perf_counter()
            retired.update(g[0].sampler_rank for g in groups)
            published = {"bytes": 0, "seconds": 0.0}
            if learner.version != version:  # a skipped (non-finite) step changed nothing to publish
                published = publisher.publish(learner.version, learner.publish_tensors(),
                                              extra={"retired": {str(k): v for k, v in retired.items()}})
            now = time.perf_counter()
            metrics.update(batch_metrics(batch))
            metrics.update(filter_counts)
            metrics.update({f"dropped/{k}": v for k, v in dropped.items()})
            metrics.update({f"dropped/{k}_total": v for k, v in dropped_totals.items()})
            metrics.update({
                "tokens_per_s": batch.num_tokens / (now - last), "queue_wait_s": wait_s,
                "train_s": t1 - t0, "publish_s": published["seconds"], "publish_bytes": published["bytes"],
                "version": learner.version,
            })
            last = now
            metrics_sink.log(step, metrics)
            if rollout_sink is not None:
                rollout_sink.log(batch.samples, trained_at_step=version)
            progress.update(step + 1, metrics)
    finally:
        store.set(STOP_KEY, "learner stopped")
        metrics_sink.close()
        if rollout_sink is not None:
            rollout_sink.close()
        queue.close()


def _collect_groups(queue: QueueReceiver, cfg: Config, learner_version: int,
                    retired: Counter) -> tuple[list[list[Sample]], Counter, float]:
    """The next `prompts_per_step` usable groups. Stale groups (older than max_lag) and, with
    advantage.filter_zero_variance, groups whose rewards are all equal are dropped, counted by
    reason and retired (so the sampler may start replacements)."""
    start = time.perf_counter()
    groups, dropped = [], Counter({"stale_groups": 0})
    while len(groups) < cfg.algo.prompts_per_step:
        group = queue.recv_group(cfg.queue.timeout_s)
        reason = None
        if is_stale(group, learner_version, cfg.algo.max_lag):
            reason = "stale_groups"
        elif cfg.algo.advantage.filter_zero_variance and is_zero_variance(group):
            reason = "zero_variance_groups"
        if reason is not None:
            dropped[reason] += 1
            retired[group[0].sampler_rank] += 1
            continue
        groups.append(group)
    return groups, dropped, time.perf_counter() - start
