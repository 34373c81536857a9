"""How a command outside a running job reaches it: the run's contact file, `RUN_DIR/.megarl.contact`.

Under fault.on_failure=replace learner rank 0 writes it at start and removes it when it exits: the rendezvous
store's address and key space (megarl.distributed.topology.connect_store), the run secret that signs every record
there (megarl.secret), the sampler ranks, and the learner's host and pid. `megarl samplers remove` reads it to
talk to the learner. It holds the secret, so it is created with mode 0600 in a run.dir of the run's own user
(megarl.run_lock), without following a link, and a reader refuses one that is not a regular file of its own user
with no access for others. A run killed outright leaves it behind: a reader on the learner's host sees that its
pid is gone, elsewhere the store is no longer reachable.
"""
from __future__ import annotations

import json
import os
import pwd
import socket
import stat
from pathlib import Path

NAME = ".megarl.contact"


class ContactError(RuntimeError):
    """The run in this directory cannot be reached: the message says why and what to do."""


def contact_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / NAME


def write_contact(run_dir: str | Path, record: dict) -> Path:
    """Write the contact file (replacing a dead run's), mode 0600; its path."""
    path = contact_path(run_dir)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({**record, "host": socket.gethostname(), "pid": os.getpid()}, f)
    return path


def remove_contact(run_dir: str | Path) -> None:
    contact_path(run_dir).unlink(missing_ok=True)


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def read_contact(run_dir: str | Path) -> dict:
    """The live run's contact record, or ContactError: no run dir, another user's run, no contact file (the run
    finished, or it does not run under fault.on_failure=replace), or a finished run's file left behind."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ContactError(f"{run_dir} is not a directory: give the run's run.dir")
    owner = run_dir.stat().st_uid
    if owner != os.getuid():
        raise ContactError(f"{run_dir} belongs to user {_user(owner)}: only the run's own user can change its samplers")
    path = contact_path(run_dir)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise ContactError(f"no running job in {run_dir}: {NAME} is absent (the run has finished, or it was not "
                           f"started with fault.on_failure=replace)") from None
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ContactError(f"{path} is not a regular file of user {_user(os.getuid())} with mode 0600: refused "
                           f"(it holds the run secret; remove it if the run is over)")
    record = json.loads(path.read_text())
    if record.get("host") == socket.gethostname() and not _alive(int(record["pid"])):
        raise ContactError(f"the run in {run_dir} has finished: its learner (pid {record['pid']}) is gone "
                           f"({NAME} was left by a run that was killed)")
    return record


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process has the pid now: the learner (this user's) is gone
    return True
