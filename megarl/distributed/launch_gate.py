"""The launch gate: a run's processes start while `megarl train` (or `megarl sft`) still checks the run, import
what their role needs, and then wait for the checks' verdict before they do anything a refused run must not leave
behind (run.dir, process groups, engines, files).

Why: on a small machine most of a run's start-up is imports (torch, megatron-core, transformers: seconds of CPU
per process, docs/benchmarks.md "Start-up, part by part"). Holding the launcher until the checks passed put all of
them after the checks; behind this gate they overlap them.

Three parties:
  * the CLI (megarl.distributed.supervisor.GatedStart) starts the launcher with a pipe: it writes "go" once its
    checks pass, or closes the pipe without it (refused, or the CLI died);
  * the launcher (megarl.distributed.local_launch) launches nothing if the CLI refused already, else tells its
    ranks they are gated (`ENV`) and `Verdict.relay`s the verdict into its rendezvous store, signed with the run
    secret (megarl.distributed.signed_store);
  * each rank, once its imports are done, `wait_for_go`: True on "go", False on a refusal (the rank then exits
    0 having done nothing). The verdict stays in the store, so ranks restarted by fault.on_failure=restart pass at
    once. A forged value (a process without the secret) counts as no verdict yet.
"""
from __future__ import annotations

import os
import select
import threading
import time

import torch.distributed as dist

from megarl.distributed.signed_store import SignedStore
from megarl.secret import run_secret

ENV = "MEGARL_LAUNCH_GATED"  # set by the launcher for its ranks: wait for the verdict before acting
KEY = "megarl/launch_gate"  # unprefixed by the restart attempt: one verdict for the whole launch
GO, REFUSED = b"go", b"refused"
POLL_S = 0.01  # a rank's look at the store while it waits: one loopback round trip


def gated() -> bool:
    """Whether this rank was started behind the gate (its launcher says so in the environment)."""
    return os.environ.get(ENV) == "1"


class Verdict:
    """Launcher side: the CLI's verdict on its pipe `gate_fd`: "go", or end of file without it (refused)."""

    def __init__(self, gate_fd: int):
        self._pipe = os.fdopen(gate_fd, "rb", buffering=0)
        self._value: bytes | None = None

    def known_refused(self) -> bool:
        """Without blocking: whether the CLI has already refused (then nothing needs launching at all)."""
        if self._value is None and select.select([self._pipe], [], [], 0)[0]:
            self.read()
        return self._value == REFUSED

    def read(self) -> bytes:
        """Block until the verdict is in: GO or REFUSED."""
        if self._value is None:
            data = b""
            while len(data) < len(GO):  # a pipe read may return the two bytes one at a time
                chunk = self._pipe.read(len(GO) - len(data))
                if not chunk:
                    break
                data += chunk
            self._value = GO if data == GO else REFUSED
            self._pipe.close()
        return self._value

    def relay(self, store: dist.Store) -> threading.Thread:
        """A thread that waits for the verdict and writes it, signed, to `store` (the launcher's own TCPStore,
        which the ranks reach)."""
        thread = threading.Thread(target=lambda: SignedStore(store, run_secret()).set(KEY, self.read()),
                                  name="launch-gate", daemon=True)
        thread.start()
        return thread


def wait_for_go(store: SignedStore, timeout_s: float, rank: int) -> bool:
    """Rank side: block until the launch's verdict is in the store (`store`: this rank's, connect_store's);
    True for go, False for a refusal. RuntimeError naming what it waited for after `timeout_s`."""
    gate = SignedStore(store.raw.underlying_store if isinstance(store.raw, dist.PrefixStore) else store.raw,
                       run_secret())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gate.check([KEY]):  # a forged verdict counts as none: the genuine one overwrites it
            return gate.get(KEY) == GO
        time.sleep(POLL_S)  # (a store wait's timeout would print torch's socket warnings every time)
    raise RuntimeError(f"rank {rank}: the launcher's checks gave no verdict within dist.timeout_s={timeout_s:.0f}s "
                       f"(waited for {KEY!r} in the rendezvous store; is `megarl train` still running?)")
