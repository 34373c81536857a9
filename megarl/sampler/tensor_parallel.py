"""One built-in engine over several processes: the lead/follower protocol of a tensor-parallel engine.

This module owns how the TP ranks of one engine stay in lockstep; the sharded math is
`megarl.sampler.model` (forward with a tp_group) and the per-rank engine is `BuiltinEngine(...,
tp_group=...)`.  As in SGLang, where the scheduler on TP rank 0 broadcasts each batch to its TP
workers, one rank decides and the others repeat:

  * the lead (TP rank 0, `TPLeadEngine`) is the engine the sampler loop sees: requests are added to
    it, it picks which staged weight version to apply, and it returns the completions;
  * before each step the lead broadcasts a small plan over the TP group: the requests added since the
    last step and the version to apply at this step boundary (or none), or "stop" (`close()`);
  * each follower (`run_follower`) adds the same requests, waits until its own weight receiver has
    staged that version (each rank receives its own shards), applies exactly it, and runs the same step.

Each rank thus holds the same queue and running set and makes the same calls in the same order: the
collectives of the forward pair up, and since its all-reduces and all-gather leave the same logits on every rank,
equal seeds sample equal tokens.  A follower discards its completions (the lead's are the output).

Plans travel as megarl.distributed.wire PLAN messages (declared fields, HMAC with the run secret,
sequence-numbered), never pickle.

Every wait is bounded: a plan broadcast by `timeout_s` (TimeoutError naming the plan), a version by
`timeout_s` (TimeoutError naming the version), and the forward's all-reduces by the group's timeout.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from megarl.distributed.wire import WireError, decode_plan, encode_plan
from megarl.protocols import Completion, GenerationRequest
from megarl.sampler.engine import BuiltinEngine

# A plan is broadcast as its length (one long), then the wire message.


@dataclass
class Plan:
    """What every TP rank does at one step boundary."""

    requests: list[GenerationRequest] = field(default_factory=list)  # to add before the step, in order
    version: int | None = None  # the staged version to apply before the step
    stop: bool = False  # no step: the followers return


def _broadcast(tensor: torch.Tensor, group, timeout_s: float, what: str) -> None:
    """Broadcast from the group's rank 0, waiting at most timeout_s (async op: gloo's own wait has no
    per-call timeout otherwise).  TimeoutError naming `what` past it; RuntimeError naming `what` when a peer's
    connection failed."""
    work = dist.broadcast(tensor, group=group, group_src=0, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        if "timed out" in str(exc).lower():
            raise TimeoutError(f"tensor-parallel engine: {what} did not complete within {timeout_s:g}s: {exc}") from exc
        # Not a timeout: a peer's connection failed, typically another rank of this engine ended (under
        # fault.on_failure=replace its keeper then ends this one too, and the engine is replaced whole).
        raise RuntimeError(f"tensor-parallel engine: {what} failed (a rank of the engine ended or its connection "
                           f"broke): {exc}") from exc


def send_plan(plan: Plan, group, timeout_s: float, key: bytes, sequence: int) -> None:
    """Lead side: broadcast `plan` (the lead's `sequence`-th) to the other ranks of `group`."""
    message = encode_plan(plan.requests, plan.version, plan.stop, sequence, key)
    _broadcast(torch.tensor([len(message)], dtype=torch.long), group, timeout_s,
               "broadcasting a step plan to the followers")
    _broadcast(torch.frombuffer(bytearray(message), dtype=torch.uint8), group, timeout_s,
               f"broadcasting a plan with {len(plan.requests)} new request(s) to the followers")


def recv_plan(group, timeout_s: float, key: bytes, sequence: int) -> Plan:
    """Follower side: the next plan from the group's rank 0, which must be the lead's `sequence`-th
    (megarl.distributed.wire.WireError otherwise, or for a message that is not a valid plan)."""
    size = torch.empty(1, dtype=torch.long)
    _broadcast(size, group, timeout_s, "receiving the next step plan from the lead")
    message = torch.empty(int(size.item()), dtype=torch.uint8)
    _broadcast(message, group, timeout_s, "receiving the step plan from the lead")
    envelope, requests, version, stop = decode_plan(message.numpy().tobytes(), key)
    if envelope.sequence != sequence:
        raise WireError(f"tensor-parallel follower: plan {envelope.sequence} arrived, expected plan {sequence}")
    return Plan(requests, version, stop=stop)


class TPLeadEngine:
    """TP rank 0 of an engine: the `Engine` the sampler loop drives, mirrored on the followers.

    `engine` is this rank's `BuiltinEngine` (tp_group of the engine's ranks), `group` the group the
    plans go over (the same one, typically); this process must be its rank 0. `key` signs the plans
    (the run secret, megarl.secret).  Weights staged here are
    this rank's shards; each follower's receiver stages its own.
    """

    def __init__(self, engine: BuiltinEngine, group, key: bytes, timeout_s: float = 300.0):
        if group.rank() != 0:
            raise ValueError(f"TPLeadEngine must run on rank 0 of its group, not rank {group.rank()}")
        self.engine, self.group, self.key, self.timeout_s = engine, group, key, timeout_s
        self._plans_sent = 0
        self._new: list[GenerationRequest] = []  # added since the last plan
        self._closed = False

    # ------------------------------------------------------------------ Engine protocol, as BuiltinEngine
    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def num_unfinished(self) -> int:
        return self.engine.num_unfinished

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def weight_spec(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        return self.engine.weight_spec()

    def stats(self) -> dict:
        return self.engine.stats()

    def staging_buffers(self, version: int) -> dict[str, torch.Tensor]:
        return self.engine.staging_buffers(version)

    def stage_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        self.engine.stage_weights(named_tensors, version)

    def progress(self, since=None):
        """The leader's BuiltinEngine.progress: a read between steps, which every rank's state agrees with."""
        return self.engine.progress(since)

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request here and, with the next plan, on every follower (ValueError as BuiltinEngine's,
        before anything is sent)."""
        self.engine.add_request(request)
        self._new.append(request)

    def step(self) -> list[Completion]:
        """Plan this boundary (the newest version staged on this rank, the new requests), send the plan,
        then apply and step exactly as every follower will."""
        if self._closed:
            raise RuntimeError("TPLeadEngine.step after close(): the followers have stopped")
        staged = self.engine.staged_versions()
        plan = Plan(self._new, staged[-1] if staged else None)
        # Sent before applying: with kv_on_update="recompute" applying runs a forward, whose all-reduces
        # must pair with the followers', which apply only once they have the plan.
        self._send(plan)
        self._new = []
        if plan.version is not None:
            self.engine.apply_staged(plan.version)
        return self.engine.step(apply_staged=False)

    def close(self) -> None:
        """Tell the followers to return (idempotent).  Requests still running are dropped everywhere."""
        if not self._closed:
            self._closed = True
            self._send(Plan(stop=True))

    def _send(self, plan: Plan) -> None:
        send_plan(plan, self.group, self.timeout_s, self.key, self._plans_sent)
        self._plans_sent += 1


def run_follower(engine: BuiltinEngine, group, key: bytes, should_stop: Callable[[], bool], timeout_s: float) -> int:
    """TP rank > 0 of an engine: repeat the lead's plans until it sends stop; return the steps run.

    Each plan: add its requests, wait (at most timeout_s) until this rank's receiver has staged the
    plan's version and apply exactly it, then step without applying anything else; the completions are
    the lead's to return.  should_stop() (polled while waiting for a version) ends the loop early, for
    a run that is over without a stop plan (e.g. this rank's receiver failed).  TimeoutError names the
    plan or version that did not arrive.
    """
    steps = sequence = 0
    while True:
        plan = recv_plan(group, timeout_s, key, sequence)
        sequence += 1
        if plan.stop:
            return steps
        for request in plan.requests:
            engine.add_request(request)
        if plan.version is not None:
            staged = engine.staged_versions()
            if staged and plan.version < staged[0]:  # stage_weights never goes back: it cannot arrive any more
                raise RuntimeError(
                    f"tensor-parallel follower (rank {group.rank()}): the lead applies weight version "
                    f"{plan.version} but this rank dropped it for newer staged versions {staged}")
            if not engine.wait_staged(plan.version, timeout_s, should_stop):
                if should_stop():
                    return steps
                raise TimeoutError(
                    f"tensor-parallel follower (rank {group.rank()}): the lead applies weight version "
                    f"{plan.version} but this rank's receiver did not stage it within {timeout_s:g}s "
                    f"(current version {engine.version}, staged {engine.staged_versions()})")
            engine.apply_staged(plan.version)
        engine.step(apply_staged=False)
        steps += 1
