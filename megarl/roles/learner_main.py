"""The learner loop: queue -> staleness filter -> batch -> one optimizer step -> publish -> log.

Pipeline mode: the learner never waits for a generation phase; it takes the next `prompts_per_step`
fresh groups from the queue, drops those older than `max_lag` versions (counted), trains once and
publishes version v+1 to the samplers, which apply it in flight.
Sync mode: the same loop, but the batch is the one the samplers generated under the current
version, and it gets `sync_epochs` optimizer steps before the publish (the recorded behaviour
log-probs of pi_t stay the ratio denominator in every epoch).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megarl.checkpoint import learner_state
from megarl.checkpoint.resume import Schedule, learner_resume_point, roll_back_outputs
from megarl.config.length_limit import LengthLimit
from megarl.config.schema import Config
from megarl.distributed.heartbeat import HeartbeatMonitor, SamplerHungError
from megarl.distributed.lifetime import StopRequested, exit_status, raise_if_stopped
from megarl.distributed.membership import MEMBERSHIP_ATTEMPTS, SamplerSet, SyncShares, replace_key
from megarl.distributed.publish import WeightPublisher
from megarl.distributed.queue import QueueReceiver, max_message_bytes
from megarl.distributed.ranks import Topology
from megarl.distributed.run_contact import remove_contact, write_contact
from megarl.distributed.topology import STORE_PREFIX, epoch_publish_group, init_learner_group, publish_groups, \
    publish_stage_store
from megarl.eval.learner_side import EvalCollector
from megarl.eval.sets import due_versions
from megarl.learner.nonfinite import NonfiniteSteps
from megarl.models import moe
from megarl.models.layout import check_layout
from megarl.observe import startup
from megarl.observe.console import Console
from megarl.observe.jsonl import read_jsonl
from megarl.observe.sinks import MetricsSink, RolloutSink, eval_records
from megarl.observe.sources import SourceNames, source_rewards
from megarl.observe.timeline import Timeline
from megarl.observe.trackers import open_trackers
from megarl.protocols import RouteShape, Sample, TrainBatch
from megarl.rollout.batch import assemble_batch, is_stale, is_zero_variance
from megarl.rollout.position import DataPosition
from megarl.rollout.rewards import RewardErrorWindow
from megarl.secret import run_secret

STOP_KEY = "stop"
DEAD_CHECK_S = 0.5  # how often the lead reads the samplers' death records while it waits for groups (replace)
# After a failed publish or epoch, a member whose heartbeat stood still for min(fault.sampler_timeout_s,
# max(GONE_S, publish.timeout_s)) is taken as gone. Not a few seconds: on a loaded machine a live sampler's loop can
# stand still that long, and dropping it has its keeper kill it (a replacement replaced in its first publish).
GONE_S = 3.0


def gone_after_s(cfg: Config) -> float:
    """How long a member's heartbeat must stand still for a failed publish to drop it as hung (see GONE_S)."""
    return min(cfg.fault.sampler_timeout_s, max(GONE_S, cfg.publish.timeout_s))


def memberless_wait_s(cfg: Config) -> float:
    """fault.on_failure=replace: how long the learner waits for groups while no sampler is a member (every one died
    and their replacements start): a replacement's start-up (its engine's start-up bound) on top of queue.timeout_s."""
    startup = {"sglang": cfg.sampler.sglang.startup_timeout_s,
               "vllm": cfg.sampler.vllm.startup_timeout_s}.get(cfg.sampler.engine, cfg.dist.timeout_s)
    return startup + cfg.queue.timeout_s


class JoinersWaiting(Exception):
    """fault.on_failure=replace: no sampler is a member and replacements are ready. No group can come before they
    receive the weights, which the learner publishes only after a step: in place of the step's batch, every learner
    rank publishes the current version again (the lead to the newcomers' epoch), then the step's wait starts over."""


def retired_key(sampler_rank: int) -> str:
    """Where the lead posts a sampler's retired-group count between publishes: as soon as it drops one of its
    groups, and after a skipped (non-finite) step, which publishes nothing."""
    return f"retired/{sampler_rank}"


def batch_metrics(batch: TrainBatch) -> dict[str, float]:
    """Reward and token-lag statistics of the batch the step trains on."""
    mask = batch.loss_mask.bool()
    lags = (batch.learner_version - batch.versions)[mask].float()
    rewards = torch.tensor([s.reward for s in batch.samples])
    multi = sum(len(s.policy_versions) > 1 for s in batch.samples)
    errors = sum(s.reward_error is not None for s in batch.samples)
    return {
        "reward_mean": rewards.mean().item(),
        "lag_mean": lags.mean().item() if lags.numel() else 0.0,
        "lag_max": lags.max().item() if lags.numel() else 0.0,
        "multi_version_frac": multi / len(batch.samples),
        "turns_mean": sum(s.turns for s in batch.samples) / len(batch.samples),
        "completion_len_mean": mask.sum(1).float().mean().item(),
        "reward_errors": float(errors),  # samples of the batch whose reward failed (scored 0.0)
        "reward_error_frac": errors / len(batch.samples),
    }


def sampler_heartbeats(cfg: Config, store, topo: Topology) -> HeartbeatMonitor:
    """Watches every engine's lead (a stuck TP follower stalls its lead's collectives, so the lead goes quiet)."""
    return HeartbeatMonitor(store, topo.engine_leads, cfg.fault.sampler_timeout_s)


