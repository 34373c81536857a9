"""Checks remembered by what they read: a check that costs seconds (loading a tokenizer with transformers) runs
once per content, not once per command.

A check's key hashes the bytes of the files it reads and whatever else decides its outcome (library versions, the
checking code's source, the numbers it compares against). Only outcomes that let a run go are remembered (a pass,
or the counts an informational line reports), so a refusal is always recomputed and explained. The memo is a
JSON object {key: outcome} in a file the caller names; a lost, unreadable or read-only memo only costs the check
again (concurrent writers: the last rename wins).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

MAX_KEYS = 256  # the most recent keys kept: a memo grows with each distinct content checked
MEMO_FILE = ".check-memo.json"  # in model.cache_dir (megarl's own cache, never the model's directory)


def memo_path(cache_dir: str | Path) -> Path:
    """The memo of model.cache_dir `cache_dir`."""
    return Path(cache_dir).expanduser() / MEMO_FILE


def content_key(files: list[Path], *extra: str) -> str:
    """sha256 over each file's name and bytes (in the given order) and `extra`."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for item in extra:
        digest.update(item.encode() + b"\0")
    return digest.hexdigest()


def _read(memo_path: Path) -> dict:
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def recall(memo_path: Path, key: str):
    """The outcome remembered under `key`, or None."""
    return _read(memo_path).get(key)


def remember(memo_path: Path, key: str, outcome=True) -> None:
    """Remember `outcome` (JSON) under `key` (best effort)."""
    memo = {k: v for k, v in _read(memo_path).items() if k != key}
    memo = dict(list(memo.items())[-(MAX_KEYS - 1):]) | {key: outcome}
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{memo_path.name}.", dir=memo_path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(memo, f)
        os.replace(tmp, memo_path)
    except OSError:
        pass  # a read-only cache: the check runs again next time


# What a tokenizer loader never reads: the weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def tokenizer_inputs(model_dir: Path) -> list[Path]:
    """Every file of `model_dir` a tokenizer loader may read (AutoTokenizer reads config.json too): all but the
    weights and hidden files, by name."""
    return sorted(p for p in Path(model_dir).iterdir()
                  if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES) and not p.name.startswith("."))
