"""The sampler loop: never stops generating while the run lasts.

Each iteration admits new prompt groups while the staleness budget allows, runs one engine step
(which applies a newly received version in flight first), scores finished groups and pushes them
to the learner. Weights arrive on a receiver thread, overlapping the transfer with decoding.

A multi-turn task's samples are episodes (megarl/rollout/episode.py): each finished model turn goes to
the task's environment on a worker thread, whose answer becomes environment tokens and the next
turn's request; a group is scored when all its episodes have ended (the environment gave the reward).

Sync mode (the baseline): right after each new version is applied the sampler starts exactly its
share of one batch and then waits, generating nothing, until the learner publishes again.

Evaluation (eval.sets): at the step boundary where a due version becomes current, the built-in engine's
sampler pins it (a second engine over the same weights) and runs its share of the held-out sets there, in
pinned-engine steps between its training steps (at every turn where the training engine is idle, one in four
while it decodes); the training engine keeps generating and applying the versions published meanwhile
(megarl/eval/sampler_side.py). An HTTP engine's sampler runs its
share to completion at that boundary, and the thread that updates its server waits before it (hold_update).

Staleness budget (pipeline mode): a sampler may have at most ceil((max_lag + 1) * prompts_per_step / samplers)
groups outstanding (started, not yet trained or dropped by the learner, which reports what it
retired in every publish header, and what it dropped as soon as it drops it), so the age of what is
queued cannot grow without bound when the learner slows down. Scored groups go to the learner in
algo.queue_order (megarl/rollout/send_order.py): by default a group does not overtake an older, still
running one that would then reach the learner stale.
"""
from __future__ import annotations

import functools
import itertools
import json
import math
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from megarl.checkpoint.resume import wait_for_announcement
from megarl.config.schema import Config
from megarl.distributed.heartbeat import Heartbeat
from megarl.distributed.lifetime import SIGNAL_KEY, WaitAbandoned, exit_status, seconds_since_signal, stop_signal, \
    wait_for_keys
from megarl.distributed.membership import SHIFT, EpochFollower, SamplerDropped, engine_ready_key, incarnation, \
    join_key, read_record, rejoin_timeout_s, removed_key, served_key, sync_extra_key
from megarl.distributed.publish import StagedReceiver
from megarl.distributed.queue import QueueSender
from megarl.distributed.ranks import Topology
from megarl.distributed.topology import engine_tp_group, epoch_publish_group, publish_groups, publish_stage_store
from megarl.distributed.wire import sample_problem
from megarl.eval.sampler_side import VersionEvaluator
from megarl.eval.sets import due_versions, heldout_fraction
from megarl.models import moe, tp_shard
from megarl.observe import startup
from megarl.observe.timeline import Timeline
from megarl.protocols import Completion, GenerationRequest, RouteShape, SamplingParams, Sample
from megarl.ratelimit import RateLimitedLine
from megarl.roles.learner_main import STOP_KEY, retired_key
from megarl.rollout.agent import AgentRunner
from megarl.rollout.datasets import source_of
from megarl.rollout.env_adapters import agent_for, task_for
from megarl.rollout.environment import is_multi_turn
from megarl.rollout.episode import Episode, EpisodeLimits, EpisodeRunner
from megarl.rollout.heldout import training_split
from megarl.rollout.position import RetiredIndices, group_id as make_group_id
from megarl.rollout.rewards import check_reward, score_group
from megarl.rollout.routes import check_routes
from megarl.rollout.sandbox import hide_from_sandboxes
from megarl.rollout.send_order import Unsent, groups_to_send
from megarl.rollout.tasks import prompt_rng, sync_sampling_seed
from megarl.secret import run_secret

STOP_POLL_S = 0.2
REWARD_REPORT_S = 30.0  # a spent reward budget is printed at most this often (each one is counted)
MAX_CONSECUTIVE_SKIPS = 1000
# Groups in a row whose every sample fails the wire check (sample_problem) before the sampler stops the run: an agent
# that fails every episode before its first request would otherwise replace its groups forever, training nothing.
MAX_FAILED_GROUPS_IN_ROW = 100


def check_sample_routes(samples: list[Sample], shape: RouteShape | None, routing_replay: str, engine: str) -> None:
    """Where a group is assembled: ValueError naming sampler.engine for a sample whose routes do not fit the
    model, or that has none under algo.routing_replay=r3 (never send what the learner would train
    unreplayed).  With replay off a sample may come without routes (an engine that does not record them);
    a dense model (shape None) has none to check."""
    if shape is None:
        return
    for sample in samples:
        if sample.routes is None and routing_replay != "r3":
            continue
        try:
            check_routes(sample, shape)
        except ValueError as exc:
            raise ValueError(f"megarl: routes from sampler.engine={engine}: {exc}") from None