# What fills a batch row past its end: any valid token id. Those positions are never trained and causal attention
# keeps them out of every real position's output, so the learner needs no tokenizer for it (loading one costs its
# start-up the transformers import, ~0.6 s) and a tokenizer without a pad token (Llama's) works as well.
BATCH_PAD_ID = 0


class Intake:
    """Learner rank 0's side of the queue: collects usable groups, assembles batches, and keeps the
    per-sampler count of retired groups that every publish header reports back."""

    def __init__(self, cfg: Config, store, topo: Topology, route_shape: RouteShape | None = None,
                 vocab_size: int | None = None):
        self.cfg, self.num_learners, self.store = cfg, topo.num_learners, store
        self.route_shape = route_shape  # MoE models: the routes every sample carries
        route_bytes = 0 if route_shape is None else route_shape.layers * route_shape.top_k * route_shape.dtype.itemsize
        self.queue = QueueReceiver(store, cfg.queue.host, run_secret(),
                                   max_message_bytes(cfg.queue.max_message_mb, cfg.algo.group_size,
                                                     cfg.sampler.max_seq_len, route_bytes), vocab_size)
        self.heartbeats = sampler_heartbeats(cfg, store, topo)
        self.retired: Counter[int] = Counter()  # groups per sampler rank that left (trained or dropped)
        self.position = DataPosition()  # which group indices left, per sampler stream (checkpointed)
        self.dropped_totals: Counter[str] = Counter()
        self.sampler_stats: dict[int, dict[str, float]] = {}  # latest counters per sampler rank
        self.reward_errors = RewardErrorWindow(cfg.algo.prompts_per_step * cfg.algo.group_size,
                                               cfg.task.max_reward_error_frac)
        # fault.on_failure=replace: the live sampler incarnations (megarl.distributed.membership)
        self.members = SamplerSet(store, topo.engine_leads, topo.num_learners) \
            if cfg.fault.on_failure == "replace" else None
        # algo.mode=sync: a member lost mid-batch has its share generated by the others (docs/faults.md)
        self.shares = SyncShares(store, cfg.algo.prompts_per_step,
                                 cfg.algo.prompts_per_step // cfg.sampler.num_engines) \
            if self.members is not None and cfg.algo.mode == "sync" else None
        self.next_dead_check = 0.0
        self.memberless_since: float | None = None  # when the last member was dropped (None: some sampler is one)
        self.failed_publishes = 0  # in a row (publish_to_members)

    def next_batch(self, version: int) -> tuple[TrainBatch, dict[str, float]]:
        if self.shares is not None:
            self.shares.start(version, self.members.members)
        groups, dropped, wait_s = _collect_groups(self.queue, self.cfg, version, self.drop, self.sampler_stats,
                                                  on_wait=self._on_wait,
                                                  accept=None if self.members is None else self._accepts,
                                                  wait_more=None if self.members is None else self._wait_more)
        if self.shares is not None:
            self.shares.done()
        self.dropped_totals.update(dropped)
        batch, metrics = assemble_batch(groups, self.cfg.algo.advantage, BATCH_PAD_ID, learner_version=version,
                                        route_shape=self.route_shape,
                                        routes_required=self.cfg.algo.routing_replay == "r3",
                                        length_limit=LengthLimit.of(self.cfg))
        for group in groups:
            self.retire(group)
        metrics.update({f"dropped/{k}": v for k, v in dropped.items()})
        metrics.update({f"dropped/{k}_total": v for k, v in self.dropped_totals.items()})
        metrics["queue_wait_s"] = wait_s
        metrics.update(self.queue.counters())
        for rank, stats in sorted(self.sampler_stats.items()):
            metrics.update({f"sampler{rank}/{k}": v for k, v in stats.items()})
        if self.members is not None:
            metrics.update(self.members.metrics())
        return batch, metrics

    def _accepts(self, group: list[Sample], stats: dict[str, float]) -> bool:
        """fault.on_failure=replace: a group is taken only from its sender's member incarnation (SamplerSet.accepts)."""
        rank = group[0].sampler_rank
        if not self.members.accepts(rank, stats):
            return False
        if self.shares is not None:
            self.shares.delivered(rank)
        return True

    def _on_wait(self) -> None:
        """While groups are awaited (and between them): a hung sampler, or a stop signal, ends the wait; under
        fault.on_failure=replace a hung or dead sampler is dropped instead, and the wait goes on."""
        raise_if_stopped(self.store)
        if self.members is None:
            self.heartbeats.check(self.num_learners)
            return
        try:
            self.heartbeats.check(self.num_learners)
        except SamplerHungError as exc:
            self.drop_sampler(exc.rank, f"hung: no heartbeat for {self.cfg.fault.sampler_timeout_s:g}s "
                                        f"(fault.sampler_timeout_s)", hung=True)
        if time.monotonic() >= self.next_dead_check:
            self.next_dead_check = time.monotonic() + DEAD_CHECK_S
            for rank, cause in self.members.dead():
                self.drop_sampler(rank, cause)
            self.take_removals()
            if not self.members.members and self.members.joins():
                raise JoinersWaiting()  # (groups collected for this batch came from dropped samplers: never retired)

    def _wait_more(self) -> bool:
        """queue.timeout_s ran out: wait on while no sampler is a member (their replacements start; the first one
        ready ends the wait with JoinersWaiting), for at most memberless_wait_s since the last one was dropped.
        While any sampler is a member, queue.timeout_s stands."""
        return self.memberless_since is not None and \
            time.monotonic() - self.memberless_since < memberless_wait_s(self.cfg)

    def drop_sampler(self, rank: int, cause: str, hung: bool = False) -> None:
        """fault.on_failure=replace: `rank` leaves the publish set (a hung one's keeper is asked to kill it)."""
        if hung and rank in self.members.members:
            self.store.set(replace_key(rank), json.dumps({"incarnation": self.members.members[rank],
                                                          "cause": cause.split(": ", 1)[1][:300]}))
        self.members.drop(rank, cause, self.retired[rank])
        self.heartbeats.forget(rank)
        if self.shares is not None:
            self.shares.lost(rank)
        if not self.members.members and self.memberless_since is None:
            self.memberless_since = time.monotonic()

    def take_removals(self) -> None:
        """fault.on_failure=replace: drain the samplers `megarl samplers remove` asked for (SamplerSet.remove); the
        next publish goes over a new epoch without them."""
        for rank, request in self.members.removals():
            if "incarnation" in self.members.remove(rank, request, self.retired[rank]):
                self.heartbeats.forget(rank)
                if self.shares is not None:
                    self.shares.lost(rank)

    def plan_epoch(self, publisher, version: int) -> dict:
        """The lead's half of refresh_members: drop the dead, take in removals, admit the replacements that are
        ready and, when that changed the set, record the next membership epoch (its first publish is
        `publisher`'s next index: every publish part's source publishes every time, so their indices agree).
        What every learner rank then does: {"epoch": the new epoch or None (unchanged), "size": its group's size,
        "members": whether any sampler is one}."""
        for rank, cause in self.members.dead():
            self.drop_sampler(rank, cause)
        self.take_removals()
        for rank, incarnation in self.members.joins():
            self.members.admit(rank, incarnation)
            self.heartbeats.watch(rank)
            self.memberless_since = None
            self.members.note(self.members.join_line(rank, incarnation, version))
        if not self.members.changed:
            return {"epoch": None, "size": 1 + self.members.alive, "members": publisher.group is not None}
        # A newcomer (no whole publish reached it yet) re-issues the group indices of its rank the learner has not
        # retired (none is retired from now on by its predecessor: the intake refuses that one's late groups).
        # A member a publish reached gets none: it goes on from what it has in flight.
        positions = {rank: self.position.stream(rank - self.num_learners).to_dict()
                     for rank in self.members.newcomers()}
        epoch = self.members.start_epoch(publisher.published + 1, positions)
        return {"epoch": epoch, "size": 1 + self.members.alive, "members": bool(self.members.members)}

    def epoch_failed(self, epoch: int, errors: list[str]) -> None:
        """An epoch's group did not form at some publish source (a member died or hung meanwhile): drop the members
        that are gone; the next attempt records a later epoch."""
        self.members.note(f"megarl: publish epoch {epoch} could not form ({'; '.join(errors)}); trying again")
        self._find_gone()
        self.members.changed = True

    def publish_failed(self, exc) -> list[int]:
        """A publish under fault.on_failure=replace failed (`exc`: its error, or the sources' errors joined): drop the
        members that are gone (their keeper's record, or a heartbeat standing still for gone_after_s); the version is
        not delivered and the next publish goes to a new epoch, whole. The ranks dropped."""
        gone = self._find_gone()
        self.members.note(f"megarl: weight publish failed ({str(exc)[:300]}); "
                          + (f"the next one goes without {', '.join(self.members.name(r) for r in gone)}" if gone else
                             "no sampler is gone: this version goes again to the same samplers over a new epoch"))
        self.members.changed = True
        return gone

    def after_publish(self, errors: list[str], again_at_once: bool) -> str:
        """The lead's decision after a publish under fault.on_failure=replace, `errors` being the publish sources'
        (none: delivered): "delivered", "again" (this version, now, over a new epoch), "next step" (the next
        step's publish goes over a new epoch), or the message the run stops with (publish_to_members says when)."""
        if not errors:
            self.failed_publishes = 0
            self.members.delivered()
            return "delivered"
        error = "; ".join(errors)
        gone = self.publish_failed(error)
        self.failed_publishes = 0 if gone else self.failed_publishes + 1
        if self.failed_publishes >= MEMBERSHIP_ATTEMPTS:
            return (f"weight publish failed {MEMBERSHIP_ATTEMPTS} times in a row over new membership epochs "
                    f"(fault.on_failure=replace) with no sampler gone: {error}")
        self.announce_retired()
        if not gone or again_at_once or len(self.members.newcomers()) == self.members.alive:
            return "again"  # every round drops a member or counts a failure
        return "next step"

    def _find_gone(self) -> list[int]:
        """Drop the members a keeper recorded dead or whose heartbeat stood still for gone_after_s, watched for up to
        that long (a member that died has its keeper's record within a moment; one stopped has stood still that
        long by then); the ranks dropped (none: every member is alive, the failure was a slow one)."""
        silent_s = gone_after_s(self.cfg)
        deadline = time.monotonic() + silent_s
        while True:
            gone = self.members.dead()
            now = self.heartbeats.observe()
            gone += [(rank, f"hung: no heartbeat for {now - t:.0f}s") for rank, t in self.heartbeats.last_change.items()
                     if now - t >= silent_s and rank in self.members.members and rank not in dict(gone)]
            for rank, cause in gone:
                self.drop_sampler(rank, cause, hung=cause.startswith("hung"))
            if gone or time.monotonic() > deadline:
                return [rank for rank, _ in gone]
            time.sleep(0.2)

    def header(self) -> dict:
        return {"retired": {str(k): v for k, v in self.retired.items()}}

    def retire(self, group: list[Sample]) -> None:
        """The group left (trained or dropped): its sampler may start another; the position records it, and
        its failed rewards count towards task.max_reward_error_frac (which stops the run when exceeded)."""
        self.retired[group[0].sampler_rank] += 1
        self.position.retire(group[0].group_id)
        self.reward_errors.add(group)

    def drop(self, group: list[Sample]) -> None:
        """A group dropped (stale, zero variance) is retired and its sampler told at once, not with the next
        publish: the learner is waiting for usable groups, and a sampler whose whole staleness budget was
        dropped would otherwise wait for a publish that needs its groups (a deadlock)."""
        self.retire(group)
        rank = group[0].sampler_rank
        self.store.set(retired_key(rank), str(self.retired[rank]))

    def announce_retired(self) -> None:
        """Every sampler's retired count, posted outside a publish: a skipped (non-finite) step trained its
        groups but publishes no version, and samplers whose staleness budget those groups held would wait for
        a publish that never comes -- the run would stall until queue.timeout_s instead of stopping at
        learner.max_nonfinite_in_row, naming the cause."""
        for rank, retired in self.retired.items():
            self.store.set(retired_key(rank), str(retired))

    def resume(self, position: dict) -> None:
        """Continue from a checkpoint's data position (the samplers re-issue what it had not retired)."""
        self.position = DataPosition.from_dict(position)
        for stream, retired in self.position.streams.items():
            self.retired[self.num_learners + stream] = len(retired)


def resume_line(path, step: int, version: int, restarts: float, redone: int) -> str:
    """The console line of a resumed run: the restart and the logged steps redone only where there are any."""
    line = f"megarl: resumed from {path} (step {step}, version {version})"
    parts = ([f"restart {restarts:.0f}"] if restarts else []) + \
        ([f"redoing {redone} logged step{'s' if redone != 1 else ''}"] if redone else [])
    return line + ("; " + ", ".join(parts) if parts else "")


def publish_weights(learner, publisher, extra: dict, heartbeats: HeartbeatMonitor | None = None,
                    num_learners: int = 0, shards: bool = False) -> dict:
    """Every learner rank iterates publish_tensors() (whole tensors, gathered over TP) or, shard to
    shard, publish_shards() (its own TP slices; only the embedding is gathered); both are collective
    over TP. Each publish part's source broadcasts them as they come (publish_spec() tells it what will
    come), so no rank holds a second copy of the model.

    A broadcast that times out is usually a sampler that stopped receiving: the source says which
    samplers' heartbeats went quiet (it observes them before every publish, so it knows for how long).
    `learner` is the learner, or what stands in for it here (lora_publish.MergedLoraSource)."""
    tensors = learner.publish_shards() if shards else learner.publish_tensors()
    if publisher is not None:
        if heartbeats is not None:
            heartbeats.observe()
        try:
            return publisher.publish(learner.version, tensors, extra=extra, spec=learner.publish_spec(shards))
        except TimeoutError as exc:
            if heartbeats is None:
                raise
            raise TimeoutError(f"{exc}; {heartbeats.silent(num_learners)}") from exc
    for _ in tensors:
        pass
    return {"bytes": 0, "seconds": 0.0}


def refresh_members(intake: Intake | None, publisher, make_group: Callable[[int, int], object], version: int) -> bool:
    """Before a publish under fault.on_failure=replace, on every learner rank: the lead (`intake`; None elsewhere)
    drops the dead, admits the replacements that are ready and, when that changed the set, records a membership
    epoch; every publish source (`publisher`; None on the other ranks) then builds its part's group of that epoch
    (`make_group(epoch, size)`; its first publish is whole). Only the lead forms epochs: the other sources (a
    pipelined learner's later stages, publish.senders > 1) learn each one from it over the learner group, and an
    epoch stands only where every source's group formed. False when no sampler is a member: nothing to publish to."""
    for _ in range(MEMBERSHIP_ATTEMPTS):
        plan = from_lead(intake.plan_epoch(publisher, version) if intake is not None else None)
        if plan["epoch"] is None:
            return plan["members"]
        error = None
        if publisher is not None:
            publisher.group, publisher.last_sent = None, []  # the old group is left; the epoch's first publish is whole
            if plan["members"]:
                try:
                    publisher.group = make_group(plan["epoch"], plan["size"])
                except (RuntimeError, TimeoutError) as exc:  # a member died or hung while the group formed
                    error = str(exc)
        if not plan["members"]:
            return False
        errors = [e for e in from_every_rank(error) if e is not None]
        if not errors:
            return True
        if intake is not None:
            intake.epoch_failed(plan["epoch"], errors)
    raise RuntimeError(f"weight publish: no membership epoch could form in {MEMBERSHIP_ATTEMPTS} attempts "
                       f"(fault.on_failure=replace); the samplers' errors say why")


def publish_to_members(learner, publisher, intake: Intake | None, make_group, heartbeats: HeartbeatMonitor | None,
                       num_learners: int, again_at_once: bool = False, shards: bool = False) -> dict:
    """fault.on_failure=replace, on every learner rank (`intake`: the lead's, None elsewhere; `publisher`: a publish
    source's, None elsewhere): publish to the live samplers of the current membership epoch (a new one when the set
    changed: refresh_members). A publish failed when any source's did; the lead then drops the members that are gone
    and posts every sampler's retired count (the survivors' staleness budget must not wait on the next publish); the
    next publish goes over a new epoch, whole. That publish is this version, sent now, when no sampler is gone (a
    member too slow for publish.timeout_s: every sampler is there to take it now; left to the next step's publish,
    the samplers that missed it generate on the older version only while their staleness budget lasts, and the run
    could stall until queue.timeout_s), with `again_at_once` (SGLang, whose servers stay paused when their receive
    failed; several publish parts, of which a survivor may hold some and not the others), or when no member is left
    that a publish reached (newcomers send nothing before a version reaches them); otherwise it is the next step's.
    The members that got this version (or part) already take it again, as the broadcast requires, and discard it
    (publish.WeightReceiver._receive_again; an SGLang server loads it again under the same label).
    MEMBERSHIP_ATTEMPTS failed publishes in a row with no sampler gone stop the run, naming the last one. `shards`:
    each source publishes its own TP slices (publish_weights)."""
    while True:
        if not refresh_members(intake, publisher, make_group, learner.version):
            return publish_weights(learner, None, {}, None, num_learners, shards)  # no sampler to publish to
        error, published = None, {"bytes": 0, "seconds": 0.0}
        try:
            published = publish_weights(learner, publisher, intake.header() if intake is not None else {}, heartbeats,
                                        num_learners, shards)
        except TimeoutError as exc:
            error = exc
        errors = [e for e in from_every_rank(None if error is None else str(error)) if e is not None]
        then = from_lead(intake.after_publish(errors, again_at_once) if intake is not None else None)
        if then == "delivered":
            return published
        if then == "next step":
            return {"bytes": 0, "seconds": 0.0}
        if then != "again":
            raise TimeoutError(then) from error


def save_checkpoint(learner, cfg: Config, step: int, model_dir: Path, intake: Intake | None,
                    note: Callable[[str], None] = print) -> None:
    """Collective over the learner ranks; the lead's intake contributes the data position and `note`s it."""
    start = time.perf_counter()
    run_state = {"data_position": intake.position.to_dict()} if intake is not None else None
    path = learner_state.save(learner, cfg.checkpoint.dir, step, cfg.checkpoint.keep, model_dir, run_state)
    if intake is not None:
        note(f"megarl: checkpoint {path} ({time.perf_counter() - start:.1f}s)")


def _lone() -> bool:
    """No other learner rank to share with (a lone learner, or the membership tests, which start no group)."""
    return not dist.is_initialized() or dist.get_world_size() == 1


def from_lead(value):
    """Learner rank 0's `value`, on every learner rank (the others pass None)."""
    if _lone():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)  # bounded by the learner group's dist.timeout_s
    return box[0]


