"""A sampler rank under fault.on_failure=replace: keep its sampler running as a child process, replace it when it ends.

torchrun stops its whole worker group when any worker fails, so the sampler itself must not be one: this
process (the torchrun worker of the rank) starts the sampler as incarnation 0 of the rank (the same worker
command, MEGARL_SAMPLER_INCARNATION set), waits on it and, when it dies or the learner asks for a hung one to be
replaced (`samplers/replace/{rank}`: it is SIGKILLed first), records the cause under `samplers/dead/{rank}` and
starts the next incarnation, which joins the next membership epoch (megarl.distributed.membership). It fails,
and torchrun stops the run, when fault.max_sampler_restarts_per_hour is exceeded, or when an incarnation exits with
an error status before it sent its first group (a start-up error, which a replacement would repeat; a signal's
death, a hang, or an error after it served is a fault and replaced). A stop signal is passed to
the sampler, whose exit (and status) this process then shares; the sampler dies with this process (its
PR_SET_PDEATHSIG is SIGKILL), so nothing outlives the run.

An engine spanning several ranks (sampler.tp > 1) is one sampler: each of its ranks has a keeper, and the engine
lives and is replaced whole. The learner knows the engine by its lead's rank (heartbeat, queue, membership). When
any rank's sampler ends, the others are ended too: a follower rank's keeper records its sampler's end under its own
`samplers/dead/{rank}`, where the lead's keeper sees it, kills the lead's sampler and records the engine's end
(`samplers/dead/{lead}`, the learner's cue); every follower's keeper kills its own sampler on that record. Then
every rank starts the same next incarnation, whose TP group forms afresh (topology.engine_tp_group) and whose lead
asks to join once every rank's receiver follows the epochs. Only the lead's keeper judges an end (a start-up error,
the per-hour limit): the followers' keepers follow its record, and its exit stops the run through torchrun.

`megarl samplers remove` drains a sampler: the learner takes it out of the publish set (`samplers/removed/{rank}`
names its incarnation) and refuses its groups from then on (its running rollouts are dropped, counted lost); the
sampler exits when its receiver meets the first membership epoch that leaves it out (SamplerDropped, between two
publishes: never while it relays a broadcast to the others, which a kill at an arbitrary moment could cut). This
process then starts no other and waits, idle, for the run's end (leaving torchrun's worker group early would be an
exit torchrun has to account for; idling costs nothing).
"""
from __future__ import annotations

import collections
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

from megarl.config.schema import Config
from megarl.distributed import launch_gate
from megarl.distributed.lifetime import STOP_SIGNALS, exit_status, stop_signal
from megarl.distributed.membership import INCARNATION_ENV, SIGNALS_TO_KEEPER_ENV, dead_key, read_record, removed_key, \
    replace_key, served_key
from megarl.distributed.ranks import Topology
from megarl.roles.learner_main import STOP_KEY

POLL_S = 0.1
HOUR_S = 3600.0
STOP_GRACE_S = 30.0  # after the run's stop, how long a sampler may take to exit before it is killed
IDLE_POLL_S = 0.5  # a removed sampler's keeper: how often it looks for the run's end
REMOVED = "removed"  # _watch's cause for an incarnation `megarl samplers remove` took out
# A lead whose sampler failed with an error may have failed because a follower rank died under its collectives: how
# long its keeper waits for a follower's record of that, which is then the engine's cause (a signal's death, and
# whether it is a start-up error).
FOLLOWER_REPORT_S = 5.0
ENGINE_END_TIMEOUT_S = 60.0  # a follower rank's keeper: how long the lead's keeper may take to record the engine's end


def _die_with_keeper() -> None:  # in the child between fork and exec: SIGKILL, so even a stopped child goes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _die_with_keeper_deaf_to_stops() -> None:  # the same, and stop signals ignored across exec (own_session)
    _die_with_keeper()
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def how_it_ended(code: int) -> str:
    """A sampler's exit status in words."""
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with code {code}"


def over_limit(restarts: collections.deque, now: float, per_hour: int) -> bool:
    """Record a restart at `now`; True when it is more than `per_hour` within the last hour."""
    restarts.append(now)
    while restarts and restarts[0] <= now - HOUR_S:
        restarts.popleft()
    return len(restarts) > per_hour