def import_engine(engine: str) -> None:
    """Import what a sampler of sampler.engine builds from (its tokenizer's library, the built-in engine) ahead
    of building it: a rank started behind the launch gate does this while `megarl train` checks the run."""
    from transformers import AutoTokenizer  # noqa: F401

    if engine == "builtin":
        import megarl.sampler.engine  # noqa: F401


def builtin_engine(cfg: Config, topo: Topology, model_dir: Path, tp_group):
    """This rank's built-in engine: the whole model, or its TP shard of an engine spanning sampler.tp ranks
    (every TP rank of an engine seeds alike: identical logits then sample identical tokens)."""
    from megarl.sampler.engine import BuiltinEngine

    return BuiltinEngine.from_pretrained(
        model_dir, max_running=cfg.sampler.max_running, max_seq_len=cfg.sampler.max_seq_len,
        kv_on_update=cfg.sampler.kv_on_update, prefill_chunk=cfg.sampler.prefill_chunk,
        kv_layout=cfg.sampler.kv_layout, kv_block_size=cfg.sampler.kv_block_size, kv_blocks=cfg.sampler.kv_blocks,
        seed=cfg.run.seed * 1000 + topo.engine_leads[topo.engine_index],
        tp_group=tp_group, model_impl=cfg.sampler.model_impl)


def epoch_followers(cfg: Config, topo: Topology, store, groups: dict | None,
                    should_stop: Callable[[], bool]) -> list[EpochFollower] | None:
    """fault.on_failure=replace: what moves this incarnation's receivers from membership epoch to epoch, one per
    publish part in part order (each stage's and sender's; the first incarnation starts over the run's first publish
    groups, a replacement outside any). Each part's receiver builds its epoch's group on its own thread, over a store
    connection of its own (topology.epoch_publish_group): the parts' sources form their groups at different moments,
    and neither another part's group nor the loop's heartbeat waits on one part's."""
    if cfg.fault.on_failure != "replace":
        return None
    timeout_s = 2 * cfg.publish.timeout_s  # a member may first sit out a failed publish's receive
    # Every rank of an engine spanning sampler.tp ranks follows the epochs as its engine, the lead's rank: the engine
    # is one member, replaced whole (megarl.roles.sampler_keeper).
    return [EpochFollower(store, topo.engine_lead, incarnation(),
                          lambda epoch, rank, size, part=part: epoch_publish_group(
                              store, epoch, rank, size, cfg.dist.backend, timeout_s, *part, should_stop=should_stop),
                          group=groups[part] if groups else None, rejoin_timeout_s=rejoin_timeout_s(cfg),
                          receivers=topo.receivers_per_engine, offset=topo.publish_offset)
            for part in topo.publish_parts]


def weight_receiver(cfg: Config, topo: Topology, store, engine, on_version, should_stop,
                    groups: dict) -> StagedReceiver:
    """The receiver of this sampler rank's part of every version over its publish `groups` (publish_groups):
    one group per learner pipeline stage (one at PP=1), of this rank's TP rank (or whole tensors cut to this TP
    rank's slices on arrival, at learner.tp=1); a version is applied once every stage's part arrived. `engine`
    tells what a version carries (weight_spec), where it lands (device) and which version runs (version):
    the engine itself, or its AdapterStager under learner.lora."""
    expected, narrow = engine.weight_spec(), None
    if topo.slices_on_arrival:  # learner.tp=1: whole tensors arrive, this TP rank keeps its slices
        expected = {name: (torch.Size(tp_shard.whole_shape(name, shape, topo.sampler_tp)), dtype)
                    for name, (shape, dtype) in expected.items()}
        narrow = functools.partial(tp_shard.shard, tp_size=topo.sampler_tp, tp_rank=topo.engine_tp_rank)
    # The built-in engine (and its TP lead) offers the storage each version will run from: received into
    # directly, a version costs one copy of the weights (SGLang and vLLM take tensors from staging sets).
    followers = epoch_followers(cfg, topo, store, groups, should_stop)
    stages = [(groups[part] if followers is None else followers[i].group, publish_stage_store(store, *part))
              for i, part in enumerate(topo.publish_parts)]
    return StagedReceiver(stages, expected, engine.device, on_version=on_version,
                          current_version=lambda: engine.version, should_stop=should_stop,
                          timeout_s=cfg.publish.timeout_s,
                          destination=getattr(engine, "staging_buffers", None), narrow=narrow,
                          followers=followers).start()