def from_every_rank(value) -> list:
    """Every learner rank's `value`, in rank order, on every learner rank."""
    if _lone():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)  # bounded by the learner group's dist.timeout_s
    return values


def share_batch(batch: TrainBatch | None) -> TrainBatch:
    """Learner rank 0 hands the batch to every learner rank (each DP rank trains on its share).

    Only the tensors travel: the samples' provenance is for rank 0's logs, and rank 0 keeps its own. In
    place of a batch the lead may send StopRequested: every learner rank then stops at this step."""
    if _lone():
        return batch
    shared = from_lead(replace(batch, samples=[]) if isinstance(batch, TrainBatch) else batch)
    return batch if batch is not None else shared


def train_on(learner, batch: TrainBatch, cfg: Config, step: int, nonfinite: NonfiniteSteps) -> dict:
    """The optimizer steps of one batch (`sync_epochs`, 1 in pipeline mode): the last step's metrics. Raises
    when non-finite (skipped) steps stop the run (megarl.learner.nonfinite), or when the step trained nothing
    (check_trained)."""
    before, applied = learner.version, 0
    for epoch in range(cfg.algo.sync_epochs):
        # Later epochs see the same tokens one more version behind: the lag metrics say so.
        metrics = learner.train_step(replace(batch, learner_version=learner.version))
        # a critic warm-up step (critic/warmup) trains the critic only: the policy, and so the version, stay
        applied += not metrics["skipped_nonfinite"] and not metrics.get("critic/warmup")
        nonfinite.count(metrics, step, last=step == cfg.run.steps - 1 and epoch == cfg.algo.sync_epochs - 1)
    check_trained(step, batch, before, learner.version, applied)
    return metrics


