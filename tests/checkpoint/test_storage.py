"""Checkpoint directories: `latest` only ever names a complete checkpoint; retention; leftovers."""
import os

import pytest

from megarl.checkpoint import storage
from megarl.checkpoint.storage import CheckpointError, MANIFEST


def write_checkpoint(root, step, keep=2):
    temp = storage.prepare_temp(root, step)
    (temp / "shard").write_bytes(os.urandom(64))
    (temp / MANIFEST).write_text(f'{{"step": {step}}}')
    return storage.commit(root, temp, step, keep)


def test_commit_renames_and_moves_latest(tmp_path):
    assert storage.find_latest(tmp_path) is None
    first = write_checkpoint(tmp_path, 3)
    assert first == tmp_path / "step_00000003" and (first / "shard").is_file()
    assert storage.find_latest(tmp_path) == first
    second = write_checkpoint(tmp_path, 6)
    assert storage.find_latest(tmp_path) == second
    assert storage.resolve(tmp_path) == second and storage.resolve(first) == first
    assert not list(tmp_path.glob(".tmp-*")) and not (tmp_path / "latest.tmp").exists()


def test_keep_retains_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        write_checkpoint(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000003", "step_00000004"]


def test_an_uncommitted_save_leaves_latest_alone_and_is_cleared_by_the_next(tmp_path):
    good = write_checkpoint(tmp_path, 3)
    dead = storage.prepare_temp(tmp_path, 6)  # a save that died before its commit
    (dead / "shard").write_bytes(b"partial")
    assert storage.find_latest(tmp_path) == good
    write_checkpoint(tmp_path, 9)
    assert not dead.exists()


def test_commit_refuses_an_incomplete_temp_dir(tmp_path):
    temp = storage.prepare_temp(tmp_path, 1)
    with pytest.raises(CheckpointError, match="no megarl.json"):
        storage.commit(tmp_path, temp, 1, keep=2)
    assert storage.find_latest(tmp_path) is None


def test_orphans_newer_than_latest_are_replaced_and_pruned(tmp_path):
    # A save renamed step_9 and died before moving `latest`; the run resumed from step 6.
    write_checkpoint(tmp_path, 6)
    orphan = tmp_path / "step_00000009"
    orphan.mkdir()
    (orphan / "stale").write_text("from the rolled-back history")
    write_checkpoint(tmp_path, 7)  # prune drops the orphan (newer than `latest`)
    assert not orphan.exists()
    orphan.mkdir()
    (orphan / "stale").write_text("again")
    replaced = write_checkpoint(tmp_path, 9)  # and a save of that very step replaces it
    assert not (replaced / "stale").exists() and storage.find_latest(tmp_path) == replaced


def test_a_pointer_to_something_incomplete_is_an_error_naming_it(tmp_path):
    (tmp_path / "latest").write_text("step_00000005\n")
    with pytest.raises(CheckpointError, match="step_00000005"):
        storage.find_latest(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint at") as refused:
        storage.resolve(tmp_path / "nowhere")
    assert "checkpoint.every_steps" in str(refused.value) and "checkpoint.export_dir" in str(refused.value)
