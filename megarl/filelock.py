"""An exclusive lock on a file, for what is built once per machine and shared by every process that needs it
(the embedded models, the vLLM environment): the first process builds, the others wait and reuse."""
from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path


@contextlib.contextmanager
def exclusive(lock_path: Path):
    """Hold an exclusive flock on `lock_path` (created if missing) for the `with` block."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
