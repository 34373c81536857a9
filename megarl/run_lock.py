"""A run holds its run.dir exclusively for its lifetime, so two runs never mix their records in one directory.

The lock is an flock on `run.dir/.megarl.lock`, taken without waiting: a second run started into the same
run.dir is refused (`RunDirError`, naming the first run's pid, host, start time and command, which the
holder writes into the lock file). The kernel releases an flock when its holder dies, however it dies, so a
lock file left by a killed run never blocks the next one.

Who holds it:
  * `megarl train` / `megarl sft` take it before their checks of run.dir and keep it until torchrun exits;
    they pass `HELD_ENV` (their pid) to the workers, and the worker that writes run.dir confirms the lock
    is still held by that pid instead of taking it again (which would fail: flock locks of different open
    files exclude each other even in related processes).
  * a raw `torchrun -m megarl.roles.worker` / `megarl.sft.run` launch: that worker (rank 0) takes it itself
    and holds it until it exits.
A `--dry-run` only checks that run.dir is free (creating nothing).

run.dir must belong to the user running megarl, and the lock file is opened without following a symlink
and must be a regular file of that user's: otherwise another user who can write into run.dir could plant
`.megarl.lock` as a link and have a run (root's, say) truncate the file it points to.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import shlex
import socket
import stat
import sys
from pathlib import Path

LOCK_NAME = ".megarl.lock"
HELD_ENV = "MEGARL_RUN_DIR_HELD_BY"  # "<launcher pid>:<run.dir resolved>", set by megarl train / sft for torchrun

_held: dict[Path, object] = {}  # run.dir -> its open lock file, kept open for this process's lifetime


class RunDirError(RuntimeError):
    """run.dir cannot be used by this run: another live run holds it, or it is not a directory."""


def hold(run_dir: str | Path) -> None:
    """Take run.dir for this process's lifetime (creating it), or RunDirError naming the run that holds it.
    Holding it already, or being a worker of the launcher that holds it (`HELD_ENV`), is fine."""
    run_dir = _usable(run_dir)
    if run_dir in _held:
        return
    launcher = _launcher_holding(run_dir)
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # a new run.dir is this user's alone
    _check_owner(run_dir)
    lock = _open_lock(run_dir, create=True)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(lock)
        lock.close()
        if launcher is not None and holder.get("pid") == launcher:
            return  # our launcher holds it for the whole torchrun
        raise RunDirError(_in_use(run_dir, holder)) from None
    lock.truncate(0)
    lock.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": _now(),
                           "command": _command()}) + "\n")
    lock.flush()
    _held[run_dir] = lock


def release_unused(run_dir: str | Path) -> None:
    """Let go of a run.dir this process holds and, when nothing but the lock file is in it, remove it: a run
    refused before launch leaves no directory behind that it created only to hold the lock."""
    run_dir = Path(run_dir)
    lock = _held.pop(run_dir, None)
    if lock is None:
        return
    lock.close()
    if [p.name for p in run_dir.iterdir()] == [LOCK_NAME]:
        (run_dir / LOCK_NAME).unlink()
        run_dir.rmdir()


def check_free(run_dir: str | Path) -> None:
    """RunDirError if another live run holds run.dir (or it is not a directory); takes nothing, creates nothing."""
    run_dir = _usable(run_dir)
    path = run_dir / LOCK_NAME
    if run_dir in _held or not os.path.lexists(path):
        return
    _check_owner(run_dir)
    with _open_lock(run_dir, create=False) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirError(_in_use(run_dir, _read_holder(lock))) from None


def launcher_env(run_dir: str | Path) -> dict[str, str]:
    """The environment entry telling this launcher's workers that it holds run.dir."""
    return {HELD_ENV: f"{os.getpid()}:{Path(run_dir).resolve()}"}


def _usable(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir).expanduser().resolve()
    for path in (run_dir, *run_dir.parents):
        if path.exists():
            if not path.is_dir():
                what = "" if path == run_dir else f": {path}"
                raise RunDirError(f"run.dir {run_dir}{what} is a file, not a directory; set run.dir to a directory")
            break
    return run_dir


def _check_owner(run_dir: Path) -> None:
    owner, me = run_dir.stat().st_uid, os.geteuid()
    if owner != me:
        raise RunDirError(f"run.dir {run_dir} belongs to uid {owner}, not to this user (uid {me}): its owner could "
                          f"plant files there that this run would write through; use a run.dir of your own, or "
                          f"chown it to uid {me}")


def _open_lock(run_dir: Path, create: bool):
    """The lock file opened for reading and appending, never through a symlink (O_NOFOLLOW), and only if it
    is a regular file of this user's with one link (a hard link to another file would be written too)."""
    path = run_dir / LOCK_NAME
    flags = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        why = "it is a symlink, which megarl does not follow" if os.path.islink(path) else exc.strerror
        raise RunDirError(f"run.dir {run_dir}: cannot open {LOCK_NAME} ({why}); remove {path} if no run is "
                          f"using run.dir") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_nlink != 1:
        os.close(fd)
        raise RunDirError(f"run.dir {run_dir}: {path} is not a regular file of this user's with a single link; "
                          f"remove it if no run is using run.dir")
    return os.fdopen(fd, "a+")


def _launcher_holding(run_dir: Path) -> int | None:
    pid, _, held_dir = os.environ.get(HELD_ENV, "").partition(":")
    return int(pid) if pid.isdigit() and Path(held_dir) == run_dir else None


def _read_holder(lock) -> dict:
    lock.seek(0)
    try:
        holder = json.loads(lock.read() or "{}")
    except ValueError:
        holder = {}
    return holder if isinstance(holder, dict) else {}


def _in_use(run_dir: Path, holder: dict) -> str:
    who = (f"the run started {holder.get('started', '?')} as pid {holder.get('pid', '?')} on "
           f"{holder.get('host', '?')} ({holder.get('command', '?')})" if holder else "another megarl run")
    return (f"run.dir {run_dir} is in use by {who}; two runs in one run.dir would mix their records: wait for "
            f"it to end, or choose another run.dir")


def _command() -> str:
    """This process's command line as it was typed: `megarl train ...`, `-m megarl.roles.worker ...` (under
    torchrun) rather than the module's file path that sys.argv holds."""
    program, package = Path(sys.argv[0]).resolve(), Path(__file__).resolve().parent
    if program.is_relative_to(package):
        module = ".".join(("megarl", *program.relative_to(package).with_suffix("").parts))
        return " ".join(["megarl" if module == "megarl.cli" else f"-m {module}", shlex.join(sys.argv[1:])])
    return shlex.join(sys.argv)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
