"""megarl's SGLang client held to SGLang's own code, for the oldest and the newest release megarl supports.

For each release in SUPPORTED_VERSIONS (pinned exactly), sglang_env.install puts SGLang's wheel and the
pure-Python packages its control code imports into ~/.cache/megarl/sglang-contract/ (once), and
check.py runs in a subprocess on that install: megarl's request bodies through SGLang's request types,
contract gate and length validation; megarl's launch commands (the GPU configs' included) through
ServerArgs; megarl's routes request and SGLang's encoding of the response (algo.routing_replay=r3); megarl's
weight-update sequence through SGLang's SchedulerWeightUpdaterManager, full and learner.lora's partial one (the
merged adapted weights), and the latter through SGLang's Qwen2 loader; SGLang's own adapter route and the
per-request pinning that keeps megarl off it.  An
install failure fails the test.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megarl.sampler.sglang_engine import SUPPORTED_VERSIONS
from tests.helpers import REPO
from tests.sampler import make_tiny_model
from tests.sampler.sglang_contract import sglang_env

CHECK = REPO / "tests" / "sampler" / "sglang_contract" / "check.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("contract_model"), "qwen2", max_position_embeddings=512)


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_megarls_requests_launch_and_update_sequence_pass_sglangs_own_code(version, model_dir, tmp_path):
    paths, install_s = sglang_env.install(version)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, paths), str(REPO)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(CHECK), str(model_dir), str(tmp_path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"(install {install_s:.0f}s)\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["version"] == version
    assert len(result["checked"]) == 7, result
