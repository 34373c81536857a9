"""What a checkpoint must be before megarl loads it: loading one never runs code planted in it.

Two of the formats megarl reads are pickles: torch DCP's `.metadata` (megatron's `dist_checkpointing` and the
HF export read it with `pickle.load`) and DeepSpeed's `*.pt` files (`torch.load(weights_only=False)`).
`check_trusted(path)` runs before any of them is opened:

  * ownership: the checkpoint directory and everything in it belong to the user running megarl and are not
    writable by others, nor by a group other than the user's own memberless one, so no other user (and no
    sandboxed code, which runs as no user that owns files there) can have planted or can swap a file between
    this check and the load;
  * every DCP `.metadata` is read first with `SafeMetadataUnpickler`, which resolves only the classes torch
    writes into it (its metadata dataclasses, `torch.Size`, dtypes, `PosixPath`): any other global (`os.system`,
    `subprocess.Popen`, ...) is refused before it is looked up, so the pickle cannot call it. What passes
    this check, `pickle.load` then reads to the same objects.

DeepSpeed's pickles name DeepSpeed's and torch's own classes freely, so they get the ownership check only.
"""
from __future__ import annotations

import enum
import io
import os
import pickle
import stat
from pathlib import Path

from megarl.checkpoint.storage import CheckpointError

# (module, name) pairs torch's DCP writes into `.metadata` (torch 2.13: torch.distributed.checkpoint's
# FileSystemWriter pickles a `Metadata` dataclass tree), plus `torch.<dtype>` names (checked to be dtypes).
_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("collections", "OrderedDict")}


# How some Python releases pickle an Enum member (3.11.2 does, 3.11.7 does not: it writes `cls(value)`):
# `getattr(cls, name)`; DCP's metadata holds one (`_MEM_FORMAT_ENCODING`). Protocols < 3 name the module __builtin__.
_GETATTR = {("builtins", "getattr"), ("__builtin__", "getattr")}


def _enum_member(cls, name):
    """`getattr(cls, name)` as the unpickler may apply it: only a member, by name, of an Enum class the unpickler
    resolved (the only objects a REDUCE can take as `cls` are what find_class returned or plain data)."""
    if not (isinstance(cls, enum.EnumMeta) and isinstance(name, str) and name in cls.__members__):
        raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not an Enum member of torch's checkpoint "
                                     f"metadata")
    return cls.__members__[name]


class SafeMetadataUnpickler(pickle.Unpickler):
    """Unpickles torch DCP metadata; any global outside `_DCP_GLOBALS` and torch's dtypes is refused, and getattr
    is only ever an Enum member's lookup (`_enum_member`)."""

    def find_class(self, module: str, name: str):
        if (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if (module, name) in _GETATTR:
            return _enum_member
        if module == "torch":
            import torch

            if isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of torch's checkpoint metadata")


def read_dcp_metadata(path: Path):
    """The DCP metadata in `path` (a `.metadata` file), through SafeMetadataUnpickler; CheckpointError
    naming the file when it holds anything else."""
    try:
        return SafeMetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means: not a checkpoint megarl wrote
        raise CheckpointError(f"{path} is not plain torch checkpoint metadata ({type(exc).__name__}: {exc}); "
                              f"refusing to load it: a pickle there could run code") from None


def check_trusted(path: str | Path) -> None:
    """CheckpointError unless the checkpoint directory `path` passes the checks in the module docstring."""
    path = Path(path)
    me = os.geteuid()
    for entry in [path, *sorted(path.rglob("*"))]:
        info = entry.stat()  # a symlink is judged by what it points to: that is what the load reads
        if info.st_uid != me:
            raise CheckpointError(f"{entry} belongs to uid {info.st_uid}, not to this user (uid {me}); megarl loads "
                                  f"only checkpoints its user owns (a planted pickle could run code): copy it, "
                                  f"or chown it to uid {me}, if you trust it")
        if info.st_mode & stat.S_IWOTH or (info.st_mode & stat.S_IWGRP and not _private_group(info.st_gid)):
            raise CheckpointError(f"{entry} is writable by group or others (mode {stat.filemode(info.st_mode)}); "
                                  f"megarl loads only checkpoints no one else can change: chmod go-w -R {path}, "
                                  f"if you trust it")
    for metadata in sorted(path.glob("*.metadata")):
        read_dcp_metadata(metadata)


def _private_group(gid: int) -> bool:
    """Is `gid` this user's own group with no other members (a umask of 002 makes files group-writable there)?"""
    import grp

    try:
        return gid == os.getegid() and not grp.getgrgid(gid).gr_mem
    except KeyError:
        return False
