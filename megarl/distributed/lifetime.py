"""How a rank process ends: on a stop signal, at the next safe point; then flush its output and leave
without interpreter finalization.

Stop signals (SIGTERM, SIGINT, SIGHUP: what a supervisor, a scheduler's preemption, `kill PID`, a closed
terminal or Ctrl-C send) are recorded, not acted on inside the handler: `install_stop_handlers()` makes
the first one set `stop_signal()`, and the roles leave their loops where that is safe. The learner
ranks leave together at a step boundary (the lead decides and tells the others with the batch it
shares), save a checkpoint when one is due or `fault.checkpoint_on_signal` asks for it, and exit with
the conventional status 128 + signal number; samplers keep serving until the learner says stop (a
publish in progress needs them), at most `fault.stop_timeout_s`. A rank that receives a signal the
others did not (a raw `kill` of one worker) also writes it to the store, where the lead sees it.

During start-up a rank waits for the others (process-group rendezvous, the learner's resume announcement).
A wait inside torch's C++ store client holds the main thread, where no Python signal handler runs, for its
whole timeout: a stop signal would go unnoticed until torchrun SIGKILLs the rank after its shutdown
timeout (`fault.stop_timeout_s`). So those waits are `wait_for_keys`: the store polled from Python, the stop signal checked between
polls; a rank stopped there leaves at once with 128 + the signal's number, saying what it waited for.

Why not a normal exit: gloo runs every async collective (the weight broadcasts, megatron's gradient
all-reduces) on the process group's own worker threads ("pt_gloo_runloop"), and a worker thread drops
its reference to a finished work item just *after* the Python thread waiting on it has been released.
The work holds Python-created tensors, so that late release takes the GIL. If the main thread has
meanwhile begun interpreter finalization, CPython ends the worker thread with a forced unwind, which
C++ turns into std::terminate: the process aborts (SIGABRT, "terminate called without an active
exception") after all of its work completed and its results were written. Measured on a loaded
2-core machine: 5 of 25 runs of tests/distributed/publish_worker.py (gdb shows
~AsyncBroadcastWork -> decref_pyobject -> take_gil -> pthread_exit on a pt_gloo_runloop thread while
the main thread is in Py_FinalizeEx). `ProcessGroupGloo.shutdown()` does not join those threads
(still 2 of 25 with it) and a standalone group has no other join API.

So a rank ends with `os._exit`: by then its roles have closed what needs closing in their `finally`
blocks (metric and rollout files, TensorBoard, the queue sockets, the SGLang server, reward workers,
which also die with their parent), so finalization has nothing left to do but race those threads.
"""
import os
import signal
import sys
import time
import traceback
from typing import Callable, NoReturn

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SIGNAL_KEY = "stop_signal"  # store key: the number of a stop signal some rank received
STARTUP_POLL_S = 0.1  # how often a start-up wait (wait_for_keys) looks at the store and the stop signal

_received: tuple[int, float] | None = None  # (signal number, time.monotonic() it arrived), first only
_next_store_check = 0.0


class StopRequested(Exception):
    """A stop signal reached the run; `signum` is the signal's number, `waiting_for` what this rank was waiting
    for when it noticed (a start-up wait), if anything."""

    def __init__(self, signum: int, waiting_for: str | None = None):
        super().__init__(signum)
        self.signum, self.waiting_for = signum, waiting_for

    def __str__(self) -> str:
        said = f"stopped by {signal.Signals(self.signum).name}"
        return said if self.waiting_for is None else f"{said} while waiting for {self.waiting_for}"


def exit_status(signum: int) -> int:
    """The status a process killed by `signum` reports to a shell (128 + n): what schedulers expect."""
    return 128 + signum


def _record(signum, frame) -> None:
    global _received
    if _received is None:
        _received = (signum, time.monotonic())


def install_stop_handlers() -> None:
    """Record the first stop signal instead of dying of it (no KeyboardInterrupt either)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)


def stop_signal() -> int | None:
    """The stop signal this process received, or None."""
    return None if _received is None else _received[0]


def seconds_since_signal() -> float:
    return 0.0 if _received is None else time.monotonic() - _received[1]


def raise_if_stopped(store=None, store_every_s: float = 1.0) -> None:
    """StopRequested if this process, or (with `store`, asked at most every `store_every_s`) any rank of
    the run, received a stop signal."""
    global _next_store_check
    if _received is not None:
        raise StopRequested(_received[0])
    if store is not None and time.monotonic() >= _next_store_check:
        _next_store_check = time.monotonic() + store_every_s
        if store.check([SIGNAL_KEY]):
            raise StopRequested(int(store.get(SIGNAL_KEY)))


class WaitAbandoned(RuntimeError):
    """A wait_for_keys ended by its caller's own `should_stop`."""


def wait_for_keys(store, keys: list[str], timeout_s: float, what: str,
                  should_stop: Callable[[], bool] | None = None) -> None:
    """Block until `store` holds every key in `keys`, as `store.wait` would, but in Python: StopRequested naming
    `what` as soon as this process receives a stop signal, TimeoutError naming `what` and the missing keys after
    `timeout_s`. With `should_stop`, that condition ends the wait instead of a stop signal (WaitAbandoned): a role
    that decides itself when a stop ends its waits (a sampler serves on after a signal until the learner says stop;
    the learner stops at a step boundary)."""
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if should_stop is not None:
            if should_stop():
                raise WaitAbandoned(f"stopped while waiting for {what}")
        elif _received is not None:
            raise StopRequested(_received[0], what)
        if time.monotonic() >= deadline:
            missing = [key for key in keys if not store.check([key])]
            raise TimeoutError(f"waited {timeout_s:.0f}s for {what}; still missing store key(s) {missing}")
        time.sleep(STARTUP_POLL_S)


def exit_process(code: int) -> NoReturn:
    """Flush stdout/stderr and end the process now with `code`."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stream: nothing more can be said on it
    os._exit(code)


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """Run a rank's `main`, then `exit_process` with the status a normal exit would have had: 0, the
    SystemExit code (its message printed, as the interpreter would), 128 + n for a stop signal `main` let through
    (StopRequested: said in one line, no traceback), or 1 after printing the traceback."""
    try:
        main()
        code = 0
    except StopRequested as exc:
        print(f"megarl: rank {os.environ.get('RANK', '0')} {exc}", file=sys.stderr)
        code = exit_status(exc.signum)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # the traceback is what the user needs to see; the exit status says it failed
        traceback.print_exc()
        code = 1
    exit_process(code)
