"""Save and load the learner's state: megatron dist-checkpointing shards plus the run manifest.

A checkpoint directory (docs/checkpoint.md) holds
  * the model and the optimizer (Adam moments and step) as megatron-core ShardedTensors, written by
    torch.distributed.checkpoint (DCP): ``__<rank>_0.distcp`` per writing rank, ``.metadata``,
    ``common.pt`` (the non-tensor optimizer state), ``metadata.json`` (megatron's format tag).  Every
    shard is named by its place in the full (TP=1, PP=1) tensor, so a checkpoint written under one
    tp/pp/dp layout loads under any other: megatron's ``dist_checkpointing.load`` reshards;
  * every rank's RNG states (python, numpy, torch CPU, CUDA, megatron's model-parallel tracker), one
    ShardedObject per (pp, tp, dp) coordinate; restored only under the layout that wrote them;
  * ``critic/`` (advantage.estimator=gae, either backend): the learned critic's value model as an HF
    token-classification directory plus its Adam state (megarl.learner.critic), written by rank 0;
  * ``megarl.json`` (the manifest; written last): step, policy version, layout, HF config, the
    caller's run records (the data position) and the model directory; ``hf/``: the model's config and
    tokenizer files, so an export needs nothing outside the checkpoint.

Why not ``dist_checkpointing.save``: its torch_dist writer forks a writer process per rank and
spawns a multiprocessing manager (a writer that dies leaves the save waiting forever; it also needs
psutil and calls torch.cuda.synchronize), and its rank-0-only writes (common.pt, metadata.json) can
fail on rank 0 while the other ranks wait in the next collective.  Here the same megatron
preprocessing feeds DCP's in-process writer, and every step that can fail on some ranks ends in an
exchange of outcomes, so a failed save raises the same CheckpointError on every learner rank and
the partial temp dir is removed.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from megarl.checkpoint.storage import (
    MANIFEST, CheckpointError, commit, discard, find_latest, prepare_temp, resolve, temp_dir,
)
from megarl.checkpoint.manifest import FORMAT, check_resumable, layout_of, read_manifest  # noqa: F401
from megarl.checkpoint.trust import check_trusted

RNG_KEY = "megarl/rng_state"
HF_META_DIR = "hf"  # the model's config.json, generation_config.json, tokenizer files
# Files of an HF model directory that are weights (everything else there is small and is copied).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")
# HF config keys that fix the tensor shapes: a checkpoint only loads into the same architecture.
ARCHITECTURE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings")


def _agree(fn: Callable[[], object], what: str):
    """Run `fn` on every learner rank, then exchange outcomes: if it raised anywhere, raise a
    CheckpointError naming `what` and the failures on EVERY rank; else return this rank's result.

    `fn` must leave every rank outside any collective whether it fails or not (DCP's save and load
    do: they exchange their own exceptions), so no rank is left waiting for one that gave up.
    """
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        result, error = fn(), None
    except (Exception, CheckpointException) as exc:  # any failure must reach the other ranks
        result, error = None, exc
    outcomes: list = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, None if error is None else _describe(error))
    failed = [(rank, msg) for rank, msg in enumerate(outcomes) if msg is not None]
    if failed:
        unique = list(dict.fromkeys(msg for _, msg in failed))  # DCP hands every rank the same report
        detail = unique[0] if len(unique) == 1 else "; ".join(f"rank {rank}: {msg}" for rank, msg in failed)
        raise CheckpointError(f"{what} failed ({detail})") from error
    return result


def _from_rank0(value):
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _describe(exc: BaseException) -> str:
    """The root cause in one line; for DCP's CheckpointException, every failing rank's exception."""
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
    if failures:  # rank -> (exception, traceback)
        return "; ".join(f"rank {rank} {type(wrapped[0]).__name__}: {wrapped[0]}" for rank, wrapped in failures.items())
    return f"{type(exc).__name__}: {exc}"


@contextmanager
def quiet_dcp():
    """megatron 0.16's translation to DCP uses torch APIs that torch 2.13 deprecates (ShardedTensor,
    load_state_dict); the warnings name nothing a user can act on.  Exports read without a process
    group on purpose."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _layout(learner) -> dict:
    return layout_of(learner.cfg)


