"""The per-run secret: the key that authenticates every message and store record megarl's processes exchange.

`megarl train` and the launch/ scripts generate it (`new_secret`) and hand it to every rank in the
environment variable MEGARL_RUN_SECRET (a process's environment is readable only by its own user and
root). A raw `torchrun -m megarl.roles.worker` without it:
  * single node (every rank on this machine): the ranks share one generated secret through a file
    created with mode 0600 in a directory only this user can enter (`$XDG_RUNTIME_DIR/megarl`, else
    `/tmp/megarl-<uid>`, refused if another user owns it or can enter it), named by the torchrun agent
    (its run id and pid, which every local rank shares);
  * several nodes: refused, saying how to set it (the nodes share no private file).
The shared file is removed when the first of the ranks that read it exits (every rank reads it at start,
and no rank ends before the run does), so secrets of ended runs do not accumulate there.
The secret is never printed; errors name the variable, not its value.
"""
from __future__ import annotations

import atexit
import os
import secrets
import stat
import time
from pathlib import Path

ENV = "MEGARL_RUN_SECRET"
MIN_HEX = 32  # 16 bytes at least


def new_secret() -> str:
    return secrets.token_hex(32)


def run_secret(wait_s: float = 30.0) -> bytes:
    """This run's secret as key bytes (see the module docstring for where it comes from)."""
    value = os.environ.get(ENV)
    if value is None:
        value = _shared_local_secret(wait_s)
        os.environ[ENV] = value  # children (reward workers, engine servers) of this rank inherit it
    if len(value) < MIN_HEX:
        raise RuntimeError(f"megarl: {ENV} is too short (at least {MIN_HEX} characters; "
                           f"`python -c 'import secrets; print(secrets.token_hex(32))'` makes one)")
    return value.encode()


def _shared_local_secret(wait_s: float) -> str:
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if local is None or world is None or local != world:
        raise RuntimeError(
            f"megarl: {ENV} is not set. `megarl train` and launch/*.sh set it; a multi-node launch must give every "
            f"node the same value: export {ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))') "
            f"once, and pass it to each node privately (docs/security.md)")
    directory = _private_dir()
    agent = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}-{os.getppid()}"
    path = directory / f"run-secret-{agent}"
    if not path.exists():
        tmp = directory / f".run-secret-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(new_secret())
        try:
            os.link(tmp, path)  # atomic: the first rank's file wins, complete
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    deadline = time.monotonic() + wait_s
    while True:
        try:
            value = path.read_text().strip()
            atexit.register(_remove, path)
            return value
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"megarl: the run secret file {path} did not appear within {wait_s:.0f}s")
            time.sleep(0.05)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:  # another rank of the run removed it first
        pass


def secret_dirs() -> list[str]:
    """Every directory this user's shared secret files may be in (the sandbox hides them all; the first is
    the one used)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    own = [str(Path(base) / "megarl")] if base and os.path.isdir(base) else []
    return [*own, f"/tmp/megarl-{os.getuid()}"]


def _private_dir() -> Path:
    directory = Path(secret_dirs()[0])
    directory.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise RuntimeError(f"megarl: {directory} is not a directory private to this user (owner uid {info.st_uid}, "
                           f"mode {oct(info.st_mode & 0o777)}): cannot share the run secret there; set {ENV}")
    return directory
