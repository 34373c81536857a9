"""fault.on_failure: which policy a run's sampler faults get (`auto` resolved), and the one line that says so.

`auto` (the default) is `replace` wherever the restart limit allows a replacement and `stop` elsewhere; a learner
fault stops the run under both (docs/faults.md). load_config resolves it, so every process of a run (and the
config.yaml saved with it) holds the policy in force, never `auto`. Pure functions of the config.
"""
from __future__ import annotations

POLICIES = ("auto", "stop", "restart", "replace")


def resolve(cfg) -> str:
    """The policy `cfg.fault.on_failure` (megarl.config.schema.Config) stands for: `auto` is replace wherever
    fault.max_sampler_restarts_per_hour allows a replacement, else stop; the others stand for themselves. Replace
    covers every topology: every engine, several publish parts (a pipelined learner's stages, publish.senders > 1:
    learner rank 0 forms each epoch and the other sources learn it over the learner group,
    learner_main.refresh_members), sync mode (the share of a version's batch a lost sampler owed is asked of the
    others, membership.SyncShares) and an engine spanning sampler.tp ranks (replaced whole, megarl.roles.sampler_keeper)."""
    fault = cfg.fault
    if fault.on_failure != "auto":
        return fault.on_failure
    return "replace" if fault.max_sampler_restarts_per_hour >= 1 else "stop"


def describe(cfg) -> str:
    """One line for the start of a run: what a sampler fault does under the (resolved) policy of `cfg`, and why
    not replace where a stop stands for auto."""
    fault = cfg.fault
    if fault.on_failure == "replace":
        return (f"sampler faults: replace (a dead or hung sampler is replaced while the learner trains on, at most "
                f"{fault.max_sampler_restarts_per_hour} times per sampler per hour; a learner fault stops the run)")
    if fault.on_failure == "restart":
        return (f"sampler faults: restart (every process restarts from the last checkpoint, at most "
                f"{fault.max_restarts} times)")
    if fault.max_sampler_restarts_per_hour < 1:
        return "sampler faults: stop (fault.max_sampler_restarts_per_hour=0 allows no replacement)"
    return "sampler faults: stop (fault.on_failure=stop)"