def _optimizer_kind(use_distributed_optimizer: bool) -> str:
    # The two keep different non-tensor state (megatron 0.16 cannot load one's into the other).
    return "distributed" if use_distributed_optimizer else "plain"


def _rng_object(learner, states):
    """This rank's RNG states as a ShardedObject at its (pp, tp, dp) coordinate; the CP ranks of one are replicas
    (context parallelism: each holds the same weights and draws nothing its peers do not), CP rank 0 saves it."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    ps = learner.ps
    return ShardedObject(RNG_KEY, states, global_shape=(learner.cfg.pp, learner.cfg.tp, learner.cfg.dp),
                         global_offset=(ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                                        ps.get_data_parallel_rank()), replica_id=ps.get_context_parallel_rank())


def capture_rng(learner) -> dict:
    """Every RNG state of this process the learner's results may depend on."""
    return {
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        # On CPU the tracker's states are CPU-generator states (megarl.learner.cpu_shims).
        "tracker": {k: v.clone() for k, v in learner.tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }


def restore_rng(learner, states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    learner.tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])


def _fsynced_write(path: Path, write: Callable) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _write_shards(state: dict, directory: Path) -> None:
    """megatron's save, in-process: preprocessing (factories, replica filtering, validation), then
    common.pt + metadata.json on rank 0 and every rank's shards through DCP's FileSystemWriter."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies import torch as mcore_dcp
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    sharded, common = save_preprocess(state, validate_access_integrity=True)

    def write_common():
        if dist.get_rank() == 0:
            _fsynced_write(directory / COMMON_STATE_FNAME, lambda f: torch.save(common, f))
            save_config(CheckpointingConfig("torch_dist", 1), str(directory))  # megatron's format tag

    _agree(write_common, f"writing {directory / COMMON_STATE_FNAME}")
    # The translation megatron's TorchDistSaveShardedStrategy does, with DCP's own single-threaded
    # writer (fsyncs each file) instead of megatron's forked one.
    sharded, _, _ = mcore_dcp._replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main_replica=True)
    pyt_state = mcore_dcp.mcore_to_pyt_state_dict(sharded, False)
    writer = dcp.FileSystemWriter(directory, thread_count=1, sync_files=True)
    planner = mcore_dcp.MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)
    with quiet_dcp():
        _agree(lambda: dcp.save(pyt_state, storage_writer=writer, planner=planner),
               f"writing the model and optimizer shards to {directory}")


def _copy_hf_meta(model_dir: Path, dest: Path) -> None:
    dest.mkdir()
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copyfile(path, dest / path.name)


def save(learner, root: str | Path, step: int, keep: int, model_dir: str | Path, run_state: dict | None = None) -> Path:
    """Write the learner's state after `step` completed loop steps as checkpoint step_N under `root`
    and point `latest` at it; collective over the learner ranks (call on every one).

    `run_state` (rank 0's; JSON) is stored in the manifest, e.g. the data position.  On any failure
    every rank raises CheckpointError naming the path, the temp dir is removed and `latest` still
    names the previous checkpoint.  Returns the checkpoint dir.
    """
    root, rank0 = Path(root), dist.get_rank() == 0
    temp = temp_dir(root, step)

    def prepare():
        if rank0:
            previous = find_latest(root) if root.is_dir() else None
            prepare_temp(root, step)
            return previous

    previous = _from_rank0(_agree(prepare, f"creating {temp}"))
    try:
        if learner.cfg.backend == "deepspeed":
            _agree(lambda: learner.save_shards(temp), f"writing the DeepSpeed checkpoint to {temp}")
        else:
            state = learner.sharded_state_dict(with_optimizer=learner.version > 0)
            state["rng"] = _rng_object(learner, capture_rng(learner))
            _write_shards(state, temp)
        manifest = {
            "format": FORMAT, "step": step, "version": learner.version, "layout": _layout(learner),
            "optimizer": _optimizer_kind(learner.cfg.use_distributed_optimizer),
            "hf_config": learner.hf_config, "model_dir": str(Path(model_dir).resolve()),
            "saved_at_unix": time.time(), "run": run_state or {},
        }

        def finish():
            if rank0:
                if getattr(learner, "critic", None) is not None:  # every learner rank holds the same replica
                    learner.critic.save(temp, _fsynced_write)
                _copy_hf_meta(Path(model_dir), temp / HF_META_DIR)
                _fsynced_write(temp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
                return commit(root, temp, step, keep)
            return None

        return _from_rank0(_agree(finish, f"committing {temp}"))
    except BaseException as exc:
        if rank0:
            discard(temp)
        if isinstance(exc, CheckpointError):
            kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
            raise CheckpointError(f"checkpoint save of step {step} failed; removed {temp}; {kept}: {exc}") from exc
        raise


def check_architecture(manifest: dict, hf_config: dict, where: str) -> None:
    saved = {k: manifest["hf_config"].get(k) for k in ARCHITECTURE_KEYS}
    ours = {k: hf_config.get(k) for k in ARCHITECTURE_KEYS}
    if saved != ours:
        diff = {k: (saved[k], ours[k]) for k in ARCHITECTURE_KEYS if saved[k] != ours[k]}
        raise CheckpointError(f"{where} holds another architecture than model.path: (checkpoint, model) = {diff}")


def check_optimizer(manifest: dict, use_distributed_optimizer: bool, where: str) -> None:
    if manifest["version"] > 0 and manifest["optimizer"] != _optimizer_kind(use_distributed_optimizer):
        raise CheckpointError(f"{where} holds a {manifest['optimizer']} optimizer's state but learner."
                              f"use_distributed_optimizer={use_distributed_optimizer}: resume with the setting "
                              f"the checkpoint was saved with")


def load(learner, checkpoint: str | Path) -> dict:
    """Load a checkpoint (a step dir, or a checkpoint root: its `latest`) into the learner, under the
    learner's own layout; collective over the learner ranks.  Returns the manifest."""
    from megatron.core import dist_checkpointing

    path = resolve(checkpoint)
    check_trusted(path)  # before megatron or DeepSpeed unpickles anything in it (megarl/checkpoint/trust.py)
    manifest = read_manifest(path)
    check_architecture(manifest, learner.hf_config, str(path))
    if "deepspeed" in (learner.cfg.backend, manifest["layout"].get("backend")):
        return _load_deepspeed(learner, path, manifest)
    check_resumable(path, manifest, learner.cfg)  # (megatron: the adapter, if any, must be this run's)
    check_optimizer(manifest, learner.cfg.use_distributed_optimizer, str(path))
    state = learner.sharded_state_dict(with_optimizer=manifest["version"] > 0, is_loading=True)
    same_layout = manifest["layout"] == _layout(learner)
    if same_layout:  # RNG streams belong to a rank's place in the layout; another layout keeps its seeds
        state["rng"] = _rng_object(learner, None)
    with quiet_dcp():
        loaded = _agree(lambda: dist_checkpointing.load(state, str(path)), f"loading {path}")
    rng = loaded.pop("rng", None)
    learner.load_state(loaded, manifest["version"])
    if rng is not None:
        restore_rng(learner, rng)
    _load_critic(learner, path)
    return {**manifest, "path": str(path), "rng_restored": same_layout}


def _load_critic(learner, path: Path) -> None:
    """The critic's replica (advantage.estimator=gae: megarl.learner.critic), read by every learner rank from
    the files one rank saved, under any layout and either backend."""
    if getattr(learner, "critic", None) is not None:
        _agree(lambda: learner.critic.load(path), f"loading the critic from {path}")


def _load_deepspeed(learner, path: Path, manifest: dict) -> dict:
    """DeepSpeed's checkpoint under the layout that wrote it: another layout is refused, naming the keys
    to set (check_resumable)."""
    check_resumable(path, manifest, learner.cfg)
    _agree(lambda: learner.load_shards(path, manifest["version"], with_optimizer=manifest["version"] > 0),
           f"loading {path}")
    _load_critic(learner, path)
    return {**manifest, "path": str(path), "rng_restored": False}
