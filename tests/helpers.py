"""Shared test helpers: run real torchrun launches and python subprocesses with a deadline."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 120,
                 module: bool = False) -> subprocess.CompletedProcess:
    """A real `torchrun --standalone` launch; output captured, failing loudly on timeout."""
    target = ["-m", str(script)] if module else [str(script)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *target, *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def run_python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO)