def keep_sampler(argv: list[str], cfg: Config, topo: Topology, store, first: int = 0,
                 idle_after_removal: bool = True, own_session: bool = False) -> None:
    """Run incarnations of this sampler rank until the run ends; SystemExit with the last one's status. `first`: the
    first incarnation's number (1 for a rank `megarl samplers add` started: it joins as a replacement does).
    `idle_after_removal`: a torchrun worker stays until the run ends once its sampler is removed; the keeper
    `megarl samplers add` runs, in no worker group, leaves at once. `own_session`: the samplers start in a session
    of their own, out of reach of the terminal's signals, and ignore a stop signal sent to them all the same (SLURM's
    scancel signals every process of a job step): a sampler that acts on one stops the run, while the keeper's
    command turns it into the sampler's removal (megarl.roles.sampler_control.leave_on_signal)."""
    env = {k: v for k, v in os.environ.items() if k != launch_gate.ENV}  # this process passed the gate for it
    restarts: collections.deque = collections.deque()
    incarnation = first
    lead = topo.engine_lead  # the rank the learner knows this rank's engine by (itself at sampler.tp=1)
    followers = range(lead + 1, lead + topo.sampler_tp) if topo.rank == lead else range(0)
    while True:
        child = subprocess.Popen([sys.executable, "-m", "megarl.roles.worker", *argv],
                                 env={**env, INCARNATION_ENV: str(incarnation),
                                      **({SIGNALS_TO_KEEPER_ENV: "1"} if own_session else {})},
                                 preexec_fn=_die_with_keeper_deaf_to_stops if own_session else _die_with_keeper,
                                 start_new_session=own_session)
        cause, code = _watch(child, store, topo.rank, incarnation, lead, followers)
        if cause is None:  # the run ended (or was stopped): leave as the sampler did
            raise SystemExit(code)
        if cause == REMOVED:
            print(f"megarl: sampler {topo.role_rank} (rank {topo.rank}) removed (megarl samplers remove): incarnation "
                  f"{incarnation} stopped, no replacement", flush=True)
            raise SystemExit(idle_until_run_ends(store) if idle_after_removal else 0)
        if topo.rank != lead:  # a follower rank: the engine ends and is replaced whole, as its lead's keeper records
            engine_end = follow_engine_end(store, topo, incarnation, cause, code)
            incarnation += 1
            print(f"megarl: sampler {topo.role_rank} (rank {topo.rank}), TP rank {topo.engine_tp_rank} of the engine "
                  f"led by rank {lead}: {engine_end}; starting replacement {incarnation}", flush=True)
            continue
        if code > 0 and followers:  # maybe the consequence of a follower's end: its cause is the engine's
            cause, code = follower_end(store, followers, incarnation, FOLLOWER_REPORT_S) or (cause, code)
        # Recorded first, as for every end: the learner drops it at once where its keeper's exit ends no run (an
        # added sampler's keeper runs outside torchrun's worker group).
        store.set(dead_key(topo.rank), json.dumps({"incarnation": incarnation, "cause": cause, "code": code}))
        if code > 0 and not served(store, topo.rank, incarnation):
            raise SystemExit(f"megarl: sampler {topo.role_rank} (rank {topo.rank}) {cause} before it sent its first "
                             f"group: not replaced (a start-up error, which a replacement would repeat; its error "
                             f"is above)")
        if over_limit(restarts, time.monotonic(), cfg.fault.max_sampler_restarts_per_hour):
            raise SystemExit(f"megarl: sampler {topo.role_rank} (rank {topo.rank}) {cause}: {len(restarts)} ends "
                             f"within an hour, over fault.max_sampler_restarts_per_hour="
                             f"{cfg.fault.max_sampler_restarts_per_hour}, so the run stops")
        if stop_signal() is not None:  # the run is stopping: no replacement
            raise SystemExit(exit_status(stop_signal()))
        incarnation += 1
        print(f"megarl: sampler {topo.role_rank} (rank {topo.rank}) {cause}; starting replacement {incarnation}",
              flush=True)


