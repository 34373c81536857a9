"""A rank's exit: the status a normal exit would have had, its output flushed, no finalization."""
import textwrap

import pytest

from tests.helpers import run_python

BODY = {
    "returns": "print('done')",
    "exits_with_code": "print('done'); sys.exit(3)",
    "exits_with_message": "print('done'); sys.exit('bad config: learner.tp')",
    "raises": "print('done'); raise ValueError('reward function raised')",
    "stopped": "print('done'); from megarl.distributed.lifetime import StopRequested; "
               "raise StopRequested(15, 'the learner group')",
}


def run(body: str):
    # Buffered stdout to a pipe: only the flush in exit_process gets 'done' out before os._exit; the
    # atexit hook shows whether interpreter finalization ran (it must not).
    script = textwrap.dedent(f"""
        import atexit, sys
        from megarl.distributed.lifetime import run_then_exit
        atexit.register(lambda: print('finalized'))
        def main():
            {body}
        run_then_exit(main)
    """)
    return run_python("-c", script, timeout=60)


@pytest.mark.parametrize("case, code", [("returns", 0), ("exits_with_code", 3), ("exits_with_message", 1),
                                        ("raises", 1), ("stopped", 143)])
def test_exit_status_is_what_a_normal_exit_would_give(case, code):
    proc = run(BODY[case])
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "done\n"  # flushed, and no finalization (the atexit hook never printed)


def test_the_failure_is_printed():
    assert "bad config: learner.tp" in run(BODY["exits_with_message"]).stderr
    stderr = run(BODY["raises"]).stderr
    assert "Traceback" in stderr and "ValueError: reward function raised" in stderr
    # a stop signal a start-up wait let through is the run's stop, said in one line
    assert run(BODY["stopped"]).stderr == "megarl: rank 0 stopped by SIGTERM while waiting for the learner group\n"


STOPPABLE = textwrap.dedent("""
    import sys, time
    from megarl.distributed.lifetime import StopRequested, exit_status, install_stop_handlers, raise_if_stopped
    install_stop_handlers()
    print('ready', flush=True)
    try:
        while True:  # a role's loop: it checks at its safe points
            raise_if_stopped()
            time.sleep(0.01)
    except StopRequested as stop:
        print(stop, flush=True)
        sys.exit(exit_status(stop.signum))
""")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_stop_signal_is_recorded_and_left_at_a_safe_point_with_128_plus_its_number(sig):
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers import REPO

    proc = subprocess.Popen([sys.executable, "-c", STOPPABLE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=30)
    assert (proc.returncode, out, err) == (128 + getattr(signal, sig), f"stopped by {sig}\n", "")  # no KeyboardInterrupt