def check_trained(step: int, batch, version_before: int, version_after: int, applied: int) -> None:
    """The invariant of the step counter: a step is one batch's optimizer steps, each applied one (not skipped as
    non-finite, not a critic warm-up step) moving the version by exactly one. Anything else (a batch that is none or empty, a version moved
    without an update or an update without a version) is a bug in the loop that would log steps that trained
    nothing: the run stops, loudly."""
    rows = batch.input_ids.shape[0] if isinstance(batch, TrainBatch) else 0
    if rows == 0 or version_after - version_before != applied:
        raise RuntimeError(f"megarl: step {step} broke the step invariant (one step = one batch's optimizer steps): "
                           f"batch {type(batch).__name__} of {rows} rows, version {version_before} -> "
                           f"{version_after} after {applied} applied optimizer step(s); this is a bug, please "
                           f"report it with the run's console output")


class RunOutputs:
    """The lead's record of the run: metrics.jsonl + TensorBoard, rollouts.jsonl, the console (progress
    line, notes, closing summary) and the timeline spans; one `record` per step."""

    def __init__(self, cfg: Config, rank: int, recovery: dict[str, float]):
        self.metrics = MetricsSink(cfg.run.dir, open_trackers(cfg))
        self.rollouts = RolloutSink(cfg.run.dir) if cfg.run.log_rollouts else None
        self.console = Console(cfg.run.steps, cfg.run.progress, cfg.run.dir)
        self.timeline = Timeline(cfg.run.dir, f"learner{rank}") if cfg.run.timeline else None
        self.recovery = recovery  # restarts / redone_steps, when this run resumed after a failure
        self.source_names = SourceNames()
        if self.timeline is not None:  # what this process did before its first step
            self.timeline.startup(startup.spans())
        self.last = time.perf_counter()
        self.logged: int | None = None  # the last step recorded

    def record(self, step: int, batch: TrainBatch, metrics: dict, wall: list[float], published: dict,
               version: int) -> None:
        """`wall`: the step's span boundaries (wait | train | publish); `version`: the one it trained from."""
        if self.timeline is not None:
            for kind, start, end in zip(("wait", "train", "publish"), wall, wall[1:]):
                self.timeline.span(kind, start, end)
        now = time.perf_counter()
        metrics = {**metrics, **batch_metrics(batch), **source_rewards(batch.samples, self.source_names),
                   **self.recovery,
                   "tokens_per_s": batch.num_tokens / (now - self.last), "step_s": now - self.last,
                   "train_s": wall[2] - wall[1],
                   "publish_s": published["seconds"], "publish_bytes": published["bytes"], "time": time.time()}
        if published.get("full_bytes"):  # what a full publish of the same part would have sent
            metrics["publish_bytes_frac"] = published["bytes"] / published["full_bytes"]
        if self.logged is not None and step != self.logged + 1:  # the step invariant (check_trained), as logged
            raise RuntimeError(f"megarl: step {step} logged after step {self.logged}: the step counter skipped or "
                               f"repeated a step; this is a bug, please report it with the run's console output")
        self.logged = step
        self.last = now
        self.metrics.log(step, metrics)
        if self.rollouts is not None:
            self.rollouts.log(batch.samples, trained_at_step=version)
        self.console.update(step + 1, metrics, [len(s.policy_versions) for s in batch.samples])

    def record_eval(self, version: int, steps_trained: int, metrics: dict) -> None:
        """One evaluation of policy `version` (published after `steps_trained` steps): a metrics.jsonl record
        with kind "eval" (train records have no kind), TensorBoard at that step, and its console line."""
        self.metrics.log(steps_trained, {"kind": "eval", "eval_version": version, "time": time.time(), **metrics})
        self.console.evaluated(version, steps_trained, metrics)

    def close(self) -> None:
        self.metrics.close()
        if self.rollouts is not None:
            self.rollouts.close()
        if self.timeline is not None:
            self.timeline.close()
        self.console.close()  # the summary, once every step ran


