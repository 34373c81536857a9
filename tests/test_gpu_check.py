"""benchmarks/gpu_check.sh, the script a session lent a GPU runs once, checked here on CPU so that a typo is
found in CI and not in the 15 minutes of a GPU loan (docs/benchmarks.md#the-gpu-check--benchmarksgpu_checksh).

The dry run is `--no-download`: CI must not need the network for it. The wheel list carries each wheel's
size, measured by the real `pip download` (`bash benchmarks/gpu_check.sh --dry-run` without the flag downloads
the list again and fails if a size or a requirement changed); here the declared total is checked against the
64 MiB a device call carries, with the working tree."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402


DRY_RUN_LIMIT_S = (len(gpu_check.CHECKS) + len(gpu_check.LEARNER_FALLBACKS)) * gpu_check.DRY_TIMEOUT + 120


@pytest.mark.timeout(DRY_RUN_LIMIT_S + 30)
def test_the_dry_run_runs_every_check_on_cpu_and_ends_with_one_json_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    # The script bounds each check's process by DRY_TIMEOUT itself (learner_step may run once per fallback
    # backend); this limit only catches the script hanging outside them, so it follows from theirs and not from
    # how long the checks take on an idle machine (a loaded one takes several times longer).
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", "--no-download", "--workdir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=DRY_RUN_LIMIT_S,
                          env=env)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0 and last.startswith('{"gpu_check"'), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(last)["gpu_check"]
    assert summary["mode"] == "dry-run" and summary["ok"]
    assert set(summary["checks"]) == set(gpu_check.CHECKS)
    assert all(check["ok"] for check in summary["checks"].values()), summary["checks"]
    wheels = summary["wheels"]
    assert wheels["problems"] == [] and wheels["declared_bytes"] + wheels["tree_bytes"] <= 64 * 2**20
    # the learner check starts with nccl (unavailable on CPU) and falls back: the fallback code ran too
    assert summary["checks"]["learner_step"]["backend"] == "gloo"
    assert set(summary["checks"]["learner_step"]["failed_backends"]) == {"nccl", "cpu:gloo,cuda:nccl"}
    assert summary["checks"]["e2e_train"]["dry_run"][0].startswith("megarl: dry run, would launch: torchrun")
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == {"gpu_check": summary}
    log = (tmp_path / "gpu_check.log").read_text()
    assert "===== publish_bandwidth" in log
    # env in a fresh interpreter (the GPU's way of starting a check), every other check forked
    assert "===== env (backend gloo, exit 0)\n" in log
    assert all(f"===== {name} (backend gloo, exit 0, forked)" in log for name in gpu_check.CHECKS if name != "env")


def test_a_forked_check_past_its_timeout_is_killed_with_its_group_and_named(tmp_path):
    # In a fresh interpreter: a fork of pytest's (its threads) could inherit a held lock.
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import gpu_check, json; "
            f"cmd = gpu_check.child_command('env', 'cpu', True, {str(tmp_path)!r}, 0.01, 'gloo'); "
            "print(json.dumps(gpu_check.run_forked(cmd, 0.01)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rc, stdout, _ = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rc == "timeout" and gpu_check.RESULT not in stdout


def test_the_wheel_list_names_each_package_once_for_cpython_312_with_the_download_command():
    names = [gpu_check.norm(name) for name, *_ in gpu_check.WHEELS]
    assert len(names) == len(set(names)) and {"megatron-core", "omegaconf", "pyzmq"} <= set(names)
    report = gpu_check.wheel_report(None, download=False)
    assert report["problems"] == [], report
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--print-wheels"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    command = proc.stdout.strip().splitlines()[-1]
    assert "-m pip download --no-deps --only-binary=:all: --python-version 3.12" in command
    assert "--platform manylinux_2_28_x86_64" in command and "megatron-core==0.16.1" in command


def test_stale_mask_reads_the_masked_share_from_the_loss_metrics_a_run_writes():
    rows = [{"mask/tokens": 100.0, "mask/lag_frac": 0.25}, {"mask/tokens": 300.0, "mask/lag_frac": 0.0}]
    assert gpu_check.masked_token_frac(rows) == 25 / 400
