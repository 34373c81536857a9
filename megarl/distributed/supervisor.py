"""`megarl train`'s hold on its torchrun: start it, pass its output through, turn a stop signal sent to
`megarl train` into a bounded stop of every process of the run, and clean up after a torchrun that died.

Why each piece:
  * torchrun runs in its own session, so a terminal's Ctrl-C (sent to the whole foreground process
    group) reaches the run once, through this process, instead of twice (torchrun forwards what it
    gets to its workers, which are in sessions of their own).
  * SIGTERM, SIGINT and SIGHUP to this process are forwarded to torchrun, which forwards them to every
    worker (the learner stops at its next step boundary, megarl.distributed.lifetime) and kills what is
    left after its `--shutdown-timeout` (fault.stop_timeout_s). Should torchrun itself not end by then
    (plus a margin), or a second signal arrive (the user insists), every process of the run is killed.
  * torchrun gets PR_SET_PDEATHSIG: if this process is killed (even by SIGKILL), torchrun is sent SIGTERM
    and stops the workers, so no training continues without a parent.
  * this process is a child subreaper: workers whose torchrun was killed are re-parented here instead
    of to init, so they can be found and stopped (their store died with torchrun: they cannot go on),
    and their C++ store errors are not echoed: a one-line summary says what happened.
  * torchrun may be started gated (`GatedStart`) before the caller's own checks: its Python start and
    torch import (~2 s) then overlap them, and it launches nothing until `TorchrunRun` opens the gate;
    a check that refuses the run kills it first.
"""
from __future__ import annotations

import collections
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from megarl.distributed.lifetime import STOP_SIGNALS

_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
KILL_MARGIN_S = 15.0  # past torchrun's own shutdown timeout, before everything is killed
HOLD_S = 0.5  # how late torchrun's stderr is echoed (see TorchrunRun._echo)
# Set in a gated torchrun's environment (GatedStart): the descriptor it reads the checks' verdict from
# (megarl.distributed.launch_gate: its ranks import, then wait for the verdict before they act).
GATE_ENV = "MEGARL_LAUNCH_GATE_FD"
REFUSED_EXIT_S = 30.0  # how long a refused launch may take to wind down (its ranks finish importing) before a kill


def _prctl(option: int, value: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children first), read from /proc."""
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # the command name in (...) may hold spaces: the parent pid is the 2nd field after it
                parent_of[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parent_of.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _is_signal_traceback(block: list[str]) -> bool:
    """torchrun's own traceback for the signal it was sent (SignalException): noise after a requested stop."""
    return bool(block) and "SignalException" in block[-1]


def _start(cmd: list[str], env: dict, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True, preexec_fn=_die_with_parent, pass_fds=pass_fds)


class GatedStart:
    """torchrun (`megarl.distributed.local_launch`) started now, its ranks held after their imports until `open()`
    (megarl.distributed.launch_gate): `TorchrunRun(..., gated=this)` opens it; `cancel()` (the caller refused the
    run) closes it, and the ranks, having done nothing, exit; whatever is still running after REFUSED_EXIT_S is
    killed. Started like TorchrunRun starts it (own session, dies with this process), so a Ctrl-C during the
    caller's checks reaches only the caller."""

    def __init__(self, cmd: list[str], env: dict):
        self.cmd = cmd
        read_end, self._go = os.pipe()
        try:
            self.proc = _start(cmd, {**env, GATE_ENV: str(read_end)}, pass_fds=(read_end,))
        finally:
            os.close(read_end)

    def open(self) -> subprocess.Popen:
        try:
            os.write(self._go, b"go")
        except BrokenPipeError:  # the launch already ended (a rank failed before the gate): its own error says why
            pass
        os.close(self._go)
        self._go = None
        return self.proc

    def cancel(self) -> None:
        """Refuse the run if the gate is still closed (else it is TorchrunRun's); returns once every process of
        the launch has exited."""
        if self._go is None:
            return
        os.close(self._go)
        self._go = None
        drain = threading.Thread(target=self.proc.stderr.read, daemon=True)  # a full pipe must not hold it up
        drain.start()
        try:
            self.proc.wait(REFUSED_EXIT_S)
        except subprocess.TimeoutExpired:
            _kill([*descendants(self.proc.pid), self.proc.pid])
            self.proc.wait()
        drain.join(1.0)