def run_learner(cfg: Config, topo: Topology, store, model_dir: Path) -> None:
    from megarl.learner import build_learner

    torch.set_num_threads(cfg.learner.threads)
    # A raw torchrun launch skipped `megarl train`'s check: refuse the layout naming its key, before megatron asserts.
    check_layout(json.loads((Path(model_dir) / "config.json").read_text()), cfg.learner.tp, cfg.learner.pp,
                 cfg.sampler.tp, cfg.learner.ep, cfg.algo.routing_replay, cfg.learner.cp)
    if cfg.sampler.engine == "sglang":  # before any NCCL communicator: NCCL reads these once
        from megarl.distributed.sglang_publish import set_publish_nccl_env
        set_publish_nccl_env()
    init_learner_group(topo, store, cfg.dist.backend, cfg.dist.timeout_s)
    startup.mark("learner group")
    lead = topo.rank == 0  # owns the queue, the publish source and the run outputs
    resume_from = learner_resume_point(cfg, store, lead)  # the lead also tells the samplers
    sglang = cfg.sampler.engine == "sglang"  # then weights go to the samplers' servers, not to sampler ranks
    # One broadcast group per pipeline stage (per stage and TP rank shard to shard, per stage and sender
    # with publish.senders > 1); this rank is in the group it is the source of, if any.
    # Created under dist.timeout_s (every rank reaches this at its own pace in start-up); each broadcast on them is
    # bounded by publish.timeout_s itself (megarl.distributed.publish).
    groups = {} if sglang else publish_groups(topo, store, cfg.dist.backend, cfg.dist.timeout_s)
    shards = topo.shard_to_shard  # else whole tensors (at sampler.tp > 1 each engine TP rank keeps its slices)
    publisher = None
    if groups:
        part, group = next(iter(groups.items()))
        publisher = WeightPublisher(group, publish_stage_store(store, *part), cfg.publish.bucket_mb,
                                    cfg.publish.timeout_s, cfg.publish.checksum, sender=part[2],
                                    senders=topo.publish_senders, wire_dtype=getattr(torch, cfg.publish.dtype),
                                    delta=cfg.publish.delta)
    startup.mark("publish groups")
    learner = build_learner(str(model_dir), cfg)  # learner.backend: megatron | deepspeed
    startup.mark("model build")
    resumed = learner_state.load(learner, resume_from) if resume_from is not None else None
    source = learner  # what a version publishes
    if sglang and cfg.learner.lora.rank > 0:  # SGLang takes the adapted weights merged (megarl/learner/lora_publish.py)
        from megarl.learner.lora_publish import MergedLoraSource

        source = MergedLoraSource(learner, cfg.learner.lora, keep=lead)
        if lead:
            print(f"megarl: learner.lora with sampler.engine=sglang: publishing {len(source.spec)} merged weights; "
                  f"their base held for it: {source.base_bytes / 2**20:.1f} MiB", flush=True)
    start_step = resumed["step"] if resumed else 0
    schedule = Schedule(cfg, start_step)
    intake, outputs, collector = None, None, None
    if lead:
        hf_config = json.loads((Path(model_dir) / "config.json").read_text())
        intake = Intake(cfg, store, topo, moe.route_shape(hf_config),
                        hf_config.get("vocab_size", hf_config.get("text_config", {}).get("vocab_size")))
        recovery = {}
        if resumed:
            intake.resume(resumed["run"]["data_position"])
            dropped = roll_back_outputs(cfg.run.dir, resumed)  # before the sinks below append to the files
            # What a restart lost: the steps logged after the checkpoint are redone (groups then in
            # flight are re-issued by the samplers: the data position).
            recovery = {"restarts": float(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                        "redone_steps": float(dropped["metrics"])}
            print(resume_line(resumed["path"], start_step, learner.version, recovery["restarts"], dropped["metrics"]),
                  flush=True)
        if sglang:
            from megarl.distributed.sglang_publish import SGLangPublisher

            publisher = SGLangPublisher.from_config(cfg, store, topo.num_samplers)  # waits for every server
        startup.mark("intake")
        outputs = RunOutputs(cfg, topo.rank, recovery)
        if resumed:  # what was learned before the checkpoint counts for the console's held-out warning
            outputs.console.earlier_evaluations(eval_records(read_jsonl(Path(cfg.run.dir) / "metrics.jsonl")))
        if due_versions(cfg, learner.version):
            collector = EvalCollector(cfg, store, topo.num_engines, learner.version, start_step, outputs.record_eval,
                                      outputs.console.note)
    # Every publish source can name a sampler that stopped receiving (the lead's intake watches anyway).
    heartbeats = intake.heartbeats if lead else sampler_heartbeats(cfg, store, topo) if publisher else None
    note = outputs.console.note if lead else print  # messages never glued onto the progress line
    replacing = cfg.fault.on_failure == "replace"  # samplers are replaced: publishes go over membership epochs
    if lead and replacing:
        intake.members.note = note
        # How `megarl samplers remove` reaches this run (megarl.distributed.run_contact); removed at exit.
        write_contact(cfg.run.dir, {
            "store": [os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))],
            "prefix": f"{STORE_PREFIX}attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/",
            "secret": run_secret().decode(), "sampler_ranks": list(topo.engine_leads),
            "world_size": topo.world_size, "num_learners": topo.num_learners})
    # A membership epoch's group of this source's publish part, the source as rank 0 and `size - 1` member engines,
    # each receiving on receivers_per_engine ranks; members may first sit out a failed publish's receive. A stop
    # signal does not end its formation: the learner ranks stop together at a step boundary.
    make_group = lambda epoch, size: epoch_publish_group(  # noqa: E731
        store, epoch, 0, 1 + (size - 1) * topo.receivers_per_engine, cfg.dist.backend, 2 * cfg.publish.timeout_s,
        *next(iter(groups)), should_stop=lambda: False)
    if sglang:  # the servers' weight-update group, re-formed per epoch (megarl.distributed.sglang_publish)
        make_group = lambda epoch, size: publisher.join_epoch(epoch, size)  # noqa: E731
    # A failed publish goes again at once where the samplers left could not go on without it: SGLang servers whose
    # receive failed stay paused, with several publish parts a survivor may hold some of the version's parts and
    # not the others (its engine applies a version once every part arrived), and in sync mode a sampler generates
    # the next batch only once it runs the version.
    # The same holds for an engine spanning sampler.tp ranks: its ranks apply a version together, so one rank that
    # holds it while another's receive failed would wait for that version on the other.
    again_at_once = sglang or topo.num_stages * topo.publish_senders > 1 or topo.sampler_tp > 1 or \
        cfg.algo.mode == "sync"
    try:
        if resumed:  # the samplers generate nothing before they run the resumed weights
            if heartbeats is not None:  # restarted samplers may still be starting their engines
                heartbeats.wait_started(topo.num_learners)
            publish_weights(source, publisher, intake.header() if lead else {}, heartbeats, topo.num_learners,
                            shards)
        nonfinite = NonfiniteSteps(cfg.learner.max_nonfinite_in_row, "learner",
                                   "Lower learner.lr or check the rewards and data.")
        stopped = None
        for step in range(start_step, cfg.run.steps):
            if schedule.due(step):  # `step` steps are trained and logged
                save_checkpoint(learner, cfg, step, model_dir, intake, note)
            version = learner.version  # differs from `step` once a non-finite step was skipped
            wall = [time.time()]
            while True:
                try:
                    batch, intake_metrics = intake.next_batch(version) if lead else (None, {})
                except (StopRequested, JoinersWaiting) as told:  # the lead tells every learner rank in the batch's place
                    batch, intake_metrics = told, {}
                batch = share_batch(batch)
                if not isinstance(batch, JoinersWaiting):
                    break
                # Every sampler is gone and replacements wait to be admitted: they get the current version now.
                publish_to_members(source, publisher, intake, make_group, heartbeats, topo.num_learners, True, shards)
            if isinstance(batch, StopRequested):
                stopped = batch
                break
            wall.append(time.time())
            cpu = time.thread_time()
            metrics = train_on(learner, batch, cfg, step, nonfinite)
            # The step's CPU time on this thread: against train_s, what the step lost waiting for a core.
            metrics["train_cpu_s"] = time.thread_time() - cpu
            wall.append(time.time())
            published = {"bytes": 0, "seconds": 0.0}
            if learner.version != version:  # a skipped (non-finite) step changed nothing to publish
                # The lead's header also carries the bookkeeping.
                published = publish_weights(source, publisher, intake.header() if lead else {}, heartbeats,
                                            topo.num_learners, shards) if not replacing else \
                    publish_to_members(source, publisher, intake, make_group, heartbeats, topo.num_learners,
                                       again_at_once, shards)
            elif lead:
                intake.announce_retired()
            wall.append(time.time())
            if lead:
                outputs.record(step, batch, {**metrics, **intake_metrics, "version": learner.version}, wall,
                               published, version)
            if collector is not None:
                collector.published(learner.version, step + 1)
                collector.poll(learner.version)
        if stopped is not None:
            stop_on_signal(learner, cfg, step, schedule, model_dir, intake, stopped, note)
        if schedule.due(cfg.run.steps):
            save_checkpoint(learner, cfg, cfg.run.steps, model_dir, intake, note)
        if lead and cfg.checkpoint.export_dir:
            from megarl.checkpoint.export import export_hf

            note(f"megarl: exported {export_hf(cfg.checkpoint.dir, cfg.checkpoint.export_dir)}")
        if collector is not None:  # the samplers evaluate the last versions before they are told to stop
            collector.finish(learner.version, on_wait=lambda: intake.heartbeats.check(topo.num_learners))
    finally:
        if lead and replacing:
            remove_contact(cfg.run.dir)
        if lead:
            store.set(STOP_KEY, "learner stopped")
            intake.queue.close()
            if outputs is not None:
                outputs.close()
            if sglang:
                publisher.close()  # before interpreter shutdown: servers are still connected to its store


