"""`megarl samplers remove RUN_DIR --sampler ID`: drain one sampler of a running job (fault.on_failure=replace).

The command finds the run from its contact file (megarl.distributed.run_contact: store address, key space,
secret), writes a signed remove request under `samplers/remove/{rank}` and waits for the learner's answer under
`samplers/removed/{rank}` (megarl.distributed.membership.SamplerSet.remove). The learner takes the sampler out of
the publish set (its next publish goes over a new membership epoch without it), its running rollouts are dropped
and counted lost, and its keeper kills it and starts no replacement (megarl.roles.sampler_keeper).
"""
from __future__ import annotations

import json
import secrets
import time
from datetime import timedelta
from pathlib import Path

from megarl.distributed.membership import read_record, remove_key, removed_key
from megarl.distributed.run_contact import ContactError, read_contact

POLL_S = 0.5
CONNECT_TIMEOUT_S = 30.0


def _refusal_without_contact(run_dir: Path, exc: ContactError) -> str:
    """Name fault.on_failure when the run dir's config shows it is not `replace` (the contact's absence says less)."""
    config = run_dir / "config.yaml"  # the run's resolved config (every key), saved at its start
    if config.is_file():
        import yaml

        try:
            on_failure = (yaml.safe_load(config.read_text()) or {}).get("fault", {}).get("on_failure", "stop")
        except (yaml.YAMLError, AttributeError):  # an unreadable config: the contact's reason stands
            on_failure = "replace"
        if on_failure != "replace":
            return (f"the run in {run_dir} runs with fault.on_failure={on_failure}: samplers join and leave only "
                    f"under fault.on_failure=replace (docs/faults.md)")
    return str(exc)


def connect(record: dict, timeout_s: float = CONNECT_TIMEOUT_S):
    """The run's signed store, from its contact record."""
    import torch.distributed as dist

    from megarl.distributed.signed_store import SignedStore

    host, port = record["store"]
    try:
        raw = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                            wait_for_workers=False)
    except Exception as exc:
        raise ContactError(f"the run's store at {host}:{port} is not reachable within {timeout_s:.0f}s (the run has "
                           f"finished?): {exc}") from exc
    return SignedStore(dist.PrefixStore(record["prefix"], raw), record["secret"].encode())


def request_removal(store, rank: int, timeout_s: float, poll_s: float = POLL_S) -> dict:
    """Ask the learner to drain `rank`; its answer (SamplerSet.remove), or TimeoutError after `timeout_s`."""
    from megarl.roles.learner_main import STOP_KEY

    request = secrets.token_hex(8)
    store.set(remove_key(rank), json.dumps({"request": request}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = read_record(store, removed_key(rank))
        if answer is not None and answer.get("request") == request:
            return answer
        if store.check([STOP_KEY]):
            raise ContactError("the run stopped before the learner took the request")
        time.sleep(poll_s)
    raise TimeoutError(f"the learner did not answer the remove request within {timeout_s:.0f}s (it reads requests "
                       f"while it waits for groups and before each publish; raise --timeout-s on a slow step)")


def remove_sampler(run_dir: str, sampler: int, timeout_s: float) -> int:
    """The command: 0 when removed; 1 (a line saying why) when refused or not answered."""
    run_dir = Path(run_dir)
    try:
        try:
            record = read_contact(run_dir)
        except ContactError as exc:
            raise ContactError(_refusal_without_contact(run_dir, exc)) from None
        ranks = record["sampler_ranks"]
        if not 0 <= sampler < len(ranks):
            raise ContactError(f"--sampler {sampler}: the run has samplers 0..{len(ranks) - 1}")
        answer = request_removal(connect(record), ranks[sampler], timeout_s)
    except (ContactError, TimeoutError) as exc:
        print(f"megarl samplers remove: {exc}", flush=True)
        return 1
    if "refused" in answer:
        print(f"megarl samplers remove: refused by the learner: {answer['refused']}", flush=True)
        return 1
    lost = answer["lost"]
    print(f"megarl: sampler {sampler} (rank {ranks[sampler]}) removed from the run in {run_dir}: it left the publish "
          f"set, its keeper stops it without a replacement; {lost} running group{'s' if lost != 1 else ''} dropped "
          f"(lost)", flush=True)
    return 0
