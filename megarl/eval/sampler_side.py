"""When a sampler rank evaluates, and where its results go (the sampler loop calls `before_step` at every step
boundary).

Exactness by construction: an evaluation runs on an engine pinned to the due version, so every token it
generates is of that version whatever the sampler's own engine does meanwhile. How the version is held depends
on how the engine receives versions:

- the built-in engine stages them (`staged`): the pin is a second engine over the same weight tensors
  (BuiltinEngine.pinned: its own KV cache and seeded generator), made at the step boundary where the due
  version becomes current. The evaluation then moves by pinned-engine steps (`ShareRun.advance`) between
  the training steps, on the sampler's spare capacity first: at every turn of the sampler loop where the
  training engine has nothing to do (its staleness budget spent: the learner is the slow side), and once
  every EVAL_STEP_EVERY turns while it decodes, so an evaluation also ends on a sampler that is the slow
  side. The training engine keeps generating and applies every version the learner publishes, so neither
  the learner's publish nor training generation waits for an evaluation. The price is memory: a pinned
  version's weights stay alive until its evaluation ends, one weight copy more than the training engine's
  own (current + staged) once it has moved on, at most MAX_PINNED of them; a due version that would pin one
  more first finishes the oldest evaluation, with training generation paused for that long (every_steps
  small against an evaluation's length; the demo never does).
  Versions are applied here, from one snapshot of what is staged (a due one is applied first, exactly that
  one), rather than by the engine's step, so a due version staged between two looks is never skipped over;
  a due version this engine never ran (the staging buffer, which keeps two, dropped it while one step ran)
  is reported as missed, never scored with other weights.
- an HTTP engine (SGLang, vLLM) has its server updated by another thread (the weight follower or
  receiver), which calls `hold_update` first: while the server's version is due and not yet evaluated,
  that thread waits, so the server cannot leave the version while eval requests run on it (a view of
  the engine with its own request threads: request_pool.pinned_view). The evaluation runs to completion at
  the step boundary, and the learner's publish waits with the held update (the update is a collective with
  the learner's broadcast): that is the cost (docs/eval.md).

Either way the share's result checks every token's recorded version and raises rather than report a mixed
score.

A replacement sampler (fault.on_failure=replace) evaluates nothing until it joins at version V (`join`): its
share of every due version before V that its predecessor did not post is posted as missed (no engine of that
share ran it whole), so the learner reports those versions as missed instead of waiting for them.
Results travel through the run's store (`result_key`): the learner's lead collects every share
(megarl/eval/learner_side.py); the per-sample records, with every token's version, go to
run.dir/eval_samples.jsonl.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Callable

from megarl.eval.run import ENV_WAIT_S, ShareRun, eval_batch, eval_seed, run_share
from megarl.eval.sets import build_sets, due_versions
from megarl.observe.jsonl import JsonlAppender

SAMPLES_FILE = "eval_samples.jsonl"
HOLD_POLL_S = 0.2  # how often a held update looks at should_stop
# Evaluations of a built-in engine in progress at once, each holding its version's weights (one copy each once the
# training engine has moved on): a due version beyond them first finishes the oldest one.
MAX_PINNED = 2
# While the training engine has work, an evaluation moves one step per this many of the sampler's turns (the training
# engine steps at every turn); with none, at every turn.
EVAL_STEP_EVERY = 4


def result_key(version: int, share: int) -> str:
    return f"eval/{version}/{share}"


class VersionEvaluator:
    """One engine lead's evaluations: share `share` of `shares` of every due version."""

    def __init__(self, cfg, store, tokenizer, share: int, shares: int, first_version: int, staged: bool = True,
                 joined: bool = True):
        self.cfg, self.store, self.tokenizer, self.share, self.shares = cfg, store, tokenizer, share, shares
        self.staged = staged  # the engine stages versions (built-in); else another thread updates its server
        self.sets = build_sets(cfg)
        self.pending = sorted(due_versions(cfg, first_version))  # changed under `evaluated`, read by hold_update
        self.joined = joined  # a replacement's evaluator waits for `join`
        self.evaluated = threading.Condition()
        self.held = 0  # updates that waited in hold_update for the version being evaluated
        self.running: list[tuple[ShareRun, int]] = []  # built-in: evaluations in progress, oldest first, each with
        # `applied` when it was pinned
        self.applied = 0  # versions this evaluator applied to the engine
        self.turns = 0  # sampler turns with an evaluation in progress
        self.samples = JsonlAppender(Path(cfg.run.dir) / SAMPLES_FILE)

    def before_step(self, engine, between_steps: Callable[[], None]) -> None:
        """At a step boundary, on the stepping thread: apply what is staged (the oldest due version among
        them, else the newest, from one snapshot, so a due version staged meanwhile is seen next time rather
        than skipped), pin the current version if it is due, and move the oldest evaluation in progress by
        one step. The caller's next step must not apply staged versions itself:
        `engine.step(apply_staged=False)`. An HTTP engine's version is the server's, held by `hold_update`
        while it is due, and its evaluation runs to completion here. `between_steps` runs between the steps of
        an evaluation run to completion (the sampler beats its heartbeat there)."""
        if not self.joined:
            return  # a replacement runs no version of the run before it joins
        if self.staged and engine.staged_versions():
            before = engine.version
            engine.apply_staged(self.next_version(engine))
            self.applied += 1
            for version in [v for v in self.pending if v < engine.version and v not in self._running_versions()]:
                self._post(version, {"missed": f"sampler engine {self.share} never ran version {version}: it went "
                                               f"from {before} to {engine.version} (the staging buffer keeps two "
                                               f"versions; more arrived during one step)"})
        if engine.version in self.pending and engine.version not in self._running_versions():
            if not self.staged:
                result = run_share(*self._share_run_args(engine), between_steps)
                with self.evaluated:
                    held = self.held
                self._post_result(result, held)
                return
            while len(self.running) >= MAX_PINNED:
                self._finish_oldest(between_steps)
            self.running.append((ShareRun(*self._share_run_args(engine)), self.applied))
        if self.running:
            run, _ = self.running[0]
            self.turns += 1
            # Spare capacity first: every turn while the training engine has nothing to do (its staleness budget
            # spent), one turn in EVAL_STEP_EVERY while it decodes, so an evaluation ends on a saturated sampler too.
            if engine.num_unfinished == 0 or self.turns % EVAL_STEP_EVERY == 0:
                if not run.advance() and not run.done and engine.num_unfinished == 0:
                    run.wait_environment(ENV_WAIT_S / 4)  # nothing else to do: do not spin while a tool runs
            if run.done:
                self._finish_oldest(between_steps)

    @property
    def evaluating(self) -> bool:
        """An evaluation is in progress: the sampler loop must keep turning even with nothing to train."""
        return bool(self.running)

    def _running_versions(self) -> list[int]:
        return [run.version for run, _ in self.running]

    def _share_run_args(self, engine) -> tuple:
        pinned = engine.pinned(max_running=eval_batch(self.cfg), seed=eval_seed(self.cfg.eval.seed, self.share))
        return pinned, self.tokenizer, self.sets, self.cfg, self.share, self.shares

    def _finish_oldest(self, between_steps: Callable[[], None]) -> None:
        """Run the oldest evaluation in progress to its end (at once when it is done) and post it."""
        run, applied_at_pin = self.running.pop(0)
        try:
            result = run.finish(between_steps)
        finally:
            run.close()
        self._post_result(result, self.applied - applied_at_pin)

    def next_version(self, engine) -> int:
        """The version the engine's next step decodes under: what `before_step` applies (the oldest due
        version staged, else the newest staged), else the current one."""
        staged = engine.staged_versions() if self.staged else []
        due = [v for v in staged if v in self.pending]
        return due[0] if due else staged[-1] if staged else engine.version

    def hold_update(self, version_now: int, should_stop: Callable[[], bool]) -> None:
        """HTTP engines, on the thread that updates the server, before an update leaves `version_now`: wait
        while that version is due and not yet evaluated (or until `should_stop`). No-op for staged engines."""
        if self.staged or not self.joined:  # a replacement's server leaves its base weights for the join version
            return
        with self.evaluated:
            if version_now not in self.pending:
                return
            self.held += 1
            while version_now in self.pending and not should_stop():
                self.evaluated.wait(HOLD_POLL_S)

    def join(self, version: int) -> None:
        """A replacement joined at `version` (the first it receives): post its share of every due version before
        it that has no result as missed, and evaluate the due versions from it on."""
        with self.evaluated:
            for old in [v for v in self.pending if v < version]:
                if not self.store.check([result_key(old, self.share)]):
                    self.store.set(result_key(old, self.share), json.dumps(
                        {"missed": f"sampler engine {self.share} was replaced before it evaluated version {old} "
                                   f"(its replacement joined at version {version})"}))
                self.pending.remove(old)
            self.joined = True
            self.evaluated.notify_all()

    def _post_result(self, result: dict, publishes_during: int) -> None:
        """Post a share's result: `publishes_during` is the versions the training engine applied while it ran
        (built-in) or the updates that waited for it (HTTP), the evidence that the pin held under live publishes."""
        version = result["version"]
        result["publishes_during"] = publishes_during
        self.samples.append(*({"eval_version": version, "share": self.share, **r} for r in result["records"]))
        compact = [{k: r[k] for k in ("set", "prompt_index", "greedy", "reward", "reward_error", "tokens",
                                      "finish_reason", "turns", "source") if k in r} for r in result["records"]]
        self._post(version, {**result, "records": compact})

    def _post(self, version: int, payload: dict) -> None:
        self.store.set(result_key(version, self.share), json.dumps(payload))
        with self.evaluated:
            self.pending.remove(version)
            self.held = 0
            self.evaluated.notify_all()

    def close(self) -> None:
        for run, _ in self.running:
            run.close()
        self.samples.close()
