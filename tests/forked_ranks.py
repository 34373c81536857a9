"""A torchrun stand-in for the tests' worker scripts: every rank a fork of this one process, which imported torch
(WARM=torch), or torch and a learner backend's framework (WARM=megatron, deepspeed) once: a torchrun launch starts an
agent and imports them again in each rank (~2 CPU-s a rank for torch, ~5 with megatron-core).

    python tests/forked_ranks.py NPROC TIMEOUT_S WARM SCRIPT [ARGS ...]

Each rank runs SCRIPT as `__main__` with torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR/MASTER_PORT of a store this process hosts as torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE), so
`dist.init_process_group()` and megarl's connect_store work unchanged. For the scripts that test a learner's
computation, not the launch: the tests of torchrun launches themselves start the real one. Exit status: 0 when every
rank exited 0, else the first rank's non-zero status (a rank still running after TIMEOUT_S is killed: status 124).
"""
import os
import runpy
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.learner import import_backend


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank: int, nproc: int, port: int, script: str, args: list[str]) -> int:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RUN_ID=f"forked-{os.getppid()}")
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` puts it first
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def main() -> None:
    nproc, timeout_s, warm, script, args = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
    if warm in ("megatron", "deepspeed"):
        import_backend(warm)  # what a learner rank of that backend imports before it builds (torch._dynamo too)
    elif warm != "torch":
        sys.exit(f"forked_ranks: WARM is megatron, deepspeed or torch, not {warm!r}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(nproc):
        pid = os.fork()  # before the store's thread starts: the ranks' clients wait for the store
        if pid == 0:
            code = 1
            try:
                code = run_rank(rank, nproc, port, script, args)
            finally:  # not a plain exit: it can abort in gloo's threads (megarl.distributed.lifetime.exit_process)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while len(codes) < nproc:
        for rank, pid in enumerate(pids):
            if rank in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[rank] = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                codes[rank] = 124
                print(f"forked_ranks: rank {rank} still running after {timeout_s:.0f}s: killed", file=sys.stderr)
        time.sleep(0.05)
    del store  # (served the ranks until they ended)
    failed = [codes[rank] for rank in range(nproc) if codes[rank] != 0]
    sys.exit(failed[0] if failed else 0)


if __name__ == "__main__":
    main()
