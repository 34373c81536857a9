"""How a rank process ends: flush its output, then leave without interpreter finalization.

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
import sys
import traceback
from typing import Callable, NoReturn


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
    SystemExit code (its message printed, as the interpreter would), or 1 after printing the traceback."""
    try:
        main()
        code = 0
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
