"""Under megarl.distributed.local_launch: each rank marks OUT.RANK.up, then waits for a stop signal and exits as a
megarl rank told to stop does (128 + the signal, megarl.distributed.lifetime), writing OUT.RANK.stopped first."""
import os
import signal
import sys
import time
from pathlib import Path

rank = int(os.environ["RANK"])


def stop(signum, frame):
    Path(f"{sys.argv[1]}.{rank}.stopped").touch()
    sys.exit(128 + signum)


signal.signal(signal.SIGTERM, stop)
Path(f"{sys.argv[1]}.{rank}.up").touch()
deadline = time.monotonic() + 120  # never outlives a test that forgot it
while time.monotonic() < deadline:
    time.sleep(0.1)
sys.exit(1)
