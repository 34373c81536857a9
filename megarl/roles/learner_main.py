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
import torch.distributed as dist

from megarl.config.schema import Config
from megarl.distributed.publish import WeightPublisher
from megarl.distributed.queue import QueueReceiver
from megarl.distributed.topology import Topology, init_learner_group, publish_group
from megarl.observe.sinks import MetricsSink, ProgressLine, RolloutSink
from megarl.observe.timeline import Timeline
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


class Intake:
    """Learner rank 0's side of the queue: collects usable groups, assembles batches, and keeps the
    per-sampler count of retired groups that every publish header reports back."""

    def __init__(self, cfg: Config, store, pad_id: int):
        self.cfg, self.pad_id = cfg, pad_id
        self.queue = QueueReceiver(store, cfg.queue.host)
        self.retired: Counter[int] = Counter()  # groups per sampler rank that left (trained or dropped)
        self.dropped_totals: Counter[str] = Counter()
        self.sampler_stats: dict[int, dict[str, float]] = {}  # latest counters per sampler rank

    def next_batch(self, version: int) -> tuple[TrainBatch, dict[str, float]]:
        groups, dropped, wait_s = _collect_groups(self.queue, self.cfg, version, self.retired, self.sampler_stats)
        self.dropped_totals.update(dropped)
        batch, metrics = assemble_batch(groups, self.cfg.algo.advantage, self.pad_id, learner_version=version)
        self.retired.update(g[0].sampler_rank for g in groups)
        metrics.update({f"dropped/{k}": v for k, v in dropped.items()})
        metrics.update({f"dropped/{k}_total": v for k, v in self.dropped_totals.items()})
        metrics["queue_wait_s"] = wait_s
        for rank, stats in sorted(self.sampler_stats.items()):
            metrics.update({f"sampler{rank}/{k}": v for k, v in stats.items()})
        return batch, metrics

    def header(self) -> dict:
        return {"retired": {str(k): v for k, v in self.retired.items()}}


def share_batch(batch: TrainBatch | None) -> TrainBatch:
    """Learner rank 0 hands the batch to every learner rank (each DP rank trains on its share).

    Only the tensors travel: the samples' provenance is for rank 0's logs, and rank 0 keeps its own."""
    if dist.get_world_size() == 1:
        return batch
    box = [None if batch is None else replace(batch, samples=[])]
    dist.broadcast_object_list(box, src=0)  # bounded by the learner group's dist.timeout_s
    return batch if batch is not None else box[0]


def run_learner(cfg: Config, topo: Topology, store, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from megarl.learner.megatron import MegatronLearner

    torch.set_num_threads(cfg.learner.threads)
    init_learner_group(topo, store, cfg.dist.backend, cfg.dist.timeout_s)
    lead = topo.rank == 0  # owns the queue, the publish source and the run outputs
    group = publish_group(topo, store, cfg.dist.backend, cfg.publish.timeout_s)
    learner = MegatronLearner(str(model_dir), cfg.learner, cfg.algo.loss, temperature=cfg.sampling.temperature or 1.0)
    if lead:
        intake = Intake(cfg, store, AutoTokenizer.from_pretrained(model_dir).pad_token_id)
        publisher = WeightPublisher(group, store, cfg.publish.bucket_mb, cfg.publish.timeout_s, cfg.publish.checksum)
        metrics_sink = MetricsSink(cfg.run.dir, cfg.run.tensorboard)
        rollout_sink = RolloutSink(cfg.run.dir) if cfg.run.log_rollouts else None
        progress = ProgressLine(cfg.run.steps, cfg.run.progress)
        timeline = Timeline(cfg.run.dir, f"learner{topo.rank}") if cfg.run.timeline else None
    try:
        last = time.perf_counter()
        for step in range(cfg.run.steps):
            version = learner.version  # differs from `step` once a non-finite step was skipped
            wall = [time.time()]  # span boundaries for the timeline: wait | train | publish
            batch, intake_metrics = intake.next_batch(version) if lead else (None, {})
            batch = share_batch(batch)
            wall.append(time.time())
            for _ in range(cfg.algo.sync_epochs):  # 1 in pipeline mode (validated)
                # Later epochs see the same tokens one more version behind: the lag metrics say so.
                metrics = learner.train_step(replace(batch, learner_version=learner.version))
            wall.append(time.time())
            published = {"bytes": 0, "seconds": 0.0}
            if learner.version != version:  # a skipped (non-finite) step changed nothing to publish
                tensors = learner.publish_tensors()  # collective over TP: every learner rank iterates it
                if lead:
                    published = publisher.publish(learner.version, tensors, extra=intake.header())
                else:
                    for _ in tensors:
                        pass
            wall.append(time.time())
            if not lead:
                continue
            if timeline is not None:
                for kind, start, end in zip(("wait", "train", "publish"), wall, wall[1:]):
                    timeline.span(kind, start, end)
            now = time.perf_counter()
            metrics.update(batch_metrics(batch))
            metrics.update(intake_metrics)
            metrics.update({
                "tokens_per_s": batch.num_tokens / (now - last), "train_s": wall[2] - wall[1],
                "publish_s": published["seconds"], "publish_bytes": published["bytes"], "version": learner.version,
            })
            last = now
            metrics_sink.log(step, metrics)
            if rollout_sink is not None:
                rollout_sink.log(batch.samples, trained_at_step=version)
            progress.update(step + 1, metrics)
    finally:
        if lead:
            store.set(STOP_KEY, "learner stopped")
            metrics_sink.close()
            if rollout_sink is not None:
                rollout_sink.close()
            intake.queue.close()
            if timeline is not None:
                timeline.close()


def _collect_groups(queue: QueueReceiver, cfg: Config, learner_version: int, retired: Counter,
                    sampler_stats: dict[int, dict[str, float]]) -> tuple[list[list[Sample]], Counter, float]:
    """The next `prompts_per_step` usable groups. Stale groups (older than max_lag) and, with
    advantage.filter_zero_variance, groups whose rewards are all equal are dropped, counted by
    reason and retired (so the sampler may start replacements)."""
    start = time.perf_counter()
    groups, dropped = [], Counter({"stale_groups": 0})
    while len(groups) < cfg.algo.prompts_per_step:
        group, stats = queue.recv_group(cfg.queue.timeout_s)
        sampler_stats[group[0].sampler_rank] = stats
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
