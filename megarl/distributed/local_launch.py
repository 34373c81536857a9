"""The single-node launch: torchrun with its store on loopback, and the run's secret in every rank's environment.

    python -m megarl.distributed.local_launch [torchrun options] -m megarl.roles.worker CONFIG [key=value ...]

is what `megarl train`, `megarl sft` and launch/torchrun_single_node.sh run instead of
`torchrun --standalone`. torchrun's own rendezvous backends host their TCPStores on every interface
(c10d even hosts two: the rendezvous store at the endpoint and the workers' store on a free port),
so anyone who reaches the machine could read and write the run's store. Here torchrun runs
in-process with a rendezvous backend of one node whose single store (rendezvous and workers' store
alike, as torchrun shares them) listens on 127.0.0.1 only (megarl.distributed.store_server).

MEGARL_RUN_SECRET is generated here when the environment does not set one (megarl.secret);
every rank inherits it. Started gated (megarl.distributed.supervisor.GatedStart: `megarl train` starts it
before its checks), it launches the ranks at once and relays the checks' verdict into its store, where the ranks
wait for it once they have imported what their role needs (megarl.distributed.launch_gate). Multi-node launches
use torchrun's c10d backend (launch/torchrun_multi_node.sh), whose store must stay on a private network
(docs/security.md).

A stop signal to this process ends the ranks at a step boundary (torchrun forwards it, then kills what is
left after --shutdown-timeout) and this process exits 128 + the signal (143 for SIGTERM), without
torchrun's traceback.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import (RendezvousHandler, RendezvousInfo, RendezvousParameters,
                                                  RendezvousStoreInfo, rendezvous_handler_registry)

from torch.distributed.run import main as torchrun_main

from megarl.distributed import launch_gate
from megarl.distributed.store_server import tcp_store_server
from megarl.distributed.supervisor import GATE_ENV
from megarl.secret import ENV, new_secret

BACKEND = "megarl-loopback"
HOST = "127.0.0.1"
STORE_TIMEOUT = timedelta(seconds=600)


class LoopbackRendezvous(RendezvousHandler):
    """One node, rank 0 of a world of 1, its store on loopback; the same store for every restart."""

    def __init__(self, run_id: str, verdict: launch_gate.Verdict | None = None):
        self.run_id = run_id
        self._store: dist.TCPStore | None = None
        self._verdict = verdict  # the CLI's, relayed into the store once it exists

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers connect to this store (TORCHELASTIC_USE_AGENT_STORE), none of them hosts one

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            self._store = tcp_store_server(HOST, 0, STORE_TIMEOUT, multi_tenant=True)
            if self._verdict is not None:
                self._verdict.relay(self._store)
        return RendezvousInfo(dist.PrefixStore(self.run_id, self._store), 0, 1,
                              RendezvousStoreInfo(HOST, self._store.port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True


def _handler_factory(verdict: launch_gate.Verdict | None):
    def create(params: RendezvousParameters) -> RendezvousHandler:
        if params.max_nodes != 1:
            raise ValueError(f"{BACKEND} is a single-node rendezvous, got --nnodes {params.max_nodes}")
        return LoopbackRendezvous(params.run_id, verdict)

    return create


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    gate = os.environ.pop(GATE_ENV, None)  # popped: the ranks do not inherit the pipe, they wait in the store
    verdict = None if gate is None else launch_gate.Verdict(int(gate))
    if verdict is not None:
        if verdict.known_refused():  # refused while this process imported: launch nothing
            return
        os.environ[launch_gate.ENV] = "1"
    if not os.environ.get(ENV):
        os.environ[ENV] = new_secret()
    rendezvous_handler_registry.register(BACKEND, _handler_factory(verdict))
    try:
        torchrun_main(["--nnodes=1", f"--rdzv-backend={BACKEND}", f"--rdzv-endpoint={HOST}:0",
                       f"--rdzv-id=megarl-{os.getpid()}", *argv])
    except SignalException as exc:
        # A stop signal to the launcher (`kill PID`, a scheduler's preemption): torchrun has already passed it to
        # the ranks, which stopped at a step boundary, and said so in one line; its re-raise would add a
        # traceback and exit 1. Exit as a process ended by that signal conventionally does: 128 + its number.
        sys.exit(128 + int(exc.sigval))


if __name__ == "__main__":
    main()
