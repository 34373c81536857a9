"""Start-up marks (megarl/observe/startup.py): the parts chain from the process's creation, in order."""
import subprocess
import sys
import time

from megarl.observe import startup


def test_the_process_start_time_is_when_the_kernel_created_this_process():
    # A child that reports its own creation time: after we started it, before it answered.
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "from megarl.observe.startup import process_start_time as t; print(t())"],
                         capture_output=True, text=True, check=True).stdout
    assert before - 0.05 <= float(out) <= time.time()


def test_marks_chain_from_the_process_start(monkeypatch):
    monkeypatch.setattr(startup, "_marks", [])
    startup.mark("imports")
    startup.mark("model build")
    (first, s0, e0), (second, s1, e1) = startup.spans()
    assert (first, second) == ("imports", "model build")
    assert abs(s0 - startup.process_start_time()) < 0.02  # clock-tick resolution
    assert s0 <= e0 == s1 <= e1 <= time.time()
