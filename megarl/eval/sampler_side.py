"""When a sampler rank evaluates, and where its results go (the sampler loop calls `before_step`).

Exactness by construction: at a step boundary, when the engine's current version is due (or a due
version is staged: it is applied first, exactly that one), the sampler runs its eval share to completion
on an engine pinned to that version (BuiltinEngine.pinned: shared weights, its own KV cache) before it
steps its own engine again. Versions that arrive meanwhile stay staged and the training requests keep
their slots; they continue, under the staged newest version, once the evaluation is done. The cost is
the evaluation's duration of this sampler's generation (measured: docs/eval.md).

A due version this engine never ran (the staging buffer dropped it while an earlier evaluation held the
swap) is reported as missed, never scored with other weights. Results travel through the run's store
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

    def before_step(self, engine, between_steps: Callable[[], None]) -> bool:
        """Evaluate a due version if the engine is at it or has it staged. True: the caller's next step may
        apply staged versions; False: a version was just applied here, let a decode step run on it first
        (so two swaps never land on the same token)."""
        if not self.pending:
            return True
        staged = [v for v in engine.staged_versions() if v in self.pending]
        applied = False
        if engine.version not in self.pending and staged:
            engine.apply_staged(staged[0])
            applied = True
        for version in [v for v in self.pending if v < engine.version]:
            self._post(version, {"missed": f"sampler engine {self.share} moved from before version {version} "
                                           f"to {engine.version} while an earlier evaluation held its swaps"})
        if engine.version in self.pending:
            self._evaluate(engine, between_steps)
        return not applied

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
