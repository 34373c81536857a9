"""run.dir is held by one run at a time: real processes contend for it (megarl/run_lock.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megarl import run_lock
from tests.helpers import REPO

HOLD = ("import sys, time; from megarl import run_lock; run_lock.hold(sys.argv[1]); print('held', flush=True); "
        "time.sleep(120)")
TRY = ("import sys; from megarl import run_lock\n"
       "try:\n    run_lock.hold(sys.argv[1]); print('took it')\n"
       "except run_lock.RunDirError as exc:\n    print(exc); sys.exit(3)")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != run_lock.HELD_ENV}
    return {**env, "PYTHONPATH": str(REPO), **extra}


@pytest.fixture
def holder(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, env=_env())
    assert proc.stdout.readline().strip() == "held"
    yield run_dir, proc
    proc.kill()
    proc.wait(timeout=10)


def _try(run_dir, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", TRY, str(run_dir)], capture_output=True, text=True,
                          env=_env(**env), timeout=60)


def test_a_second_process_is_refused_naming_the_first_until_the_first_is_killed(holder):
    run_dir, first = holder
    second = _try(run_dir)
    assert second.returncode == 3, second.stderr
    assert f"run.dir {run_dir} is in use by the run started " in second.stdout
    assert f"as pid {first.pid} on " in second.stdout and "wait for it to end, or choose another run.dir" in second.stdout
    with pytest.raises(run_lock.RunDirError, match=f"as pid {first.pid} on "):  # what a --dry-run checks
        run_lock.check_free(run_dir)
    first.send_signal(signal.SIGKILL)  # a dead run's lock file stays behind and must not block
    first.wait(timeout=10)
    assert (run_dir / run_lock.LOCK_NAME).is_file()
    run_lock.check_free(run_dir)
    assert _try(run_dir).stdout.strip() == "took it"


def test_a_worker_of_the_launcher_that_holds_it_goes_on_and_any_other_claim_is_refused(holder):
    run_dir, first = holder
    ours = _try(run_dir, **{run_lock.HELD_ENV: f"{first.pid}:{run_dir.resolve()}"})
    assert ours.returncode == 0 and "in use" not in ours.stdout, ours.stdout + ours.stderr
    for claim in (f"{first.pid + 1}:{run_dir.resolve()}", f"{first.pid}:{run_dir.parent}"):  # another launcher, dir
        other = _try(run_dir, **{run_lock.HELD_ENV: claim})
        assert other.returncode == 3 and f"as pid {first.pid} on " in other.stdout, claim


def test_a_run_dir_that_is_a_file_is_refused_and_a_dry_check_creates_nothing(tmp_path):
    (tmp_path / "f").write_text("x")
    for run_dir, named in ((tmp_path / "f", f"run.dir {tmp_path / 'f'} is a file"),
                           (tmp_path / "f" / "sub", f"run.dir {tmp_path / 'f' / 'sub'}: {tmp_path / 'f'} is a file")):
        for check in (run_lock.check_free, run_lock.hold):
            with pytest.raises(run_lock.RunDirError, match="not a directory; set run.dir to a directory") as exc:
                check(run_dir)
            assert named in str(exc.value)
    run_lock.check_free(tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_megarl_sft_refuses_a_held_run_dir_before_launch_naming_the_run(holder):
    # megarl train: roles/test_faults.py::test_a_job_killed_mid_run_resumes_from_its_last_checkpoint, with a real run.
    run_dir, first = holder
    data = run_dir.parent / "sft.jsonl"
    data.write_text('{"prompt": "ab<", "completion": "ba"}\n')
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "sft", "configs/sft.yaml", f"run.dir={run_dir}",
                           f"sft.data={data}", "sft.eval_data="], capture_output=True, text=True, env=_env(), cwd=REPO,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"megarl: run.dir {run_dir} is in use by the run started "), proc.stderr
    assert f"as pid {first.pid} on " in proc.stderr and "launching" not in proc.stdout


def test_a_lock_file_planted_as_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "precious"
    target.write_text("root's file\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / run_lock.LOCK_NAME).symlink_to(target)
    with pytest.raises(run_lock.RunDirError, match="symlink, which megarl does not follow"):
        run_lock.hold(run_dir)
    with pytest.raises(run_lock.RunDirError, match="symlink"):
        run_lock.check_free(run_dir)
    assert target.read_text() == "root's file\n"


def test_a_run_dir_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    other = run_dir.stat().st_uid + 1
    monkeypatch.setattr(run_lock.os, "geteuid", lambda: other)  # this process as another user than run.dir's
    with pytest.raises(run_lock.RunDirError, match=f"belongs to uid {other - 1}, not to this user \\(uid {other}\\)"):
        run_lock.hold(run_dir)
    assert list(run_dir.iterdir()) == []
