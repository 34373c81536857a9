"""megarl.cached_env: a separate environment is built once, in ENV.partial under a lock, and only looks ready
after its install step passed (real `python -m venv`, real subprocesses; the install step here is a check run by
the new environment's own python instead of pip, so the test needs no network)."""
from __future__ import annotations

import json
import subprocess

import pytest

from megarl.cached_env import CachedEnv


def make_env(tmp_path, monkeypatch, want="1"):
    monkeypatch.setenv("MEGARL_TEST_ENV", str(tmp_path / "the-env"))
    return CachedEnv("the-env", "MEGARL_TEST_ENV", "ready.json", is_current=lambda r: r.get("v") == want,
                     label="test env")


def test_built_once_then_ready_and_rebuilt_for_other_pins(tmp_path, monkeypatch):
    env = make_env(tmp_path, monkeypatch)
    announced, installs = [], []

    def install(py: str) -> dict:
        installs.append(py)
        assert py.endswith("the-env.partial/bin/python")  # built beside the final directory, not in it
        assert not env.is_ready()
        return {"v": env.run([py, "-c", "print(1)"], "the check").strip()}

    python, seconds = env.ensure(install, lambda: announced.append(1))
    assert python == tmp_path / "the-env" / "bin" / "python" and seconds > 0
    assert subprocess.run([str(python), "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                          check=True).stdout.strip() == str(tmp_path / "the-env")  # a rename keeps it working
    assert json.loads((tmp_path / "the-env" / "ready.json").read_text())["v"] == "1"
    assert env.ensure(install, lambda: announced.append(1)) == (python, 0.0)  # ready: nothing runs
    assert len(installs) == len(announced) == 1
    # A READY record of other pins is stale: the next call builds afresh.
    assert not make_env(tmp_path, monkeypatch, want="2").is_ready()


def test_a_failed_install_leaves_nothing_that_looks_ready(tmp_path, monkeypatch):
    env = make_env(tmp_path, monkeypatch)

    def install(py: str) -> dict:
        env.run([py, "-c", "import no_such_package_here"], "import no_such_package_here")
        return {"v": "1"}

    with pytest.raises(RuntimeError, match="(?s)test env: import no_such_package_here failed .*ModuleNotFoundError"):
        env.ensure(install, lambda: None)
    assert not env.is_ready() and not (tmp_path / "the-env").exists()
