"""The environment workers' side of the JSON-lines protocol (megarl/rollout/worker_lines.py): requests refused by
field, and the workers, run as files by an environment's Python that has no megarl, find it beside them."""
import subprocess
import sys

import pytest

from megarl.rollout.worker_lines import check_request
from tests.helpers import REPO

RUN = {"id": 1, "op": "run", "task": 0, "base_url": "http://u", "timeout_s": 5}


def test_requests_are_refused_by_field():
    assert check_request({"op": "close"}) is None and check_request(RUN) is None
    assert "a request is a JSON object" in check_request([RUN])
    assert "unknown op" in check_request({"op": "step"})
    assert "'task'" in check_request({**RUN, "task": "0"})
    assert "'id'" in check_request({**RUN, "id": True})  # a bool is no int here
    assert "timeout_s must be > 0" in check_request({**RUN, "timeout_s": 0})
    assert check_request(RUN, 4) is None and "out of range (0..3)" in check_request({**RUN, "task": 4}, 4)


@pytest.mark.parametrize("worker", ["verifiers_worker.py", "openenv_worker.py"])
def test_a_worker_run_as_a_file_imports_the_protocol_beside_it(worker):
    proc = subprocess.run([sys.executable, str(REPO / "megarl" / "rollout" / worker), "--help"], capture_output=True,
                          text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "JSON lines on stdin/stdout" in proc.stdout