def stop_on_signal(learner, cfg: Config, step: int, schedule: Schedule, model_dir: Path, intake: Intake | None,
                   stop: StopRequested, note: Callable[[str], None] = print) -> None:
    """Every learner rank, `step` steps done: save if fault.checkpoint_on_signal asks (a checkpoint due at
    this step was saved at the top of the loop), then leave with 128 + the signal's number."""
    if cfg.fault.checkpoint_on_signal and step > schedule.start and not schedule.due(step):
        save_checkpoint(learner, cfg, step, model_dir, intake, note)
    if intake is not None:
        note(f"megarl: {stop} after {step} steps")
    raise SystemExit(exit_status(stop.signum))


def _collect_groups(queue: QueueReceiver, cfg: Config, learner_version: int, drop: Callable[[list[Sample]], None],
                    sampler_stats: dict[int, dict[str, float]], on_wait=None,
                    accept=None, wait_more=None) -> tuple[list[list[Sample]], Counter, float]:
    """The next `prompts_per_step` usable groups. Stale groups (algo.stale: holding a token, or under mask_tokens
    holding only tokens, more than max_lag versions old) and, with
    advantage.filter_zero_variance, groups whose rewards are all equal are dropped, counted by
    reason and handed to `drop` (retired: the sampler may start replacements at once). When queue.timeout_s passes
    without a group, `wait_more()` (fault.on_failure=replace) may say to wait on."""
    start = time.perf_counter()
    groups, dropped = [], Counter({"stale_groups": 0})
    length_limit = LengthLimit.of(cfg)  # what filter_zero_variance's shaped rewards need (overlong_buffer)
    while len(groups) < cfg.algo.prompts_per_step:
        try:
            group, stats = queue.recv_group(cfg.queue.timeout_s, on_wait=on_wait)
        except TimeoutError:
            if wait_more is not None and wait_more():
                continue
            raise
        if on_wait is not None:  # also while groups flow: one sampler may hang while another feeds us
            on_wait()
        if accept is not None and not accept(group, stats):  # a replaced sampler's late group: never retired
            continue
        sampler_stats[group[0].sampler_rank] = stats
        reason = None
        if is_stale(group, learner_version, cfg.algo.max_lag, cfg.algo.stale):
            reason = "stale_groups"
        elif cfg.algo.advantage.filter_zero_variance and is_zero_variance(group, cfg.algo.advantage, length_limit):
            reason = "zero_variance_groups"
        if reason is not None:
            dropped[reason] += 1
            drop(group)
            continue
        groups.append(group)
    return groups, dropped, time.perf_counter() - start