class TorchrunRun:
    """One torchrun process under `megarl train`. `wait()` returns its exit status; afterwards `signalled`
    is the stop signal this process forwarded (or None), `killed_by` the signal that killed torchrun
    when nobody here sent one, and `tail` the last lines of its stderr. With `gated` (a GatedStart of the
    same `cmd`), the torchrun started earlier is let go instead of a new one started."""

    def __init__(self, cmd: list[str], env: dict, stop_timeout_s: float, gated: GatedStart | None = None):
        self.stop_timeout_s = stop_timeout_s
        self.signalled: int | None = None
        self.killed_by: int | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=400)
        self.muted = False
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        self.previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        if gated is not None and gated.cmd != cmd:
            raise ValueError(f"the gated torchrun runs {gated.cmd}, not {cmd}")
        self.proc = gated.open() if gated is not None else _start(cmd, env)
        self.held: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._pass_through, name="torchrun-stderr", daemon=True)
        self.echo = threading.Thread(target=self._echo, name="torchrun-echo", daemon=True)
        self.reader.start()
        self.echo.start()
        self.deadline: threading.Timer | None = None

    def _on_signal(self, signum, frame) -> None:
        if self.signalled is not None:  # a second signal: stop now
            print(f"megarl: {signal.Signals(signum).name} again: killing every process of the run", file=sys.stderr,
                  flush=True)
            self.kill_all()
            return
        self.signalled = signum
        print(f"megarl: {signal.Signals(signum).name} received: stopping the run at its next step boundary "
              f"(at most {self.stop_timeout_s:.0f}s, fault.stop_timeout_s; send it again to kill it now)",
              file=sys.stderr, flush=True)
        try:
            self.proc.send_signal(signum)
        except ProcessLookupError:
            pass
        self.deadline = threading.Timer(self.stop_timeout_s + KILL_MARGIN_S, self.kill_all)
        self.deadline.daemon = True
        self.deadline.start()

    def kill_all(self) -> None:
        _kill([*reversed(descendants(os.getpid())), self.proc.pid])

    def _pass_through(self) -> None:
        """torchrun writes its failure report (and the workers' tracebacks) to stderr: keep a tail, echo it
        HOLD_S late (`_echo`)."""
        for line in self.proc.stderr:
            self.tail.append(line)
            self.held.put((time.monotonic() + HOLD_S, line))
        self.held.put((0.0, None))

    def _echo(self) -> None:
        """Write held lines once HOLD_S old, unless torchrun has meanwhile turned out killed from outside:
        its workers notice first (its sockets close before it is a zombie) and their lines are noise. After
        a requested stop, torchrun's own traceback of the signal is left out too."""
        block: list[str] = []
        while True:
            due, line = self.held.get()
            time.sleep(max(0.0, due - time.monotonic()))
            if line is None:
                break
            if self.muted or self._killed_from_outside():
                continue
            if block or (self.signalled is not None and line.startswith("Traceback (most recent call last):")):
                block.append(line)
                if line[:1].isspace() or line.startswith("Traceback"):
                    continue
                if not _is_signal_traceback(block):
                    sys.stderr.writelines(block)
                block = []
                continue
            sys.stderr.write(line)
            sys.stderr.flush()
        sys.stderr.writelines(block)

    def _killed_from_outside(self) -> bool:
        """Has torchrun died of a signal nobody here sent? Asked without reaping it (`wait` reaps), so a line
        its orphaned workers write after its death is never echoed: either the zombie shows it or `wait` has
        already set `muted`."""
        if self.signalled is not None:
            return False
        try:
            state = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped: `wait` decided
            return self.muted
        return state is not None and state.si_code in (os.CLD_KILLED, os.CLD_DUMPED)

    def wait(self) -> int:
        try:
            os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)  # its death, before reaping it
            if self._killed_from_outside():
                # torchrun was killed from outside: its workers (now our children) lost their store and can
                # only fail noisily; stop them and say what happened instead.
                self.muted = True
            code = self.proc.wait()
            if self.muted:
                self.killed_by = -code
                orphans = descendants(os.getpid())
                _kill(orphans)
                for pid in orphans:  # collect their exit status: no zombies left behind
                    try:
                        os.waitpid(pid, 0)
                    except ChildProcessError:  # not our child (a worker's own child): its parent reaps it
                        pass
            self.reader.join(timeout=10)
            self.echo.join(timeout=10)
            return code
        finally:
            if self.deadline is not None:
                self.deadline.cancel()
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)