class SamplerLoop:
    def __init__(self, cfg: Config, topo: Topology, store, model_dir: Path, tp_group=None, groups: dict | None = None):
        from transformers import AutoTokenizer

        self.cfg, self.topo, self.store = cfg, topo, store
        self.groups = groups  # the publish groups (run_sampler); None with SGLang, whose server receives
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if cfg.sampler.engine == "sglang":
            from megarl.sampler.sglang_engine import SGLangEngine

            self.engine = SGLangEngine.from_config(cfg, topo, model_dir)  # starts this rank's server
        elif cfg.sampler.engine == "vllm":
            from megarl.sampler.vllm_engine import VLLMEngine

            # Starts this rank's vLLM server; weights (or, under learner.lora, adapters) come through
            # weight_receiver, then stage_weights applies them on the server in flight.
            self.engine = VLLMEngine.from_config(cfg, topo, model_dir)
        elif tp_group is not None:  # this rank leads an engine spanning sampler.tp ranks
            from megarl.sampler.tensor_parallel import TPLeadEngine

            self.engine = TPLeadEngine(builtin_engine(cfg, topo, model_dir, tp_group), tp_group, run_secret(),
                                       cfg.dist.timeout_s)
        else:
            self.engine = builtin_engine(cfg, topo, model_dir, None)
        # learner.lora: versions carry only the adapter, merged into the base here (megarl/sampler/lora.py); a
        # vLLM engine takes the adapter itself and its server's worker merges it (VLLMEngine.take_adapters).
        self.adapters = None
        if cfg.learner.lora.rank > 0 and cfg.sampler.engine == "builtin":
            from megarl.sampler.lora import AdapterStager

            self.adapters = AdapterStager.from_pretrained(self.engine, model_dir, cfg.learner.lora)
        # Sandboxed code (a python_output program, a tool call, a sandboxed reward) must not read the answers.
        hide_from_sandboxes(cfg.run.dir, cfg.task.path, cfg.checkpoint.dir)
        # MoE models: every sample's routes are checked here, where the sample is assembled (None: dense).
        self.route_shape = moe.route_shape(json.loads((Path(model_dir) / "config.json").read_text()))
        self.task = task_for(cfg.task)  # task.env: an environment's tasks (its worker started)
        if (fraction := heldout_fraction(cfg)) is not None:  # eval.sets draws the held-out prompts: never trained on
            self.task = training_split(self.task, fraction)
        if ":" in cfg.task.reward_fn and topo.role_rank == 0:  # `megarl train` checked it; a raw torchrun did not
            print(f"megarl: {check_reward(self.task, cfg.task.reward_fn)}", flush=True)
        # Group k of this sampler draws its prompt from prompt_rng(seed, role rank, k); a resumed run
        # starts the indices its checkpoint had not retired (see run()).
        self.indices = itertools.count()
        self.resume_version: int | None = None  # generate nothing before the engine runs this version
        self.sampling = SamplingParams(cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.top_k,
                                       cfg.sampling.max_new_tokens)
        # SGLang: a request must leave min_new_tokens of the server's context (sampler.max_seq_len).
        self.room = cfg.sampler.sglang.min_new_tokens if cfg.sampler.engine == "sglang" else 1
        self.episodes: EpisodeRunner | AgentRunner | None = None
        tc = cfg.task
        limits = EpisodeLimits.of(tc, cfg.sampler.max_seq_len, self.room)
        if agent_for(tc):  # episodes are agent programs talking to this sampler's chat-completions endpoint
            self.episodes = AgentRunner(agent_for(tc), self.tokenizer, self.engine.add_request, self.sampling, limits,
                                        stop_token_ids=(self.tokenizer.eos_token_id,), workers=tc.env_workers,
                                        timeout_s=tc.agent_timeout_s, model_name=Path(model_dir).name,
                                        max_request_bytes=tc.agent_max_request_bytes, tool_parser=tc.tool_parser,
                                        # stream=true sends tokens per step where the engine can read them early
                                        progress=getattr(self.engine, "progress", None))
        elif is_multi_turn(self.task):
            self.episodes = EpisodeRunner(self.task, self.tokenizer, self.engine.add_request, self.sampling, limits,
                                          stop_token_ids=(self.tokenizer.eos_token_id,), workers=tc.env_workers)
        self.share = cfg.algo.prompts_per_step / topo.num_engines
        self.budget = math.ceil((cfg.algo.max_lag + 1) * self.share)
        self.sync_share = int(self.share)
        self.sync_admitted_version: int | None = None
        # fault.on_failure=replace: (version, groups) the learner asked of this incarnation beyond its share of that
        # version's batch (a lost sampler's share: membership.SyncShares), and how many of them it started
        self.sync_extra: tuple[int | None, int] = (None, 0)
        self.sync_extra_started = 0
        self.started = 0
        self.retired = 0
        self.sent = 0  # groups sent to the learner; those not retired yet are ahead in its queue (send_order)
        self.learner_version = 0  # the version whose publish header reported `retired` (set before it)
        self.skipped_overlong = 0
        self.dropped_samples = RateLimitedLine()  # samples failing the wire check, never sent (_settle)
        self.failed_groups = 0  # groups none of whose samples passed it, replaced by a new group
        self.failed_groups_in_row = 0
        self.pending: dict[str, dict] = {}
        self.new_version = threading.Event()
        self.stopped = False
        self.signal_reported = False
        self.started_at = time.time()
        self.busy_s = 0.0  # wall time in engine steps that had work to do
        self.reward_s = 0.0  # wall time in reward calls
        self.reward_budget_spent = 0  # groups whose reward budget ran out (their remaining samples failed fast)
        self.next_reward_report = 0.0  # monotonic time before which a spent budget is counted, not printed
        self.timeline: Timeline | None = None  # opened once the learner has prepared run.dir (run())
        # fault.on_failure=replace: a replacement (incarnation > 0) starts nothing before it runs the version it
        # joined at, then re-issues what its predecessor left unretired (the data position its epoch carries).
        self.incarnation = incarnation()
        self.served = False  # this incarnation sent a group (fault.on_failure=replace: membership.served_key)
        self.follower: EpochFollower | None = None
        self.evaluator: VersionEvaluator | None = None  # eval.sets: this engine's share of each due version (run())

    def _on_version(self, version: int, tensors: dict, extra: dict) -> None:
        self._hold_update(self.engine.version)  # vLLM applies it on the server now: not while a due version is evaluated
        if self.adapters is not None:
            self.adapters.stage(tensors, version)
        else:
            self.engine.stage_weights(tensors, version)
        self._on_published(version, extra)

    def _on_published(self, version: int, extra: dict) -> None:
        position = self.follower.take_position() if self.follower is not None else None
        if position is not None:  # the first version since this replacement joined
            retired = RetiredIndices.from_dict(position)
            self.indices, self.started = retired.unretired(), len(retired)
            self.retired = self.sent = self.started
            self.resume_version = version
            if self.evaluator is not None:
                self.evaluator.join(version)
        self.learner_version = version  # before `retired`: _send_due reads them the other way round
        self.retired = extra.get("retired", {}).get(str(self.topo.rank), self.retired)
        self.new_version.set()

    def _start_weight_receiver(self):
        if self.cfg.sampler.engine == "sglang":  # the server receives; the follower drives its HTTP calls
            from megarl.sampler.sglang_engine import SGLangWeightFollower

            return SGLangWeightFollower.from_config(self.engine, self.store, self.cfg, self.topo,
                                                    on_published=self._on_published,
                                                    should_stop=lambda: self.stopped,
                                                    before_update=self._hold_update).start()
        return weight_receiver(self.cfg, self.topo, self.store, self.adapters or self.engine, self._on_version,
                               lambda: self.stopped, self.groups)

    def _hold_update(self, version_now: int) -> None:
        if self.evaluator is not None:
            self.evaluator.hold_update(version_now, lambda: self.stopped)

    def run(self) -> None:
        self.resume_version, retired = wait_for_announcement(self.store, self.cfg, self.topo.role_rank,
                                                             self.cfg.dist.timeout_s)
        if self.resume_version is not None:
            self.indices, self.started = retired.unretired(), len(retired)
            self.retired = self.sent = self.started
            self.learner_version = self.resume_version
        startup.mark("engine, then the learner's announcement")
        if self.cfg.run.timeline:
            self.timeline = Timeline(self.cfg.run.dir, f"sampler{self.topo.rank}")
            self.timeline.startup(startup.spans())  # what this process did before it generated
        if due_versions(self.cfg, self.resume_version or 0):
            self.evaluator = VersionEvaluator(self.cfg, self.store, self.tokenizer, self.topo.engine_index,
                                              self.topo.num_engines, self.resume_version or 0,
                                              staged=self.cfg.sampler.engine == "builtin",
                                              joined=self.incarnation == 0)  # a replacement's joins in _on_published
        if self.incarnation > 0:
            self.resume_version = 1 << 62  # nothing before the version of the epoch that admits it (_on_published)
        receiver = self._start_weight_receiver()
        self.follower = getattr(receiver, "follower", None) or \
            next((r.follower for r in getattr(receiver, "receivers", [])), None)  # SGLang's, or part 0's (its
        # epoch records carry the data position; every part's follower reads the same ones)
        sender = QueueSender(self.store, self.cfg.queue.timeout_s, run_secret(), self.topo.rank,
                             first_sequence=self.incarnation << SHIFT)
        heartbeat = Heartbeat(self.store, self.topo.rank, self.cfg.fault.heartbeat_s, first=self.incarnation << SHIFT)
        next_stop_check = 0.0
        try:
            if self.incarnation > 0 and not self._ask_to_join():
                return
            while True:
                heartbeat.beat()  # the learner names this rank if the loop stops turning
                if time.monotonic() >= next_stop_check:
                    if self.store.check([STOP_KEY]):
                        break
                    if stop_signal() is not None and self._stop_signalled():
                        break
                    self._read_retired()
                    if self.cfg.algo.mode == "sync" and self.cfg.fault.on_failure == "replace":
                        self._read_sync_extra()
                    next_stop_check = time.monotonic() + STOP_POLL_S
                if receiver.error is not None:
                    if self._removed(receiver.error):  # `megarl samplers remove`: its keeper starts no other
                        print(f"megarl: sampler {self.topo.role_rank} (rank {self.topo.rank}) left the publish set "
                              f"(megarl samplers remove); {len(self.pending)} running groups dropped", flush=True)
                        break
                    raise RuntimeError(f"sampler {self.topo.role_rank}: weight receiver failed") from receiver.error
                self._admit()
                evaluating = self.evaluator is not None and self.evaluator.evaluating
                if self.engine.num_unfinished == 0 and not evaluating:  # (an evaluation's steps are work to do)
                    if self.episodes is not None and self.episodes.num_stepping:
                        self.episodes.ready.wait(STOP_POLL_S)  # every episode waits for its environment
                    else:  # budget spent and nothing running: wait for the learner's next version
                        self.new_version.wait(STOP_POLL_S)
                self.new_version.clear()
                if self.evaluator is not None:  # it applies staged versions, pins a due one and moves an evaluation
                    # in progress between the training steps (megarl/eval/sampler_side.py)
                    self.evaluator.before_step(self.engine, heartbeat.beat)
                had_work = self.engine.num_unfinished > 0
                start, decoded = time.time(), self.engine.stats()["tokens_decoded"]
                evaluator_stages = self.evaluator is not None and self.evaluator.staged  # it applied them above
                finished = self.engine.step(apply_staged=False) if evaluator_stages else self.engine.step()
                if had_work:
                    end = time.time()
                    self.busy_s += end - start
                    if self.timeline is not None:
                        self.timeline.tokens(self.engine.stats()["tokens_decoded"] - decoded, start, end)
                if self.episodes is None:
                    for completion in finished:
                        self._finish(completion)
                else:
                    ended = [e for e in map(self.episodes.on_completion, finished) if e is not None]
                    for episode in ended + self.episodes.poll():
                        self._finish_episode(episode)
                self._send_due(sender)
        finally:
            self.stopped = True
            if self.episodes is not None:
                self.episodes.close()
            # Join before the process exits: a thread still inside a store or gloo call at
            # interpreter shutdown aborts the process (SIGABRT), which torchrun reports as a failure.
            receiver.join(self.cfg.publish.timeout_s)
            self.engine.close()  # stops this rank's SGLang server / this engine's TP followers
            sender.close()
            if self.timeline is not None:
                self.timeline.close()
            if self.evaluator is not None:
                self.evaluator.close()

    def _ask_to_join(self) -> bool:
        """A replacement whose engine and receiver are ready asks the learner to take it into the next epoch; an
        engine spanning sampler.tp ranks asks once every follower rank's receiver follows the epochs too (the epoch's
        group waits for all of them). False when the run stopped meanwhile."""
        followers = [engine_ready_key(rank, self.incarnation)
                     for rank in range(self.topo.rank + 1, self.topo.rank + self.topo.sampler_tp)]
        try:
            wait_for_keys(self.store, followers, self.cfg.dist.timeout_s,
                          f"the weight receivers of engine {self.topo.engine_index}'s TP ranks (replacement "
                          f"{self.incarnation})",
                          should_stop=lambda: stop_signal() is not None or self.store.check([STOP_KEY]))
        except WaitAbandoned:
            return False
        self.store.set(join_key(self.topo.rank), str(self.incarnation))
        return True

    def _removed(self, error: BaseException) -> bool:
        """Did the learner leave this incarnation out of its epochs because `megarl samplers remove` asked?"""
        record = read_record(self.store, removed_key(self.topo.rank))
        return isinstance(error, SamplerDropped) and record is not None and \
            record.get("incarnation") == self.incarnation

    def _read_retired(self) -> None:
        """Groups the learner dropped, or trained in a skipped step, free budget before (or without) a publish
        saying so (learner_main.Intake.drop, announce_retired)."""
        key = retired_key(self.topo.rank)
        if self.store.check([key]):
            self.retired = max(self.retired, int(self.store.get(key)))

    def _read_sync_extra(self) -> None:
        """The extra groups the learner asks of this incarnation (membership.SyncShares), if any."""
        record = read_record(self.store, sync_extra_key(self.topo.rank))
        if record is not None and record["incarnation"] == self.incarnation:
            self.sync_extra = (record["version"], record["groups"])

    def _stop_signalled(self) -> bool:
        """This rank received a stop signal: tell the learner (it may not have received one), then keep
        serving until it says stop (a publish in progress needs every receiver), at most half of
        fault.stop_timeout_s (the rest is the learner's, for its checkpoint)."""
        if not self.signal_reported:
            self.store.set(SIGNAL_KEY, str(stop_signal()))
            self.signal_reported = True
        return seconds_since_signal() > self.cfg.fault.stop_timeout_s / 2

    def _admit(self) -> None:
        if self.resume_version is not None and self.engine.version < self.resume_version:
            return  # a resumed run generates only with the resumed weights, published before its first step
        if self.cfg.algo.mode == "sync":
            if self.sync_admitted_version == self.engine.version:
                # this version's share is generated (or generating); the learner may ask for a lost sampler's too
                asked = self.sync_extra[1] if self.sync_extra[0] == self.engine.version else 0
                while self.sync_extra_started < asked:
                    self._start_group()
                    self.sync_extra_started += 1
                return
            if self.pending:
                return  # the last version's groups still run: wait for them
            self.sync_admitted_version, self.sync_extra_started = self.engine.version, 0
            # The batch's sampling stream is a function of (run.seed, engine, version): a resumed run, under any
            # learner layout, samples what the uninterrupted run did. Only the built-in single-process engine
            # can restart its generator (SGLang, vLLM and a TP engine keep one stream: docs/checkpoint.md).
            reseed = getattr(self.engine, "reseed", None)
            if reseed is not None:
                reseed(sync_sampling_seed(self.cfg.run.seed, self.topo.engine_index, self.engine.version))
            for _ in range(self.sync_share):
                self._start_group()
            return
        while self.started - self.retired < self.budget:
            self._start_group()

    def _start_group(self) -> None:
        index = next(self.indices)
        rng = prompt_rng(self.cfg.run.seed, self.topo.role_rank, index)
        for _ in range(MAX_CONSECUTIVE_SKIPS):
            prompt = self.task.sample_prompts(rng, 1)[0]
            if self.episodes is not None:
                opening = self.episodes.opening(prompt)
                ids = opening.ids if opening is not None else []  # an agent's requests are checked one by one
            else:
                ids = self.tokenizer.encode(prompt.text, add_special_tokens=False)
            if len(ids) + self.room > self.cfg.sampler.max_seq_len:
                if not self.cfg.task.skip_overlong_prompts:
                    raise ValueError(f"prompt of {len(ids)} tokens does not fit sampler.max_seq_len="
                                     f"{self.cfg.sampler.max_seq_len}: {prompt.text[:80]!r}")
                self.skipped_overlong += 1
                continue
            break
        else:
            raise ValueError(f"{MAX_CONSECUTIVE_SKIPS} prompts in a row do not fit sampler.max_seq_len="
                             f"{self.cfg.sampler.max_seq_len}; raise it or shorten the task's prompts")
        group_id = make_group_id(self.topo.role_rank, index)
        # Its first token comes from the version the engine's next step decodes under (the newest staged, unless
        # an evaluation holds an older due one) or a later one: send_order's deadline counts from there.
        start_version = (self.evaluator.next_version(self.engine) if self.evaluator is not None
                         else max(self.engine.version, self.learner_version))
        self.pending[group_id] = {"prompt": prompt, "done": [], "start_version": start_version}
        self.started += 1
        for j in range(self.cfg.algo.group_size):
            if self.episodes is not None:  # each episode its own (transcript of the same) opening
                self.episodes.start(f"{group_id}/{j}", prompt, self.episodes.opening(prompt))
                continue
            self.engine.add_request(GenerationRequest(f"{group_id}/{j}", ids, self.sampling,
                                                      stop_token_ids=(self.tokenizer.eos_token_id,)))

    def _group_complete(self, key: str, finished) -> tuple[str, dict] | None:
        """Record a finished completion or episode ("<group id>/<j>"); its group's id and entry once all are in."""
        group_id = key.rsplit("/", 1)[0]
        entry = self.pending[group_id]
        entry["done"].append(finished)
        if len(entry["done"]) < self.cfg.algo.group_size:
            return None
        return group_id, entry

    def _send_due(self, sender: QueueSender) -> None:
        """Send the scored groups algo.queue_order lets go now (megarl/rollout/send_order.py); `pending`
        holds the unsent groups in start order. Called after every step: a group held back may become due
        when an older one is scored, the learner retires groups, or a version arrives."""
        if not self._held():
            return
        in_pipe = self.sent - self.retired  # retired first: the receiver thread sets the version before it
        ids = list(self.pending)
        due = groups_to_send([Unsent("samples" in self.pending[g], self.pending[g]["start_version"]) for g in ids],
                             self.cfg.algo.queue_order, in_pipe, self.learner_version, self.share,
                             self.cfg.algo.max_lag)
        for i in due:
            samples = self.pending.pop(ids[i])["samples"]
            sender.send_group(samples, self._stats())
            self.sent += 1
            if not self.served and self.cfg.fault.on_failure == "replace":  # it ran: a later error is a fault
                self.store.set(served_key(self.topo.rank), str(self.incarnation))
            self.served = True

    def _held(self) -> int:
        """Groups scored and not sent yet (algo.queue_order holds them back)."""
        return sum("samples" in entry for entry in self.pending.values())

    def _finish(self, completion: Completion) -> None:
        if (complete := self._group_complete(completion.request_id, completion)) is None:
            return
        group_id, entry = complete
        prompt, samples = entry["prompt"], []
        done = sorted(entry["done"], key=lambda c: c.request_id)
        texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in done]
        scored = score_group(self.task, prompt, texts, self.cfg.task.reward_group_budget_s)
        self.reward_s += scored.seconds
        if scored.skipped:  # generation stood still meanwhile: say so, at most every REWARD_REPORT_S
            self.reward_budget_spent += 1
            if time.monotonic() >= self.next_reward_report:
                self.next_reward_report = time.monotonic() + REWARD_REPORT_S
                first = next(error for _, error in scored.scores if error is not None)
                print(f"megarl: sampler {self.topo.role_rank}: the rewards of one group took {scored.seconds:.1f}s, "
                      f"over task.reward_group_budget_s={self.cfg.task.reward_group_budget_s:g}; {scored.skipped} of "
                      f"its {len(texts)} samples failed without a call (first error: {first}); "
                      f"{self.reward_budget_spent} such group(s) so far", flush=True)
        for c, text, (reward, error) in zip(done, texts, scored.scores):
            samples.append(Sample(group_id=group_id, prompt=prompt.text, completion=text, prompt_ids=c.prompt_ids,
                                  token_ids=c.token_ids, logprobs=c.logprobs, versions=c.versions, reward=reward,
                                  finish_reason=c.finish_reason, sampler_rank=self.topo.rank, reward_error=error,
                                  routes=c.routes, source=source_of(prompt, self.cfg.task.source_field)))
        self._check_routes(samples)
        self._settle(group_id, entry, samples)

    def _finish_episode(self, episode: Episode) -> None:
        if (complete := self._group_complete(episode.key, episode)) is None:
            return
        group_id, entry = complete
        samples = [Sample(group_id=group_id, prompt=e.prompt.text, completion=self.tokenizer.decode(e.token_ids),
                          prompt_ids=e.prompt_ids, token_ids=e.token_ids, logprobs=e.logprobs, versions=e.versions,
                          reward=e.reward, finish_reason=e.finish_reason, sampler_rank=self.topo.rank,
                          reward_error=e.error, env_spans=e.env_spans, turns=e.turns, routes=e.sample_routes(),
                          source=source_of(e.prompt, self.cfg.task.source_field),
                          reward_parts=None if e.reward_parts is None else json.dumps(e.reward_parts))
                   for e in sorted(entry["done"], key=lambda e: int(e.key.rsplit("/", 1)[1]))]
        self._check_routes(samples)
        failed = next((s.reward_error for s in samples if s.reward_error is not None), None)
        if failed is not None and time.monotonic() >= self.next_reward_report:  # said at most every REWARD_REPORT_S
            self.next_reward_report = time.monotonic() + REWARD_REPORT_S
            print(f"megarl: sampler {self.topo.role_rank}: an episode failed, scored 0 ({failed}); "
                  f"{self.episodes.env_failures} environment failure(s) so far", flush=True)
        self._settle(group_id, entry, samples)

    def _settle(self, group_id: str, entry: dict, samples: list[Sample]) -> None:
        """A scored group joins those to send, less the samples the learner would refuse (wire.sample_problem, the
        check it applies on receipt): an agent episode that failed, or whose first request did not fit the context,
        before any model turn has no tokens to train. They are dropped and counted (sampler{rank}/dropped_samples;
        a failure is also in env_failures); a group left with none is counted (failed_groups) and replaced by a new
        group at once, so the learner still receives its groups (sync mode waits for every one)."""
        kept = []
        for s in samples:
            if (problem := sample_problem(s)) is None:
                kept.append(s)
                continue
            self.dropped_samples(f"sampler {self.topo.role_rank}: dropped an episode the learner would refuse "
                                 f"({problem}; {s.reward_error or 'finish_reason ' + s.finish_reason})"[:800])
        if kept:
            self.failed_groups_in_row = 0
            entry["samples"] = kept
            return
        del self.pending[group_id]
        self.failed_groups += 1
        self.failed_groups_in_row += 1
        if self.failed_groups_in_row >= MAX_FAILED_GROUPS_IN_ROW:
            raise RuntimeError(f"sampler {self.topo.role_rank}: {MAX_FAILED_GROUPS_IN_ROW} groups in a row had no "
                               f"sample to train (first problem: {sample_problem(samples[0])}; "
                               f"{samples[0].reward_error or 'finish_reason ' + samples[0].finish_reason}); fix the "
                               f"agent (task.agent) or raise sampler.max_seq_len")
        self.started -= 1  # the replacement takes its place in the budget (pipeline) and in the version's share (sync)
        self._start_group()

    def _check_routes(self, samples: list[Sample]) -> None:
        check_sample_routes(samples, self.route_shape, self.cfg.algo.routing_replay, self.cfg.sampler.engine)

    def _stats(self) -> dict[str, float]:
        """Running counters sent with every group (the learner logs them as sampler{rank}/...)."""
        engine = self.engine.stats()
        wall = time.time() - self.started_at
        return {"busy_frac": self.busy_s / wall, "tokens_per_s": engine["tokens_decoded"] / wall,
                "held_groups": self._held(), "tokens_decoded": engine["tokens_decoded"], "swaps": engine["swaps"],
                "swap_time_s": engine["swap_time_s"], "version": engine["version"],
                "skipped_overlong_prompts": self.skipped_overlong, "reward_s": self.reward_s,
                "reward_budget_spent": self.reward_budget_spent,
                "dropped_samples": self.dropped_samples.count, "failed_groups": self.failed_groups,
                "env_failures": self.episodes.env_failures if self.episodes else 0,
                "over_context": self.episodes.over_context if self.episodes else 0,
                "tool_call_parse_failures": getattr(self.episodes, "tool_call_parse_failures", 0),
                "stream_disconnects": getattr(self.episodes, "stream_disconnects", 0),
                "env_s": self.episodes.env_s if self.episodes else 0.0,
                # which incarnation sent it (fault.on_failure=replace: a predecessor's late group is refused), and
                # how many groups it started (what its replacement counts as lost)
                "incarnation": self.incarnation, "started": self.started,
                # the paged KV layout's block pool (sampler.kv_layout=paged): its size, blocks in slots, promised
                **{k: engine[k] for k in ("kv_blocks", "kv_blocks_used", "kv_blocks_reserved") if k in engine}}


