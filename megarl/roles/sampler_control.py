"""`megarl samplers add|remove RUN_DIR ...`: samplers join and leave a running job (fault.on_failure=replace).

`add` (sampler.engine builtin, vllm, or sglang with megarl's SGLang-compatible server: its server is started by the
added sampler as by any other, on a free port) numbers a new sampler rank after the run's world (the n-th added: rank WORLD_SIZE + n - 1, sampler index
rank - learners), records it under `samplers/added/{n}` and runs, in the foreground, that rank's keeper
(megarl.roles.sampler_keeper) over the run's saved config (RUN_DIR/config.yaml, sampler.num_engines raised to
count it, plus the command's key=value overrides). Its sampler starts as incarnation 1, so it joins as a replacement
does: it loads the model, asks to join, and the learner admits it into the next membership epoch, whose first
publish (whole) it receives before it admits a prompt; a new data stream (its sampler index) starts at index 0.
The keeper replaces it when it dies, like any other; it exits when the run ends or the sampler is removed.

`remove`: the command finds the run from its contact file (megarl.distributed.run_contact: store address, key space,
secret), writes a signed remove request under `samplers/remove/{rank}` and waits for the learner's answer under
`samplers/removed/{rank}` (megarl.distributed.membership.SamplerSet.remove). The learner takes the sampler out of
the publish set (its next publish goes over a new membership epoch without it), its running rollouts are dropped
and counted lost, and its keeper kills it and starts no replacement (megarl.roles.sampler_keeper).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
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


def _added(store) -> int:
    from megarl.distributed.membership import ADDED_COUNT_KEY

    return store.raw.add(ADDED_COUNT_KEY, 0)


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


def _run_config(run_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text()) or {}


def _contact_or_refusal(run_dir: Path) -> dict:
    try:
        return read_contact(run_dir)
    except ContactError as exc:
        raise ContactError(_refusal_without_contact(run_dir, exc)) from None


def add_refusal(config: dict) -> str | None:
    """Why a run with this saved config cannot take an added sampler, naming the key (None: it can)."""
    sampler = config.get("sampler", {})
    engine = sampler.get("engine", "builtin")
    if (refusal := engine_span_refusal(config)) is not None:
        return refusal
    if engine == "sglang" and (sampler.get("sglang") or {}).get("server", "builtin") != "builtin":
        # A real SGLang server's GPUs are a slice of its node's, placed by the rank's place among the run's
        # ranks on that node (topology.sglang_gpu_slice); an added rank has no such place.
        return ("sampler.sglang.server=sglang: `megarl samplers add` starts built-in engines, vLLM servers and "
                "megarl's SGLang-compatible server (sampler.sglang.server=builtin), not real SGLang servers (their "
                "GPU slice follows the rank's place among the run's ranks on its node)")
    if config.get("eval", {}).get("sets"):
        return "eval.sets: each due version's evaluation is split over the run's engines, a fixed set"
    if config.get("algo", {}).get("mode") == "sync":
        return "algo.mode=sync: each version's batch is split over the run's engines, a fixed set"
    return None


def engine_span_refusal(config: dict) -> str | None:
    """Why neither command takes a run whose engines span several ranks (None: they do): one command starts or drains
    one rank, and such an engine lives and is replaced whole (megarl.roles.sampler_keeper)."""
    tp = config.get("sampler", {}).get("tp", 1)
    if tp > 1:
        return (f"sampler.tp={tp}: each engine spans {tp} ranks, and `megarl samplers add`/`remove` start or drain "
                f"one rank")
    return None


def leave_on_signal(store, rank: int) -> None:
    """SIGINT/SIGTERM/SIGHUP to `megarl samplers add` drain its sampler (a remove request: the learner answers, the
    keeper then stops it and exits 0) instead of stopping the run; a second one ends the command at once (its
    sampler dies with it, and the learner drops it when its heartbeat stands still)."""
    def drain(signum, frame) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        print(f"megarl samplers add: {signal.Signals(signum).name} received: removing this sampler from the run "
              f"(send it again to end this command at once)", flush=True)
        store.set(remove_key(rank), json.dumps({"request": secrets.token_hex(8)}))

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, drain)


def add_sampler(run_dir: str, overrides: list[str]) -> int:
    """The command: run an added sampler rank's keeper until the run ends (its status) or the sampler is removed
    (0); 1 with a line saying why when refused."""
    from megarl.config.load import load_config
    from megarl.distributed.membership import ADDED_COUNT_KEY, added_key
    from megarl.distributed.ranks import topology_from_env
    from megarl.roles.sampler_keeper import keep_sampler

    run_dir = Path(run_dir)
    try:
        record = _contact_or_refusal(run_dir)
        refusal = add_refusal(_run_config(run_dir))
        if refusal is not None:
            raise ContactError(refusal)
        store = connect(record)
    except ContactError as exc:
        print(f"megarl samplers add: {exc}", flush=True)
        return 1
    n = store.raw.add(ADDED_COUNT_KEY, 1)  # this command's number among the run's added samplers
    world = record["world_size"] + n
    rank = world - 1
    host, port = record["store"]
    os.environ.update({  # what torchrun gives a worker of the run, for this rank; the keeper's children inherit it
        "MASTER_ADDR": str(host), "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": record["prefix"].rstrip("/").rsplit("attempt", 1)[1],
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "MEGARL_RUN_SECRET": record["secret"]})
    argv = [str(run_dir / "config.yaml"), f"sampler.num_engines={world - record['num_learners']}", *overrides]
    cfg = load_config(argv[0], argv[1:], check_files=False)
    topo = topology_from_env(cfg)
    store.set(added_key(n), json.dumps({"rank": rank}))
    print(f"megarl: sampler {topo.role_rank} (rank {rank}) added to the run in {run_dir}: its keeper runs here; the "
          f"sampler joins the publish set once its engine is ready", flush=True)
    leave_on_signal(store, rank)
    try:
        keep_sampler(argv, cfg, topo, store, first=1, idle_after_removal=False, own_session=True)
    except SystemExit as exc:  # the keeper leaves with its sampler's status, or a line (over its restart limit)
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, flush=True)
        return 1
    return 0


def remove_sampler(run_dir: str, sampler: int, timeout_s: float) -> int:
    """The command: 0 when removed; 1 (a line saying why) when refused or not answered."""
    run_dir = Path(run_dir)
    try:
        record = _contact_or_refusal(run_dir)
        saved = _run_config(run_dir) if (run_dir / "config.yaml").exists() else {}  # rank 0 saves it at start
        if (refusal := engine_span_refusal(saved)) is not None:
            raise ContactError(refusal)
        store = connect(record)
        count = len(record["sampler_ranks"]) + _added(store)
        if not 0 <= sampler < count:
            raise ContactError(f"--sampler {sampler}: the run has samplers 0..{count - 1}")
        rank = record["num_learners"] + sampler
        answer = request_removal(store, rank, timeout_s)
    except (ContactError, TimeoutError) as exc:
        print(f"megarl samplers remove: {exc}", flush=True)
        return 1
    if "refused" in answer:
        print(f"megarl samplers remove: refused by the learner: {answer['refused']}", flush=True)
        return 1
    lost = answer["lost"]
    print(f"megarl: sampler {sampler} (rank {rank}) removed from the run in {run_dir}: it left the publish "
          f"set, its keeper stops it without a replacement; {lost} running group{'s' if lost != 1 else ''} dropped "
          f"(lost)", flush=True)
    return 0
