"""The learner lead's side of evaluation: collect every sampler engine's share of each due version from the
store (megarl/eval/sampler_side.py posts them), summarise them into one eval record, and, at the end of
the run, wait for the last ones (eval.timeout_s) before the samplers are told to stop.

A version is reported once all its shares are in; a share that says it missed the version (its engine
never ran it) makes the version reported as missed, never as a score of fewer prompts.
"""
from __future__ import annotations

import json
import time
from typing import Callable

from megarl.eval.run import summarise
from megarl.eval.sampler_side import result_key
from megarl.eval.sets import due_versions

POLL_S = 0.2


class EvalCollector:
    def __init__(self, cfg, store, shares: int, first_version: int, first_step: int,
                 on_result: Callable[[int, int, dict], None], note: Callable[[str], None]):
        self.cfg, self.store, self.shares = cfg, store, shares
        self.pending = sorted(due_versions(cfg, first_version))
        self.set_names = [s.name for s in cfg.eval.sets]
        self.steps = {first_version: first_step}  # version -> optimizer steps trained when it was published
        self.on_result, self.note = on_result, note

    def published(self, version: int, steps_trained: int) -> None:
        self.steps[version] = steps_trained

    def poll(self, upto_version: int) -> None:
        """Report every pending version <= upto_version whose shares are all in (no waiting)."""
        for version in [v for v in self.pending if v <= upto_version]:
            keys = [result_key(version, share) for share in range(self.shares)]
            if not self.store.check(keys):
                continue
            self.pending.remove(version)
            results = [json.loads(self.store.get(key)) for key in keys]
            missed = [r["missed"] for r in results if "missed" in r]
            if missed:
                self.note(f"megarl: eval of version {version} not reported: {missed[0]}")
                continue
            metrics = summarise(results, self.set_names, self.cfg.eval.k)
            metrics["eval/publishes_during"] = float(sum(r["publishes_during"] for r in results))
            self.on_result(version, self.steps.get(version, version), metrics)

    def finish(self, last_version: int, on_wait: Callable[[], None] = lambda: None) -> None:
        """Wait (at most eval.timeout_s) for every due version up to `last_version`, reporting each;
        `on_wait` runs between polls (the lead checks the samplers' heartbeats there: a dead sampler
        ends the wait with its error)."""
        deadline = time.monotonic() + self.cfg.eval.timeout_s
        while any(v <= last_version for v in self.pending) and time.monotonic() < deadline:
            self.poll(last_version)
            on_wait()
            time.sleep(POLL_S)
        left = [v for v in self.pending if v <= last_version]
        if left:
            self.note(f"megarl: eval of version(s) {left}: no result from every sampler within "
                      f"eval.timeout_s={self.cfg.eval.timeout_s:g}s; not reported")
