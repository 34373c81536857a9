"""Learner side of the SGLang weight sync: rank 0 of SGLang's weight-update group, broadcasting in SGLang's format.

With sampler.engine=sglang the weights do not go to sampler processes but straight into the SGLang
servers, whose TP workers receive them in `/update_weights_from_distributed`. This module is the
sending half; the sampler half (which makes its server receive) is
`megarl.sampler.sglang_engine.SGLangWeightFollower`.

Protocol (every key lives in the torchrun store, like the built-in publish path):
  0. once: the learner writes GROUP_KEY {host, port, world_size, group_name, backend} and joins the
     group as rank 0, hosting its TCP rendezvous (topology.init_sglang_update_group, built as SGLang's
     init_custom_process_group builds it); each sampler has its server join with
     /init_weights_update_group at the rank offset topology.sglang_group_layout gives it.
  1. once, before the first header: SPEC_KEY {format, calls}: the [name, shape, dtype] lists of the
     /update_weights_from_distributed calls of every publish, in order.
  2. per publish n: the header `publish.header_key(n)` = {version, checksum: false, extra}, exactly the
     built-in path's header, so the retired counts in `extra` reach the samplers' staleness budget.
  3. per call, from group rank 0: "flattened_bucket" — one broadcast of the bucket's bytes, tensors
     back to back in names order (SGLang's FlattenedTensorBucket layout, load_format
     "flattened_bucket"); "per_tensor" — one broadcast per tensor in names order (load_format None).
SGLang verifies no checksum, so headers carry none (publish.checksum does not apply here).

Under fault.on_failure=replace the group changes with the live sampler set (megarl.distributed.membership):
GROUP_KEY is membership epoch 0's group; for each later epoch e the learner leaves the previous group and writes
`epoch_group_key(e)` {host, port, world_size, group_name: GROUP_NAME + "_e{e}", backend} (a fresh rendezvous),
then hosts it as rank 0; each member's server leaves its previous group (/destroy_weights_update_group) and joins
at the offset of its place in the epoch (`epoch_layout`). Headers keep counting across epochs.
"""
from __future__ import annotations

import json
import math
import os
import socket
import time
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist

from megarl.distributed.publish import header_key, plan_buckets
from megarl.distributed.topology import init_sglang_update_group, resolve_backend, sglang_group_layout

GROUP_KEY = "sglang/update_group"
SPEC_KEY = "sglang/spec"
GROUP_NAME = "megarl_weight_update"
WEIGHT_FORMATS = ("flattened_bucket", "per_tensor")

Spec = list[tuple[str, tuple[int, ...], torch.dtype]]


def epoch_group_key(epoch: int) -> str:
    """Where membership epoch `epoch`'s SGLang weight-update group is described (epoch 0: GROUP_KEY)."""
    return GROUP_KEY if epoch == 0 else f"{GROUP_KEY}/e{epoch}"


def epoch_layout(group_rank: int, size: int, tp: int) -> tuple[int, int]:
    """(world size, the member's rank offset) of an epoch's SGLang group, from the member's place in the
    membership epoch's group (`group_rank` 1.. of `size`, the learner 0): each server holds `tp` ranks."""
    return 1 + (size - 1) * tp, 1 + (group_rank - 1) * tp


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's wire name for a dtype: what `getattr(torch, name)` turns back into it."""
    return str(dtype).removeprefix("torch.")


def plan_update_calls(spec: Spec, weight_format: str, bucket_bytes: int) -> list[Spec]:
    """The tensors of each /update_weights_from_distributed call of one publish, in broadcast order.

    flattened_bucket: one call per publish bucket (single-dtype, at most `bucket_bytes` unless one
    tensor is bigger), so the receiver holds one bucket at a time. per_tensor: consecutive tensors in
    calls of at most `bucket_bytes` (a bigger tensor alone): SGLang allocates every tensor of a call
    before loading any, so one call of everything would be a second full model copy on its GPU.
    """
    if weight_format == "per_tensor":
        calls: list[Spec] = []
        size = 0
        for name, shape, dtype in spec:
            nbytes = math.prod(shape) * dtype.itemsize
            if not calls or size + nbytes > bucket_bytes:
                calls.append([])
                size = 0
            calls[-1].append((name, shape, dtype))
            size += nbytes
        return calls
    if weight_format != "flattened_bucket":
        raise ValueError(f"weight_format={weight_format!r}: must be one of {WEIGHT_FORMATS}")
    shapes = {name: shape for name, shape, _ in spec}
    return [[(s.name, shapes[s.name], b.dtype) for s in b.slots] for b in plan_buckets(spec, bucket_bytes)]


