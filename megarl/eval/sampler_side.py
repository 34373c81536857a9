"""When a sampler rank evaluates, and where its results go (the sampler loop calls `before_step`).

Exactness by construction: at a step boundary, when the engine's current version is due (or a due
version is staged: it is applied first, exactly that one), the sampler runs its eval share to completion
on an engine pinned to that version (BuiltinEngine.pinned: shared weights, its own KV cache) before it
steps its own engine again. Versions that arrive meanwhile stay staged and the training requests keep
their slots; they continue, under the staged newest version, once the evaluation is done. The cost is
the evaluation's duration of this sampler's generation (measured: docs/eval.md).

While evaluation is on, versions are applied here, from one snapshot of what is staged, rather than by
the engine's step, so a due version staged between two looks is never skipped over. A due version this
engine never ran (the staging buffer, which keeps two, dropped it while a step or an evaluation ran) is
reported as missed, never scored with other weights. Results travel through the run's store
(`result_key`): the learner's lead collects every share (megarl/eval/learner_side.py); the per-sample
records, with every token's version, go to run.dir/eval_samples.jsonl.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from megarl.eval.run import eval_batch, eval_seed, run_share
from megarl.eval.sets import build_sets, due_versions
from megarl.observe.jsonl import JsonlAppender

SAMPLES_FILE = "eval_samples.jsonl"


def result_key(version: int, share: int) -> str:
    return f"eval/{version}/{share}"


class VersionEvaluator:
    """One engine lead's evaluations: share `share` of `shares` of every due version."""

    def __init__(self, cfg, store, tokenizer, share: int, shares: int, first_version: int):
        self.cfg, self.store, self.tokenizer, self.share, self.shares = cfg, store, tokenizer, share, shares
        self.sets = build_sets(cfg)
        self.pending = sorted(due_versions(cfg, first_version))
        self.samples = JsonlAppender(Path(cfg.run.dir) / SAMPLES_FILE)

    def before_step(self, engine, between_steps: Callable[[], None]) -> None:
        """At a step boundary, on the stepping thread: apply what is staged (the oldest due version among
        them, else the newest, from one snapshot, so a due version staged meanwhile is seen next time rather
        than skipped), then evaluate the current version if it is due. The caller's next step must not
        apply staged versions itself: `engine.step(apply_staged=False)`."""
        staged = engine.staged_versions()
        if staged:
            due = [v for v in staged if v in self.pending]
            before = engine.version
            engine.apply_staged(due[0] if due else staged[-1])
            for version in [v for v in self.pending if v < engine.version]:
                self._post(version, {"missed": f"sampler engine {self.share} never ran version {version}: it went "
                                               f"from {before} to {engine.version} (the staging buffer keeps two "
                                               f"versions; more arrived while a step or an evaluation ran)"})
        if engine.version in self.pending:
            self._evaluate(engine, between_steps)

    def _evaluate(self, engine, between_steps) -> None:
        version = engine.version
        before = set(engine.staged_versions())
        pinned = engine.pinned(max_running=eval_batch(self.cfg), seed=eval_seed(self.cfg.eval.seed, self.share))
        result = run_share(pinned, self.tokenizer, self.sets, self.cfg, self.share, self.shares, between_steps)
        # Versions published while it ran stayed staged: the evidence that the pin held under live publishes.
        result["publishes_during"] = len(set(engine.staged_versions()) - before)
        self.samples.append(*({"eval_version": version, "share": self.share, **r} for r in result["records"]))
        compact = [{k: r[k] for k in ("set", "prompt_index", "greedy", "reward", "reward_error", "tokens",
                                      "finish_reason")} for r in result["records"]]
        self._post(version, {**result, "records": compact})

    def _post(self, version: int, payload: dict) -> None:
        self.store.set(result_key(version, self.share), json.dumps(payload))
        self.pending.remove(version)

    def close(self) -> None:
        self.samples.close()
