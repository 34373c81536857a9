"""fault.on_failure: which policy a run's sampler faults get (`auto` resolved), and the one line that says so.

`auto` (the default) is `replace` wherever membership epochs cover the topology and `stop` elsewhere; a learner
fault stops the run under both (docs/faults.md). load_config resolves it, so every process of a run (and the
config.yaml saved with it) holds the policy in force, never `auto`. Pure functions of the config.
"""
from __future__ import annotations

POLICIES = ("auto", "stop", "restart", "replace")


# What replace needs (docs/faults.md): an engine spanning sampler ranks ends with any one of them. (Covered: several
# publish parts, a pipelined learner's stages or publish.senders > 1: learner rank 0 forms each epoch and the other
# sources learn it over the learner group, each building its part's group of the same members
# (learner_main.refresh_members); sync mode: the share of a version's batch a lost sampler owed is asked of the
# others (membership.SyncShares).)
REPLACE_NEEDS = {"sampler.tp": 1}


def _value(cfg, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def replace_blockers(cfg) -> list[str]:
    """The keys of `cfg` (megarl.config.schema.Config) whose values replace does not cover, in REPLACE_NEEDS'
    order; empty when a sampler can be replaced."""
    return [key for key, need in REPLACE_NEEDS.items() if _value(cfg, key) != need]


def resolve(cfg) -> str:
    """The policy `cfg.fault.on_failure` stands for: `auto` is replace when nothing blocks it and
    fault.max_sampler_restarts_per_hour allows a replacement, else stop; the others stand for themselves."""
    fault = cfg.fault
    if fault.on_failure != "auto":
        return fault.on_failure
    return "replace" if not replace_blockers(cfg) and fault.max_sampler_restarts_per_hour >= 1 else "stop"


def describe(cfg) -> str:
    """One line for the start of a run: what a sampler fault does under the (resolved) policy of `cfg`, and why
    not replace where the topology rules it out."""
    fault = cfg.fault
    if fault.on_failure == "replace":
        return (f"sampler faults: replace (a dead or hung sampler is replaced while the learner trains on, at most "
                f"{fault.max_sampler_restarts_per_hour} times per sampler per hour; a learner fault stops the run)")
    if fault.on_failure == "restart":
        return (f"sampler faults: restart (every process restarts from the last checkpoint, at most "
                f"{fault.max_restarts} times)")
    blockers = replace_blockers(cfg)
    if blockers:
        settings = ", ".join(f"{key}={_value(cfg, key)}" for key in blockers)
        return f"sampler faults: stop (replace does not support {settings})"
    if fault.max_sampler_restarts_per_hour < 1:
        return "sampler faults: stop (fault.max_sampler_restarts_per_hour=0 allows no replacement)"
    return "sampler faults: stop (fault.on_failure=stop)"
