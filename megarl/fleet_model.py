"""A discrete-event model of an RL fleet: what N GPUs generate and train per second under synchronous
RL and under Pipeline RL, how busy each role is, and how stale the trained data gets.

It answers what a run on a few CPU cores cannot: how a 1024-GPU fleet should be split between
samplers and learners, and what Pipeline RL buys over the synchronous baseline there. The
simulator is pure (parameters and a seed in, timelines and metrics out); `calibrate(run_dir)` and
`measured_summary(run_dir)` read a measured megarl run (metrics.jsonl, rollouts.jsonl, the timeline
written by megarl/observe/timeline.py). benchmarks/fleet_model.py does the tables, plots, printing.

The model
  * Sampler engine, one per sampler GPU: continuous batching with `max_running` slots. A decode step
    gives every running request one token and takes step_s(b) = a + c*b for b running requests, so
    an engine's b / (a + c*b) tokens/s saturates at 1/c. A waiting request takes a freed slot at the
    next step, whose cost grows by c for it; its prefill yields its first token, each step one more,
    and it ends when its sampled length is reached (megarl's built-in engine works step for step
    this way; see `replay_engine_steps`). Between two request finishes the batch, and so the step
    time, is constant, so an engine jumps from one finish to the next instead of stepping token by
    token: events scale with requests, not tokens (~100k requests per second of CPU).
  * Learner, L GPUs data-parallel: an optimizer step over T trained tokens (prompt + completion)
    takes train_step_s + train_token_s * T / L; then the weights are published to the samplers in
    publish_bytes / publish_bytes_per_s + publish_latency_s * ceil(log2(1 + receivers)) (a pipelined
    broadcast: the bandwidth term does not grow with receivers, its start-up does, with tree depth).
  * sync: every sampler starts its share of one batch of B samples under version v; the learner waits
    for the last group, trains `epochs` optimizer steps on it, publishes v+1; then the next batch.
  * pipeline: each sampler keeps starting groups while it has fewer than
    ceil((max_lag + 1) * (B / G) / S) outstanding (started, not yet retired by the learner: megarl's
    staleness budget, reported back with every publish); each sampler sends its finished groups in
    megarl's algo.queue_order (megarl/rollout/send_order.py: "deadline", "start" or "finish", decided by
    the same function from what the engine knows: its version and its groups retired); the learner
    takes them first come first served, drops a group whose oldest token is more than max_lag versions
    old (algo.stale "drop_group"; under "mask_tokens" it trains the group and counts those tokens masked,
    dropping only a group whose every token is that old), trains one step per B samples and publishes;
    each engine finishes its current decode step, stalls swap_stall_s and goes on with its requests in
    flight under the new version.
  * Every random draw (output lengths, train-time jitter) comes from one numpy Generator seeded by
    `seed`: a run is a pure function of its parameters and seed.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import json
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megarl.config.schema import STALE_POLICIES
from megarl.observe.sinks import train_records
from megarl.observe.timeline import load_timeline
from megarl.rollout.send_order import ORDERS, Unsent, groups_to_send

Z99 = 2.3263478740408408  # standard normal 99th percentile


# ---------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class EngineModel:
    step_base_s: float  # a: a decode step's cost at any batch (weights read, launches, scheduling)
    step_per_seq_s: float  # c: added per running request (its KV-cache read, sampling)
    max_running: int

    def step_s(self, batch: float) -> float:
        return self.step_base_s + self.step_per_seq_s * batch

    def tokens_per_s(self, batch: float) -> float:
        return batch / self.step_s(batch)


@dataclass(frozen=True)
class LogNormalLengths:
    """Output lengths ~ lognormal with the given mean and 99th percentile, rounded, in [1, cap]."""
    mean: float
    p99: float
    cap: int

    def mu_sigma(self) -> tuple[float, float]:
        # mean = exp(mu + s^2/2), p99 = exp(mu + z*s)  =>  s^2/2 - z*s + ln(p99/mean) = 0; the smaller root.
        r = math.log(self.p99 / self.mean)
        if r <= 0 or Z99 * Z99 < 2 * r:
            raise ValueError(f"no lognormal has mean {self.mean} and p99 {self.p99} (need mean < p99 <= ~15 x mean)")
        sigma = Z99 - math.sqrt(Z99 * Z99 - 2 * r)
        return math.log(self.mean) - sigma * sigma / 2, sigma

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mu, sigma = self.mu_sigma()
        return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, self.cap).astype(np.int64)


@dataclass(frozen=True)
class EmpiricalLengths:
    """Output lengths resampled from measured ones (e.g. a run's rollouts.jsonl)."""
    values: tuple[int, ...]

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.choice(np.asarray(self.values, dtype=np.int64), n)


@dataclass(frozen=True)
class FleetParams:
    engine: EngineModel
    lengths: LogNormalLengths | EmpiricalLengths
    batch_samples: int  # B: samples per optimizer step (both modes)
    group_size: int  # G: samples per prompt; a group is trained or dropped whole
    prompt_tokens: float  # trained along with every completion
    train_token_s: float  # learner seconds per trained token on one GPU
    train_step_s: float  # learner seconds per optimizer step on top (optimizer, gradient all-reduce)
    publish_bytes: float
    publish_bytes_per_s: float
    publish_latency_s: float  # per level of the broadcast tree
    swap_stall_s: float = 0.0  # pipeline: an engine's pause to swap in new weights
    ingest_s: float = 0.0  # learner: from a batch's last group arriving to training on it
    log_s: float = 0.0  # learner: bookkeeping after a publish before it takes the next batch
    resume_s: float = 0.0  # sync: from a publish to the samplers starting the next batch
    # Multipliers (mean 1) of the train time, one drawn per optimizer step: a measured run's spread.
    # It matters where the staleness budget is tight: a slow step lets the samplers run out of budget.
    train_jitter: tuple[float, ...] = ()
    epochs: int = 1  # sync: optimizer steps on each generated batch (K)
    max_lag: int = 4  # pipeline: a token more versions old is stale
    queue_order: str = "deadline"  # pipeline: which finished groups a sampler sends when (send_order.ORDERS)
    stale: str = "drop_group"  # pipeline: what the learner does with stale tokens (megarl's algo.stale)

    def __post_init__(self):
        if self.batch_samples % self.group_size:
            raise ValueError(f"batch_samples={self.batch_samples} is not a multiple of group_size={self.group_size}")
        if self.epochs < 1 or self.max_lag < 0 or self.engine.max_running < 1:
            raise ValueError(f"need epochs >= 1, max_lag >= 0, max_running >= 1: {self}")
        if self.queue_order not in ORDERS:
            raise ValueError(f"queue_order={self.queue_order!r} must be one of {ORDERS}")
        if self.stale not in STALE_POLICIES:
            raise ValueError(f"stale={self.stale!r} must be one of {STALE_POLICIES}")

    def train_s(self, tokens: float, learners: int, epochs: int = 1) -> float:
        return epochs * (self.train_step_s + self.train_token_s * tokens / learners)

    def publish_s(self, receivers: int) -> float:
        return (self.publish_bytes / self.publish_bytes_per_s
                + self.publish_latency_s * math.ceil(math.log2(1 + receivers)))


# ---------------------------------------------------------------------------------------- simulator
@dataclass
class StepRecord:
    end: float  # publish end: the new version is out
    samples: int
    completion_tokens: int
    lag_max: int  # versions between the learner and the oldest trained token of a trained group
    lag_mean: float
    masked_tokens: int = 0  # stale completion tokens given no policy gradient (stale="mask_tokens")


@dataclass
class SimResult:
    mode: str
    samplers: int
    learners: int
    gpus: int  # samplers (+ learners unless colocated)
    peak_tokens_per_s: float  # one engine's at max_running
    segments: np.ndarray  # [n, 4]: engine, start, end, tokens; one row per constant-batch stretch
    spans: list[tuple[str, float, float]]  # learner: ("train" | "publish", start, end)
    steps: list[StepRecord]
    group_size: int
    drops: list[float]  # when the learner dropped a group as too stale, one entry per group
    finished_tokens: int  # sum of the lengths of every finished request
    in_flight_tokens: int  # tokens already generated by requests still running at the end


class _Engine:
    __slots__ = ("t", "steps", "running", "waiting", "fresh", "version", "token", "started", "retired", "sent",
                 "swap_steps", "swap_versions")

    def __init__(self):
        self.t = 0.0  # the engine's state is exact at this time (a step boundary)
        self.steps = 0  # decode steps done
        self.running: list[tuple[int, int]] = []  # heap of (step at which it finishes, request)
        self.waiting: deque[int] = deque()
        self.fresh = 0  # requests admitted since the last step: their prefill token comes with it
        self.version = 0
        self.token = 0  # bumped on every reschedule: older heap entries of this engine are void
        self.started = 0  # groups started / retired by the learner (pipeline budget) / sent to it
        self.retired = 0
        self.sent = 0
        # The steps after swap_steps[i] (steps done then) ran swap_versions[i]; both grow.
        self.swap_steps, self.swap_versions = [0], [0]


class _Fleet:
    def __init__(self, p: FleetParams, mode: str, samplers: int, learners: int, seed: int):
        self.p, self.mode, self.S, self.L = p, mode, samplers, learners
        self.rng = np.random.default_rng(seed)
        self.lengths: list[int] = []
        self.engines = [_Engine() for _ in range(samplers)]
        self.events: list = []
        self.seq = itertools.count()
        self.req_len: list[int] = []
        self.req_group: list[int] = []
        self.req_start: list[int] = []  # engine step at admission
        self.g_left: list[int] = []  # requests of the group still unfinished
        self.g_first: list[int] = []  # its first request (its requests are consecutive)
        self.g_version: list[int] = []  # version of its oldest token; -1 before its first admission
        self.g_tokens: list[int] = []
        self.g_engine: list[int] = []
        self.seg: list[tuple[int, float, float, int]] = []
        self.spans: list[tuple[str, float, float]] = []
        self.records: list[StepRecord] = []
        self.version = 0  # the learner's
        self.learner_busy = False
        self.learner_free_at = 0.0
        self.queue: deque[int] = deque()  # finished groups, first come first served
        self.unsent: list[list[int]] = [[] for _ in range(samplers)]  # per engine: groups started, not sent
        self.collected: list[int] = []
        self.cycle_groups: list[int] = []  # sync: the groups of the batch being generated
        self.cycle_left = 0
        self.drops: list[float] = []
        self.pending_retired = [0] * samplers
        self.step_s = p.engine.step_s
        self.group_count = p.batch_samples // p.group_size
        self.budget = math.ceil((p.max_lag + 1) * self.group_count / samplers)

    # -- engines
    def _length(self) -> int:
        if not self.lengths:
            self.lengths = self.p.lengths.sample(self.rng, 4096).tolist()[::-1]
        return self.lengths.pop()

    def _start_group(self, ei: int) -> int:
        g = len(self.g_left)
        self.g_left.append(self.p.group_size)
        self.g_first.append(len(self.req_len))
        self.g_version.append(-1)
        self.g_engine.append(ei)
        total = 0
        waiting = self.engines[ei].waiting
        for _ in range(self.p.group_size):
            n = self._length()
            total += n
            waiting.append(len(self.req_len))
            self.req_len.append(n)
            self.req_group.append(g)
            self.req_start.append(-1)
        self.g_tokens.append(total)
        return g

    def _advance(self, ei: int, e: _Engine, k: int) -> None:
        b = len(e.running)
        end = e.t + k * self.step_s(b) + self.p.engine.step_per_seq_s * e.fresh
        self.seg.append((ei, e.t, end, k * b + e.fresh))
        e.t, e.steps, e.fresh = end, e.steps + k, 0

    def _collect(self, e: _Engine) -> None:
        while e.running and e.running[0][0] <= e.steps:
            g = self.req_group[heapq.heappop(e.running)[1]]
            self.g_left[g] -= 1
            if self.g_left[g] == 0:
                self._group_done(g, e.t)

    def _admit(self, e: _Engine) -> None:
        while e.waiting and len(e.running) < self.p.engine.max_running:
            r = e.waiting.popleft()
            heapq.heappush(e.running, (e.steps + self.req_len[r] - 1, r))
            e.fresh += 1
            self.req_start[r] = e.steps
            g = self.req_group[r]
            if self.g_version[g] < 0:  # versions only grow: the first admission holds the oldest token
                self.g_version[g] = e.version

    def _schedule(self, ei: int, e: _Engine) -> None:
        e.token += 1
        if e.running:
            k = e.running[0][0] - e.steps
            heapq.heappush(self.events, (e.t + k * self.step_s(len(e.running)), next(self.seq), ei, e.token))

    def _refill(self, ei: int, e: _Engine) -> None:
        if self.mode == "pipeline":
            while e.started - e.retired < self.budget:
                self.unsent[ei].append(self._start_group(ei))
                e.started += 1

    def _on_engine(self, ei: int) -> None:
        e = self.engines[ei]
        self._advance(ei, e, e.running[0][0] - e.steps)
        self._collect(e)
        self._refill(ei, e)
        self._admit(e)
        self._schedule(ei, e)

    def _swap_in(self, ei: int, now: float) -> None:
        """Pipeline: the new version reaches engine `ei` at `now`; it finishes the step in progress,
        stalls, and goes on with everything in flight."""
        e = self.engines[ei]
        if e.running:
            k = e.running[0][0] - e.steps
            j = min(k, max(0, math.ceil((now - e.t) / self.step_s(len(e.running)) - 1e-9)))
            if j:
                self._advance(ei, e, j)
            self._collect(e)
            e.t += self.p.swap_stall_s
        else:
            e.t = max(e.t, now)
        e.version = self.version
        e.swap_steps.append(e.steps)
        e.swap_versions.append(self.version)
        e.retired += self.pending_retired[ei]
        self.pending_retired[ei] = 0
        self._send_due(ei)  # a new version and retired groups: held groups may be due
        self._refill(ei, e)
        self._admit(e)
        self._schedule(ei, e)

    # -- learner
    def _group_done(self, g: int, now: float) -> None:
        if self.mode == "sync":
            self.cycle_left -= 1
            if self.cycle_left == 0:
                self._train(now, self.cycle_groups, self.p.epochs)
        else:
            self._send_due(self.g_engine[g])
            self._try_train(now)

    def _send_due(self, ei: int) -> None:
        """Engine `ei` sends the finished groups its queue order lets go now (a group not yet admitted
        will be at the engine's version or later)."""
        e, unsent = self.engines[ei], self.unsent[ei]
        due = groups_to_send([Unsent(self.g_left[g] == 0, self.g_version[g] if self.g_version[g] >= 0 else e.version)
                              for g in unsent], self.p.queue_order, e.sent - e.retired, e.version,
                             self.group_count / self.S, self.p.max_lag)
        if due:
            self.queue.extend(unsent[i] for i in due)
            sent = set(due)
            self.unsent[ei] = [g for i, g in enumerate(unsent) if i not in sent]
            e.sent += len(due)

    def _try_train(self, now: float) -> None:
        if self.learner_busy:
            return
        while self.queue and len(self.collected) < self.group_count:
            g = self.queue.popleft()
            if self.version - self.g_version[g] > self.p.max_lag and (
                    self.p.stale == "drop_group" or self._stale_tokens(g) == self.g_tokens[g]):
                self.drops.append(now)
                self.pending_retired[self.g_engine[g]] += 1
            else:
                self.collected.append(g)
        if len(self.collected) == self.group_count:
            batch, self.collected = self.collected, []
            self._train(max(now, self.learner_free_at), batch, 1)

    def _stale_tokens(self, g: int) -> int:
        """Tokens of group `g` sampled more than max_lag versions before the learner's version. Token i of a
        request admitted when its engine had done s0 steps comes with step s0 + max(i, 1) (its prefill token
        with the first), and step j runs the version its engine held after j - 1 steps."""
        e = self.engines[self.g_engine[g]]
        fresh_from = bisect.bisect_left(e.swap_versions, self.version - self.p.max_lag)
        cut = e.swap_steps[fresh_from] if fresh_from < len(e.swap_steps) else math.inf  # steps up to it: stale
        first = self.g_first[g]
        return sum(0 if cut <= self.req_start[r] else min(self.req_len[r], cut - self.req_start[r] + 1)
                   for r in range(first, first + self.p.group_size))

    def _train(self, now: float, batch: list[int], epochs: int) -> None:
        completion = sum(self.g_tokens[g] for g in batch)
        samples = len(batch) * self.p.group_size
        start = now + self.p.ingest_s
        trained = self.p.train_s(completion + samples * self.p.prompt_tokens, self.L, epochs)
        if self.p.train_jitter:
            trained *= self.p.train_jitter[int(self.rng.integers(len(self.p.train_jitter)))]
        published = start + trained + self.p.publish_s(self.S)
        self.spans += [("train", start, start + trained), ("publish", start + trained, published)]
        lags = [self.version - self.g_version[g] for g in batch]
        masked = 0
        if self.p.stale == "mask_tokens" and max(lags) > self.p.max_lag:
            masked = sum(self._stale_tokens(g) for g in batch)
            lags = [min(lag, self.p.max_lag) for lag in lags]  # the oldest token trained
        self.records.append(StepRecord(published, samples, completion, max(lags), sum(lags) / len(lags), masked))
        for g in batch:
            self.pending_retired[self.g_engine[g]] += 1
        self.learner_busy = True
        heapq.heappush(self.events, (published, next(self.seq), -1, 0))

    def _on_published(self, now: float) -> None:
        self.version += 1
        self.learner_busy = False
        self.learner_free_at = now + self.p.log_s
        if self.mode == "sync":
            self._start_cycle(now + self.p.resume_s)
            return
        for ei in range(self.S):
            self._swap_in(ei, now)
        self._try_train(now)

    def _start_cycle(self, now: float) -> None:
        share, extra = divmod(self.group_count, self.S)
        self.cycle_groups, self.cycle_left = [], self.group_count
        for ei, e in enumerate(self.engines):
            e.t, e.version = max(e.t, now), self.version
            for _ in range(share + (ei < extra)):
                self.cycle_groups.append(self._start_group(ei))
            self._admit(e)
            self._schedule(ei, e)

    def run(self, steps: int, min_time_s: float) -> None:
        if self.mode == "sync":
            self._start_cycle(0.0)
        else:
            for ei, e in enumerate(self.engines):
                self._refill(ei, e)
                self._admit(e)
                self._schedule(ei, e)

        def done() -> bool:  # records[-1] is the step in training or just published
            return len(self.records) >= steps and self.records[-1].end >= min_time_s

        while not done() or self.learner_busy:
            if not self.events:
                raise RuntimeError(f"{self.mode} fleet stalled after {len(self.records)} steps: nothing in flight "
                                   f"(budget {self.budget} groups/sampler, {self.group_count} groups/step)")
            now, _, ei, token = heapq.heappop(self.events)
            if ei < 0:
                if done():
                    break  # the last step is published: the run ends here
                self._on_published(now)
            elif token == self.engines[ei].token:
                self._on_engine(ei)
        # Engines are advanced lazily; bring each to the end (finishing the step in progress) so
        # that what they generated up to the last publish is on record.
        for ei, e in enumerate(self.engines):
            if e.running and e.t < now:
                k = e.running[0][0] - e.steps
                self._advance(ei, e, min(k, math.ceil((now - e.t) / self.step_s(len(e.running)))))


def simulate(params: FleetParams, mode: str, samplers: int, learners: int, steps: int, seed: int = 0,
             colocated: bool = False, min_time_s: float = 0.0) -> SimResult:
    """Run the fleet until the learner has published `steps` versions, and for at least `min_time_s`
    (a pipeline reaches its steady state only after its longest rollouts have had time to finish).

    colocated (sync only): the learners are the sampler GPUs themselves (the usual synchronous setup),
    so the fleet is `samplers` GPUs, not samplers + learners."""
    if mode not in ("sync", "pipeline"):
        raise ValueError(f"mode={mode!r} must be 'sync' or 'pipeline'")
    if samplers < 1 or learners < 1 or steps < 1:
        raise ValueError(f"need samplers, learners, steps >= 1 (got {samplers}, {learners}, {steps})")
    if colocated and (mode != "sync" or learners != samplers):
        raise ValueError("colocated applies to sync mode with learners == samplers")
    fleet = _Fleet(params, mode, samplers, learners, seed)
    fleet.run(steps, min_time_s)
    running = {r for e in fleet.engines for _, r in e.running}
    finished = sum(n for r, n in enumerate(fleet.req_len) if fleet.req_start[r] >= 0 and r not in running)
    # a running request has its prefill token plus one per step since admission, unless it was
    # admitted after its engine's last step (fresh), whose tokens are not generated yet
    in_flight = sum(e.steps - fleet.req_start[r] + 1 for e in fleet.engines for _, r in e.running)
    in_flight -= sum(e.fresh for e in fleet.engines)
    return SimResult(mode, samplers, learners, samplers if colocated else samplers + learners,
                     params.engine.tokens_per_s(params.engine.max_running),
                     np.array(fleet.seg, dtype=np.float64).reshape(-1, 4), fleet.spans, fleet.records,
                     params.group_size, fleet.drops, finished, in_flight)


# ---------------------------------------------------------------------------------------- read-outs
def _overlap(start: np.ndarray, end: np.ndarray, t0: float, t1: float) -> np.ndarray:
    return np.clip(np.minimum(end, t1) - np.maximum(start, t0), 0.0, None)


def summarise(result: SimResult, skip_steps: int = 0) -> dict[str, float]:
    """Rates and busy fractions between the publish of step `skip_steps` (0: the start) and the last one.

    sampler_busy: share of each sampler's time spent decoding (a stall or an empty engine is idle);
    learner_busy: share of the learner's time training or publishing (megarl's timeline definition);
    gpu_busy: the fleet's GPU-seconds doing either; sampler_token_util: generated tokens against every
    sampler decoding at max_running all the time; dropped_frac: samples dropped as too stale against
    dropped + trained, in the same window; masked_token_frac: trained groups' completion tokens masked as
    stale (stale="mask_tokens") against all of them."""
    if not 0 <= skip_steps < len(result.steps):
        raise ValueError(f"skip_steps={skip_steps} must leave at least one of {len(result.steps)} steps")
    t0 = result.steps[skip_steps - 1].end if skip_steps else 0.0
    t1 = result.steps[-1].end
    wall = t1 - t0
    seg = result.segments
    decode = _overlap(seg[:, 1], seg[:, 2], t0, t1)
    generated = float((seg[:, 3] * decode / np.maximum(seg[:, 2] - seg[:, 1], 1e-12)).sum())
    spans = np.array([(s, e) for _, s, e in result.spans])
    learner = float(_overlap(spans[:, 0], spans[:, 1], t0, t1).sum())
    steps = result.steps[skip_steps:]
    sampler_gpu_s = float(decode.sum())
    trained = sum(r.samples for r in steps)
    dropped = result.group_size * sum(t0 < t <= t1 for t in result.drops)
    return {
        "steps_per_s": len(steps) / wall,
        "step_s": wall / len(steps),
        "samples_per_s": sum(r.samples for r in steps) / wall,
        "trained_tokens_per_s": sum(r.completion_tokens - r.masked_tokens for r in steps) / wall,
        "generated_tokens_per_s": generated / wall,
        "sampler_busy": sampler_gpu_s / (result.samplers * wall),
        "learner_busy": learner / wall,
        "gpu_busy": (sampler_gpu_s + learner * result.learners) / (result.gpus * wall),
        # generated tokens against every sampler decoding at max_running all the time
        "sampler_token_util": generated / (result.samplers * wall * result.peak_tokens_per_s),
        "lag_mean": float(np.mean([r.lag_mean for r in steps])),
        "lag_max": float(max(r.lag_max for r in steps)),
        "dropped_frac": dropped / (dropped + trained),
        "masked_token_frac": sum(r.masked_tokens for r in steps) / max(1, sum(r.completion_tokens for r in steps)),
    }


def engine_rates(result: SimResult, edges: np.ndarray) -> np.ndarray:
    """[samplers, len(edges) - 1]: each engine's generated tokens/s in every time bin (exact: the
    cumulative token count is piecewise linear in time, so it is interpolated at the bin edges)."""
    seg = result.segments
    rates = np.zeros((result.samplers, len(edges) - 1))
    for ei in range(result.samplers):
        own = seg[seg[:, 0] == ei]
        own = own[np.argsort(own[:, 1], kind="stable")]
        times = np.column_stack([own[:, 1], own[:, 2]]).ravel()
        done = np.cumsum(own[:, 3])
        cumulative = np.column_stack([done - own[:, 3], done]).ravel()
        if len(times):
            rates[ei] = np.diff(np.interp(edges, times, cumulative)) / np.diff(edges)
    return rates


# ---------------------------------------------------------------------------------------- calibration
def replay_engine_steps(lengths, max_running: int) -> np.ndarray:
    """Tokens produced by each step of megarl's BuiltinEngine when requests with these output lengths
    are queued at once, in this order. A step first admits waiting requests into free slots (prefill
    gives each its first token; a length-1 request ends there), then decodes one token for every
    running request. A run's timeline counts tokens per slice of steps; this recovers the steps."""
    lengths = np.asarray(lengths, dtype=np.int64)
    free = [0] * max_running  # heap: the step at which each slot can take a request
    admit = np.empty(len(lengths), dtype=np.int64)
    step = 0
    for i, n in enumerate(lengths.tolist()):
        step = max(step, heapq.heappop(free))  # first come first served
        admit[i] = step
        heapq.heappush(free, step + max(n - 2, 0) + 1)
    last = admit + np.maximum(lengths - 2, 0)  # the step that yields the request's final token
    steps = int(last.max()) + 1
    first = np.zeros(steps, dtype=np.int64)
    np.add.at(first, admit, np.minimum(lengths, 2))  # prefill token (+ the same step's decode token)
    later = np.zeros(steps + 1, dtype=np.int64)  # one token a step over admit+1 .. last: a difference array
    np.add.at(later, admit + 1, 1)
    np.add.at(later, last + 1, -1)
    return first + np.cumsum(later)[:steps]


def fit_step_time(batch: np.ndarray, step_s: np.ndarray, steps: np.ndarray) -> tuple[float, float]:
    """(a, c) of step_s ~ a + c * batch, least squares with every engine step weighted once (a slice
    of n steps at mean batch b and mean step time s counts n times). With the intercept, the fitted
    line then reproduces the measured total decode time exactly, slow outliers included: on shared
    cores those are part of what the run paid, and the runs the model is compared with paid them too."""
    x = np.column_stack([np.ones_like(batch), batch]) * np.sqrt(steps)[:, None]
    a, c = np.linalg.lstsq(x, step_s * np.sqrt(steps), rcond=None)[0]
    return float(a), float(c)


@dataclass(frozen=True)
class Calibration:
    params: FleetParams
    samplers: int
    learners: int
    steps: int
    report: dict  # what was read and how well it fitted


def _read_run(run_dir: Path) -> tuple[dict, list[dict], list[dict], dict[str, list[dict]]]:
    import yaml

    missing = [name for name in ("config.yaml", "metrics.jsonl", "rollouts.jsonl", "timeline")
               if not (run_dir / name).exists()]
    if missing:
        raise ValueError(f"{run_dir} is not a megarl run with its rollouts and timeline "
                         f"(run.log_rollouts=true run.timeline=true): missing {', '.join(missing)}")
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    metrics = train_records([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    return cfg, metrics, rollouts, load_timeline(run_dir)


def _learner_spans(timeline: dict[str, list[dict]], kind: str) -> list[dict]:
    lead = min(name for name in timeline if name.startswith("learner"))  # the lead writes the spans
    return [e for e in timeline[lead] if e["kind"] == kind]


def train_seconds_per_token(run_dir: str | Path) -> np.ndarray:
    """Per optimizer step of a run: its train span over the completion tokens it trained on."""
    _, metrics, _, timeline = _read_run(Path(run_dir))
    train = _learner_spans(timeline, "train")
    if len(train) != len(metrics):
        raise ValueError(f"{run_dir}: {len(train)} train spans but {len(metrics)} metrics rows")
    return np.array([(e["end"] - e["start"]) / m["num_tokens"] for e, m in zip(train, metrics)])


def _log_gaps(publish: list[dict], waits: list[dict]) -> list[float]:
    """The learner's bookkeeping after each publish: until it starts waiting for the next batch."""
    return [w["start"] - p["end"] for p, w in zip(publish, waits[1:])]


def calibrate(run_dir: str | Path) -> Calibration:
    """The fleet parameters a measured synchronous megarl run implies.

    Sync mode separates the phases: sampler slices between one train span and the next belong to
    one batch, whose samples rollouts.jsonl lists (trained_at_step) with their start order (group
    ids). Replaying that batch through the engine's scheduling (`replay_engine_steps`) says how many
    steps, at which batch, every decode slice holds; the slices' durations then fit a + c*batch.
    Also read: output lengths (every trained completion), train seconds per token (train spans over
    trained tokens), publish time and bytes, and the hand-off latencies between the roles."""
    run_dir = Path(run_dir)
    cfg, metrics, rollouts, timeline = _read_run(run_dir)
    algo, sampler_cfg, learner_cfg = cfg["algo"], cfg["sampler"], cfg["learner"]
    if algo["mode"] != "sync":
        raise ValueError(f"{run_dir}: calibration needs a sync-mode run (its generation phases are separable); "
                         f"this one ran algo.mode={algo['mode']}")
    train, publish = _learner_spans(timeline, "train"), _learner_spans(timeline, "publish")
    waits = _learner_spans(timeline, "wait")
    samplers = sorted(name for name in timeline if name.startswith("sampler"))
    by_step: dict[tuple[int, int], list[dict]] = {}
    for r in rollouts:
        by_step.setdefault((r["trained_at_step"], r["sampler_rank"]), []).append(r)
    batch, step_s, weight = [], [], []  # per slice: mean batch, mean step time, steps
    phases_used, phases_skipped, ingest, resume = 0, 0, [], []
    for name in samplers:
        rank = int(name.removeprefix("sampler"))
        slices = [e for e in timeline[name] if e["kind"] == "decode"]
        for i, tr in enumerate(train):
            # A phase starts once the previous step's training is over (its sampler may start before
            # the learner's publish span closes) and ends before this step's training starts.
            after = train[i - 1]["end"] if i else -math.inf
            phase = [e for e in slices if after < e["start"] < tr["start"]]
            samples = sorted(by_step.get((i, rank), []), key=lambda r: int(r["group_id"].rsplit("-g", 1)[1]))
            if not phase or not samples:
                continue
            ingest.append(tr["start"] - phase[-1]["end"])
            if i:
                resume.append(phase[0]["start"] - publish[i - 1]["end"])
            steps = np.cumsum(replay_engine_steps([len(r["token_ids"]) for r in samples], sampler_cfg["max_running"]))
            done = np.cumsum([e["tokens"] for e in phase])
            at = np.searchsorted(steps, done)  # the step each slice ends on
            if done[-1] != steps[-1] or not np.array_equal(steps[np.minimum(at, len(steps) - 1)], done):
                phases_skipped += 1  # the slices do not fall on the replayed step boundaries
                continue
            phases_used += 1
            count = np.diff(at, prepend=-1)
            tokens = np.diff(done, prepend=0)
            # A slice's time runs to the next slice's start: what happens between engine steps
            # (scoring, sending finished groups) is part of the sampler's cost per step.
            ends = np.array([e["start"] for e in phase[1:]] + [phase[-1]["end"]])
            starts = np.array([e["start"] for e in phase])
            batch += (tokens / count).tolist()
            step_s += ((ends - starts) / count).tolist()
            weight += count.tolist()
    if not phases_used:
        raise ValueError(f"{run_dir}: no generation phase matched its replayed engine steps ({phases_skipped} tried)")
    a, c = fit_step_time(np.array(batch), np.array(step_s), np.array(weight, dtype=np.float64))
    lengths = tuple(len(r["token_ids"]) for r in rollouts)
    per_token = train_seconds_per_token(run_dir)
    learners = learner_cfg["tp"] * learner_cfg["pp"] * learner_cfg["dp"]
    epochs = algo["sync_epochs"]
    # Means, not medians: the model must spend the time the run spent, its slow outliers included.
    publish_s = float(np.mean([e["end"] - e["start"] for e in publish]))
    publish_bytes = float(np.mean([m["publish_bytes"] for m in metrics]))
    last = metrics[-1]  # samplers report running totals with every group
    swap_stall = [last[f"{n}/swap_time_s"] / last[f"{n}/swaps"] for n in samplers if last.get(f"{n}/swaps")]
    log_s = _log_gaps(publish, waits)
    params = FleetParams(
        engine=EngineModel(a, c, sampler_cfg["max_running"]),
        lengths=EmpiricalLengths(lengths),
        batch_samples=algo["prompts_per_step"] * algo["group_size"], group_size=algo["group_size"],
        prompt_tokens=0.0,  # train time is fitted per completion token (the prompt's share is inside it)
        # per completion token on one of `learners` GPUs, per epoch (an epoch is one optimizer step)
        train_token_s=float(per_token.mean()) * learners / epochs, train_step_s=0.0,
        train_jitter=tuple((per_token / per_token.mean()).tolist()),
        publish_bytes=publish_bytes, publish_bytes_per_s=publish_bytes / publish_s, publish_latency_s=0.0,
        swap_stall_s=float(np.mean(swap_stall)) if swap_stall else 0.0,
        ingest_s=float(np.mean(ingest)), log_s=float(np.mean(log_s)) if log_s else 0.0,
        resume_s=max(0.0, float(np.mean(resume))) if resume else 0.0,
        epochs=epochs, max_lag=algo["max_lag"], queue_order=algo.get("queue_order", "finish"),  # older runs: finish
        stale=algo.get("stale", "drop_group"))
    report = {"phases_used": phases_used, "phases_skipped": phases_skipped, "slices": len(batch),
              "step_base_ms": a * 1e3, "step_per_seq_ms": c * 1e3,
              "tokens_per_s_at_max_running": params.engine.tokens_per_s(sampler_cfg["max_running"]),
              "length_mean": float(np.mean(lengths)), "length_p99": float(np.percentile(lengths, 99)),
              "train_ms_per_token": params.train_token_s * 1e3 / learners,
              "train_time_cv": float(per_token.std() / per_token.mean()), "publish_ms": publish_s * 1e3,
              "publish_mb": publish_bytes / 1e6, "ingest_ms": params.ingest_s * 1e3, "log_ms": params.log_s * 1e3,
              "resume_ms": params.resume_s * 1e3, "swap_stall_ms": params.swap_stall_s * 1e3}
    return Calibration(params, len(samplers), learners, len(metrics), report)


def measured_summary(run_dir: str | Path) -> dict[str, float]:
    """The figures `summarise` predicts, read from a run's timeline and metrics over the same window:
    from the first timeline event to the last learner span."""
    run_dir = Path(run_dir)
    _, metrics, _, timeline = _read_run(run_dir)
    learner = [e for name, events in timeline.items() if name.startswith("learner") for e in events]
    lead = min(name for name in timeline if name.startswith("learner"))
    slices = {name: [e for e in events if e["kind"] == "decode"] for name, events in timeline.items()
              if name.startswith("sampler")}
    t0 = min(e["start"] for events in timeline.values() for e in events)
    wall = max(e["end"] for e in learner) - t0
    return {
        "steps_per_s": len(metrics) / wall,
        "trained_tokens_per_s": sum(m["num_tokens"] for m in metrics) / wall,
        "generated_tokens_per_s": sum(e["tokens"] for s in slices.values() for e in s) / wall,
        "sampler_busy": sum(e["end"] - e["start"] for s in slices.values() for e in s) / (len(slices) * wall),
        "learner_busy": sum(e["end"] - e["start"] for e in timeline[lead] if e["kind"] != "wait") / wall,
        "length_mean": sum(m["num_tokens"] for m in metrics) / sum(m["samples/total"] for m in metrics),
        # the speeds behind them, to compare with the ones another run of the same setup measured
        "decode_tokens_per_busy_s": sum(e["tokens"] for s in slices.values() for e in s)
                                    / sum(e["end"] - e["start"] for s in slices.values() for e in s),
        "log_s": float(np.mean(_log_gaps(_learner_spans(timeline, "publish"), _learner_spans(timeline, "wait")))),
    }
