"""Checkpoint directories on disk: the temp dir, the atomic commit, the `latest` pointer, retention.

Layout of ``checkpoint.dir``::

    step_00000006/        a complete checkpoint (only complete ones ever carry this name)
    step_00000009/
    latest                one line: the name of the newest complete checkpoint
    .tmp-step_00000012/   a save in progress, or the leftovers of one that died (removed by the next save)

Commit (rank 0, once every rank has written and fsynced its shards and the manifest is in place):
fsync every file of the temp dir and the dir itself, rename it to ``step_N``, fsync the root, write
``latest.tmp``, fsync it, ``os.replace`` it onto ``latest``, fsync the root.  A crash at any point
leaves ``latest`` naming a complete checkpoint: the previous one until the ``os.replace``, the new
one after it.  Pure filesystem code: no torch, no process group.
"""
from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

LATEST = "latest"
MANIFEST = "megarl.json"  # written last into the temp dir; the run state (megarl/checkpoint/learner_state.py)
TEMP_PREFIX = ".tmp-"
# Test hook: seconds to sleep after the checkpoint is complete in its temp dir, before the rename
# (tests/checkpoint kill the process there to prove a dying save never touches `latest`).
PAUSE_ENV = "MEGARL_TEST_CHECKPOINT_PAUSE_S"
_STEP_DIR = re.compile(r"step_(\d{8})")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def temp_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{TEMP_PREFIX}{step_dir_name(step)}"


def prepare_temp(root: str | Path, step: int) -> Path:
    """A fresh, empty temp dir for the checkpoint of `step`; leftovers of dead saves are removed first."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for leftover in root.glob(f"{TEMP_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    temp = temp_dir(root, step)
    temp.mkdir()
    return temp


def discard(temp: str | Path) -> None:
    shutil.rmtree(temp, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file below `path` and every directory entry to disk (data written by any process)."""
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            _fsync(Path(dirpath) / name)
        _fsync(Path(dirpath))


def commit(root: str | Path, temp: Path, step: int, keep: int) -> Path:
    """Publish the complete checkpoint in `temp` as step_N and point `latest` at it; returns step_N."""
    root = Path(root)
    if not (temp / MANIFEST).is_file():
        raise CheckpointError(f"refusing to commit {temp}: it has no {MANIFEST} (incomplete checkpoint)")
    fsync_tree(temp)
    pause = float(os.environ.get(PAUSE_ENV, "0"))
    if pause > 0:
        time.sleep(pause)
    final = root / step_dir_name(step)
    current = latest_name(root)
    if final.exists():
        # A step_N newer than `latest` is an orphan: a save that renamed its dir and died before
        # moving the pointer, in a history the run has since rolled back.
        if final.name == current:
            raise CheckpointError(f"refusing to overwrite {final}: `latest` points at it")
        shutil.rmtree(final)
    os.rename(temp, final)
    _fsync(root)
    pointer = root / f"{LATEST}.tmp"
    with open(pointer, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)
    _fsync(root)
    prune(root, keep)
    return final


def latest_name(root: str | Path) -> str | None:
    """The checkpoint name `latest` holds, or None when there is no `latest` file."""
    try:
        return (Path(root) / LATEST).read_text().strip()
    except FileNotFoundError:
        return None


def find_latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None if none was ever committed there."""
    name = latest_name(root)
    if name is None:
        return None
    path = Path(root) / name
    if not _STEP_DIR.fullmatch(name) or not (path / MANIFEST).is_file():
        raise CheckpointError(f"{Path(root) / LATEST} names {name!r}, which is not a complete checkpoint "
                              f"({path / MANIFEST} missing); the checkpoint directory was modified by hand")
    return path


def resolve(path: str | Path) -> Path:
    """A checkpoint dir (holds the manifest) or a checkpoint root (holds `latest`) -> the checkpoint dir."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    found = find_latest(path) if path.is_dir() else None
    if found is None:
        raise CheckpointError(f"no checkpoint at {path}: expected a checkpoint directory (with {MANIFEST}) "
                              f"or a checkpoint.dir holding a `{LATEST}` file; a run saves checkpoints there only "
                              f"with checkpoint.every_steps=N (or exports its final model with "
                              f"checkpoint.export_dir=DIR)")
    return found


def committed_steps(root: str | Path) -> dict[int, Path]:
    """step -> dir of every step_N directory under `root`."""
    found = {}
    for path in Path(root).iterdir():
        match = _STEP_DIR.fullmatch(path.name)
        if match and path.is_dir():
            found[int(match[1])] = path
    return found


def prune(root: str | Path, keep: int) -> None:
    """Keep the checkpoint `latest` names and the keep-1 newest before it; remove the rest, including
    orphans newer than `latest` (see `commit`)."""
    current = latest_name(root)
    steps = committed_steps(root)
    newest = max((s for s, p in steps.items() if p.name == current), default=None)
    if newest is None:
        return
    kept = sorted((s for s in steps if s <= newest), reverse=True)[:keep]
    for step, path in steps.items():
        if step not in kept:
            shutil.rmtree(path, ignore_errors=True)