def run_sampler(cfg: Config, topo: Topology, store, model_dir: Path) -> None:
    torch.set_num_threads(cfg.sampler.threads)
    tp_group = engine_tp_group(topo, store, cfg.dist.backend, cfg.dist.timeout_s, incarnation())
    # The publish groups first, before the tokenizer and the engine: the learner creates them early in its own
    # start-up (before its model build), so it does not wait here for this rank's engine, and each side then
    # builds what it runs at the same time (SGLang's server receives the weights itself: no groups).
    # A replacement sampler (fault.on_failure=replace) joins a later membership epoch's group instead.
    groups = None if cfg.sampler.engine == "sglang" or incarnation() > 0 else \
        publish_groups(topo, store, cfg.dist.backend, cfg.dist.timeout_s)
    startup.mark("publish groups")
    if topo.engine_tp_rank == 0:
        SamplerLoop(cfg, topo, store, model_dir, tp_group, groups).run()
    else:
        run_engine_follower(cfg, topo, store, model_dir, tp_group, groups)
    if stop_signal() is not None:
        raise SystemExit(exit_status(stop_signal()))


def run_engine_follower(cfg: Config, topo: Topology, store, model_dir: Path, tp_group, groups: dict) -> None:
    """A TP rank > 0 of an engine: receives its weight shards and mirrors every step its lead plans
    (megarl.sampler.tensor_parallel); the lead does the scheduling, rewards and queue, and sends the
    stop when its loop ends."""
    from megarl.sampler.tensor_parallel import run_follower

    engine = builtin_engine(cfg, topo, model_dir, tp_group)
    stopped = threading.Event()
    receiver = weight_receiver(cfg, topo, store, engine, lambda version, tensors, extra: engine.stage_weights(
        tensors, version), stopped.is_set, groups)
    if incarnation() > 0:  # a replacement engine's lead asks to join once every rank receives (SamplerLoop)
        store.set(engine_ready_key(topo.rank, incarnation()), "1")
    try:
        run_follower(engine, tp_group, run_secret(), should_stop=lambda: receiver.error is not None, timeout_s=cfg.dist.timeout_s)
        if receiver.error is not None:
            raise RuntimeError(f"sampler {topo.role_rank}: weight receiver failed") from receiver.error
    finally:
        stopped.set()
        receiver.join(cfg.publish.timeout_s)