def update_body(call: Spec, weight_format: str, group_name: str, weight_version: str | None) -> dict:
    """The /update_weights_from_distributed request body (sglang io_struct UpdateWeightsFromDistributedReqInput).

    flush_cache is false: SGLang flushes only when nothing runs and *asserts* that it did, so a flush
    requested with requests paused in place takes the scheduler down (docs/sglang.md)."""
    return {"names": [n for n, _, _ in call], "dtypes": [dtype_name(d) for _, _, d in call],
            "shapes": [list(s) for _, s, _ in call], "group_name": group_name, "flush_cache": False,
            "abort_all_requests": False, "weight_version": weight_version,
            "load_format": "flattened_bucket" if weight_format == "flattened_bucket" else None}


# What SGLang sets in its own process before NCCL starts (and other RL stacks set on the trainer): NCCL's
# cuMem allocator and NVLink SHARP off. Both ends of the weight-update broadcast then agree; a mismatch is
# a known cause of hangs in the first broadcast.
NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}


def set_publish_nccl_env(environ=os.environ) -> None:
    """Set NCCL_ENV in the learner process. NCCL reads these once, at its first communicator, so the
    learner calls this before it creates any process group (learner_main)."""
    environ.update(NCCL_ENV)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SGLangPublisher:
    """Learner side: `publish(version, named_tensors, extra)` after every optimizer step (as WeightPublisher)."""

    def __init__(self, store, *, world_size: int, host: str, port: int, backend: str, weight_format: str,
                 bucket_mb: float, timeout_s: float, join_timeout_s: float, tp: int = 1):
        self.store, self.weight_format = store, weight_format
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.timeout = timedelta(seconds=timeout_s)
        self.backend, self.host, self.port, self.tp = backend, host, port, tp
        if backend == "nccl":
            set_publish_nccl_env()  # normally done at learner start already; idempotent
        self._group = None
        self.group = self._host_group(0, world_size, join_timeout_s)
        self.calls: list[Spec] | None = None
        self.buffers: list[torch.Tensor] = []
        self.published = 0

    @property
    def group(self):
        return self._group

    @group.setter
    def group(self, group) -> None:
        """Setting another group (or None: membership.SamplerSet's caller leaves an epoch so) destroys this one."""
        if self._group is not None and self._group is not group:
            try:
                dist.destroy_process_group(self._group)
            except Exception:  # noqa: BLE001 - a group with a dead member may not tear down cleanly; it is left anyway
                pass
        self._group = group

    def join_epoch(self, epoch: int, size: int):
        """fault.on_failure=replace: host membership epoch `epoch`'s group of `size` members (the learner and
        size - 1 servers); returns it once every server joined, within 2 * publish.timeout_s (a member that died
        meanwhile fails it: the caller drops it and tries the next epoch)."""
        self.group = None
        world_size, _ = epoch_layout(1, size, self.tp)
        return self._host_group(epoch, world_size, 2 * self.timeout.total_seconds())

    def _host_group(self, epoch: int, world_size: int, join_timeout_s: float):
        """Describe epoch `epoch`'s group in the store, then host it as rank 0 until all `world_size` ranks joined."""
        port = (self.port + epoch if self.port else free_port(self.host))
        self.address = f"{self.host}:{port}"
        name = GROUP_NAME if epoch == 0 else f"{GROUP_NAME}_e{epoch}"
        self.store.set(epoch_group_key(epoch), json.dumps({"host": self.host, "port": port, "world_size": world_size,
                                                           "group_name": name, "backend": self.backend}))
        try:
            return init_sglang_update_group(self.backend, self.host, port, world_size, 0, name, join_timeout_s)
        except Exception as exc:
            raise TimeoutError(f"SGLang weight-update group at {self.address}: not all {world_size - 1} server ranks "
                               f"joined within {join_timeout_s:.0f}s (did every SGLang server start?): {exc}") from exc

    @classmethod
    def from_config(cls, cfg, store, num_samplers: int) -> "SGLangPublisher":
        sc = cfg.sampler.sglang
        world_size, _ = sglang_group_layout(num_samplers, sc.tp)
        # The built-in server runs on CPU, so its group is gloo whatever the learner runs on.
        backend = "gloo" if sc.server == "builtin" else resolve_backend(cfg.dist.backend)
        return cls(store, world_size=world_size, host=sc.update_group_host or cfg.queue.host,
                   port=sc.update_group_port, backend=backend, weight_format=sc.weight_format,
                   bucket_mb=cfg.publish.bucket_mb, timeout_s=cfg.publish.timeout_s,
                   join_timeout_s=sc.startup_timeout_s + sc.request_timeout_s, tp=sc.tp)

    def publish(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]], extra: dict | None = None,
                spec=None) -> dict:
        """Broadcast one version; returns {bytes, seconds}. `extra` travels in the header (small JSON).
        `spec` (WeightPublisher's streaming contract) is not used yet: the tensors are collected first, so
        this source holds a copy of the model during a publish (docs/sglang.md)."""
        start = time.perf_counter()
        named = dict(tensors)
        if self.calls is None:
            self._plan(named)
        self.published += 1
        header = {"version": version, "checksum": False, "extra": extra or {}}
        self.store.set(header_key(self.published), json.dumps(header))
        nbytes = 0
        for i, (call, buffer) in enumerate(zip(self.calls, self.buffers)):
            what = f"version {version} call {i + 1}/{len(self.calls)}"
            if self.weight_format == "flattened_bucket":
                offset = 0
                for name, _, _ in call:
                    raw = named[name].detach().contiguous().view(-1).view(torch.uint8)
                    buffer[offset:offset + raw.numel()].copy_(raw)
                    offset += raw.numel()
                self._broadcast(buffer, what)
                nbytes += buffer.numel()
            else:
                for name, _, _ in call:
                    tensor = named[name].detach().to(self._device(named[name])).contiguous()
                    self._broadcast(tensor, f"{what} tensor {name}")
                    nbytes += tensor.numel() * tensor.element_size()
        return {"bytes": nbytes, "seconds": time.perf_counter() - start}

    def close(self) -> None:
        """Tear the group down before interpreter shutdown would, in whatever order, with servers still
        connected to the rendezvous store this process hosts."""
        self.group = None

    def _plan(self, named: dict[str, torch.Tensor]) -> None:
        spec = [(name, tuple(t.shape), t.dtype) for name, t in named.items()]
        self.calls = plan_update_calls(spec, self.weight_format, self.bucket_bytes)
        self.store.set(SPEC_KEY, json.dumps({
            "format": self.weight_format,
            "calls": [[[n, list(s), dtype_name(d)] for n, s, d in call] for call in self.calls]}))
        if self.weight_format == "flattened_bucket":
            device = self._device(next(iter(named.values())))
            self.buffers = [torch.empty(sum(named[n].numel() * named[n].element_size() for n, _, _ in call),
                                        dtype=torch.uint8, device=device) for call in self.calls]
        else:
            self.buffers = [None] * len(self.calls)

    def _device(self, tensor: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self.backend == "gloo" else tensor.device

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        try:
            dist.broadcast(tensor, src=0, group=self.group, async_op=True).wait(self.timeout)
        except RuntimeError as exc:
            raise TimeoutError(f"SGLang weight publish ({self.address}): {what} failed or timed out after "
                               f"{self.timeout.total_seconds():.0f}s (a server may be stuck or dead): {exc}") from exc


def load_spec(raw: str) -> tuple[str, list[Spec]]:
    """SPEC_KEY's JSON -> (weight format, calls)."""
    spec = json.loads(raw)
    calls = [[(n, tuple(s), getattr(torch, d)) for n, s, d in call] for call in spec["calls"]]
    return spec["format"], calls