def follower_end(store, followers: range, incarnation: int, wait_s: float = 0.0) -> tuple[str, int] | None:
    """A lead's keeper: (cause, status) of the first follower rank of its engine whose keeper recorded the end of
    `incarnation`, as the engine's cause; None if none did (within `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while True:
        for rank in followers:
            record = read_record(store, dead_key(rank))
            if record is not None and record["incarnation"] == incarnation:
                return (f"lost its TP rank {rank - followers.start + 1} (rank {rank}), which {record['cause']}",
                        record["code"])
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)


def follow_engine_end(store, topo: Topology, incarnation: int, cause: str, code: int,
                      timeout_s: float = ENGINE_END_TIMEOUT_S) -> str:
    """A follower rank's keeper, its sampler ended (`cause`, `code`): record that for the lead's keeper unless the
    lead's record of the engine's end came first, then wait for that record; its cause. SystemExit on a stop signal
    or the run's end meanwhile (the lead's keeper stops the run where it does not replace the engine), or when no
    record comes within `timeout_s`."""
    lead, deadline = topo.engine_lead, time.monotonic() + timeout_s
    if _engine_end(store, lead, incarnation) is None:
        store.set(dead_key(topo.rank), json.dumps({"incarnation": incarnation, "cause": cause, "code": code}))
    while (ended := _engine_end(store, lead, incarnation)) is None:
        if stop_signal() is not None:
            raise SystemExit(exit_status(stop_signal()))
        if store.check([STOP_KEY]):
            raise SystemExit(0)
        if time.monotonic() >= deadline:
            raise SystemExit(f"megarl: sampler {topo.role_rank} (rank {topo.rank}) {cause}, and the keeper of its "
                             f"engine's lead (rank {lead}) recorded no end of incarnation {incarnation} within "
                             f"{timeout_s:.0f}s: the engine cannot be replaced whole, so the run stops")
        time.sleep(POLL_S)
    return f"its engine ended (its lead's keeper: {ended[0]})"


def served(store, rank: int, incarnation: int) -> bool:
    """Has this incarnation sent a group? One that exits with an error before that failed at start-up (a bad
    setting, a model that does not fit, a server that does not start), which replacing it would only repeat."""
    return read_record(store, served_key(rank)) == incarnation


def removal_of(store, rank: int, incarnation: int) -> bool:
    """Has the learner taken this incarnation out for `megarl samplers remove`?"""
    record = read_record(store, removed_key(rank))
    return record is not None and record.get("incarnation") == incarnation


def idle_until_run_ends(store, poll_s: float = IDLE_POLL_S) -> int:
    """A removed sampler's rank: wait for the run's stop flag or a stop signal; the status to exit with. No bound:
    the run's end (or torchrun's stop) ends it, as for every other rank."""
    while True:
        if stop_signal() is not None:
            return exit_status(stop_signal())
        if store.check([STOP_KEY]):
            return 0
        time.sleep(poll_s)


def _watch(child: subprocess.Popen, store, rank: int, incarnation: int, lead: int | None = None,
           followers: range = range(0)) -> tuple[str | None, int]:
    """Wait for this incarnation to end: (why, None when the run ended or a stop signal ended it; the status
    this rank then exits with). With sampler.tp > 1 the engine ends with any of its ranks: a lead's sampler is
    killed when a `followers` rank's keeper records its end, a follower's when the `lead`'s keeper records the
    engine's (the cause is then that record's)."""
    lead = rank if lead is None else lead
    stop_seen, forwarded, killed = None, False, False
    while True:
        code = child.poll()
        if code is not None:
            # The stop signal may reach the sampler before this process forwards it (a terminal's Ctrl-C reaches
            # the whole process group): its exit is the run's stop then, not a failure, at start-up as later.
            stopped = forwarded or stop_signal() is not None
            if not stopped and stop_seen is None and removal_of(store, lead, incarnation):
                return REMOVED, code  # it left on the first epoch that leaves it out (SamplerDropped)
            if stopped:
                return None, exit_status(-code) if code < 0 else code
            if killed or code == 0 or stop_seen is not None or store.check([STOP_KEY]):
                return None, 0  # the run is over; a sampler killed for lingering after it is no failure
            return how_it_ended(code), code
        if stop_signal() is not None and not forwarded:  # torchrun's stop: the sampler stops the usual way
            child.send_signal(stop_signal())
            forwarded = True
        if stop_seen is None and store.check([STOP_KEY]):
            stop_seen = time.monotonic()
        if stop_seen is not None and time.monotonic() - stop_seen > STOP_GRACE_S and not killed:
            killed = True
            child.kill()  # the run is over and it has not left: a replacement still starting, or a stuck one
        request = read_record(store, replace_key(rank))
        if request is not None and request["incarnation"] == incarnation:
            child.kill()  # hung (maybe stopped): SIGKILL ends it either way
            child.wait()
            return f"hung ({request['cause']})", child.returncode
        ended = follower_end(store, followers, incarnation) if rank == lead else \
            _engine_end(store, lead, incarnation)
        if ended is not None and stop_seen is None:
            child.kill()  # its engine lost a rank: it cannot go on without it (and may be stuck in a collective)
            child.wait()
            return ended
        time.sleep(POLL_S)


def _engine_end(store, lead: int, incarnation: int) -> tuple[str, int] | None:
    """A follower rank's keeper: the (cause, status) its engine's lead's keeper recorded for `incarnation`, if any."""
    record = read_record(store, dead_key(lead))
    if record is None or record["incarnation"] != incarnation:
        return None
    return record["cause"], record.get("code", 0)
