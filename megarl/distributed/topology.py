"""Roles and process groups: maps the torchrun world to learner and sampler ranks and builds every group.

Nothing else in megarl creates process groups. The layout of a world of L learner ranks and S
sampler ranks is fixed: ranks [0, L) are learners, ranks [L, L+S) are samplers (one engine each).

Groups:
  * learners: the *default* torch.distributed group of a learner process holds only the learner ranks
    (megatron's parallel_state builds TP/PP/DP from it), rendezvoused through a prefix of
    torchrun's store. Sampler processes have no default group: they never join a learner collective.
  * publish: a standalone group (not registered with torch.distributed, like the weight-update
    groups SGLang and vLLM create) of the publishing learner rank (group rank 0) and every sampler
    (group ranks 1..S). Standalone because it spans roles whose default groups differ, and because
    an external engine (SGLang) can join such a group without being part of the torchrun world.
The torchrun store also carries small control records: the queue address, publish headers, stop.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.config.load import ConfigError, world_size_for
from megarl.config.schema import Config

STORE_PREFIX = "megarl/"


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    num_learners: int
    num_samplers: int

    @property
    def role(self) -> str:
        return "learner" if self.rank < self.num_learners else "sampler"

    @property
    def role_rank(self) -> int:
        """Rank within the role: learner rank or sampler index."""
        return self.rank if self.role == "learner" else self.rank - self.num_learners

    @property
    def publish_rank(self) -> int | None:
        """Rank in the publish group, None for learner ranks that do not publish."""
        if self.role == "sampler":
            return 1 + self.role_rank
        return 0 if self.rank == 0 else None


def topology_from_env(cfg: Config) -> Topology:
    """Read RANK/WORLD_SIZE as torchrun sets them and check them against the config."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError as exc:
        raise RuntimeError(f"{exc.args[0]} is not set: megarl workers are started by torchrun (see README)") from None
    if world != world_size_for(cfg):
        raise ConfigError(
            f"sampler.num_engines/learner.*: the config needs {world_size_for(cfg)} processes, "
            f"torchrun started WORLD_SIZE={world}")
    learners = cfg.learner.tp * cfg.learner.pp * cfg.learner.dp
    return Topology(rank=rank, world_size=world, num_learners=learners, num_samplers=world - learners)


def connect_store(topo: Topology, timeout_s: float) -> dist.Store:
    """The rendezvous store of this torchrun launch, prefixed for megarl's keys.

    Under torchrun the agent hosts a TCPStore at MASTER_ADDR:MASTER_PORT and workers connect as
    clients (TORCHELASTIC_USE_AGENT_STORE=True); in any other launcher rank 0 hosts it.
    """
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    agent_hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = dist.TCPStore(host, port, world_size=None if agent_hosted else topo.world_size,
                              is_master=(not agent_hosted and topo.rank == 0),
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except Exception as exc:
        raise RuntimeError(f"rank {topo.rank}: could not reach the rendezvous store at {host}:{port} "
                           f"within {timeout_s:.0f}s: {exc}") from exc
    return dist.PrefixStore(STORE_PREFIX, store)


def resolve_backend(name: str) -> str:
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return name


def init_learner_group(topo: Topology, store: dist.Store, backend: str, timeout_s: float) -> None:
    """Make the learner ranks (and only them) the default process group of this learner process."""
    assert topo.role == "learner"
    dist.init_process_group(backend=resolve_backend(backend), store=dist.PrefixStore("learners/", store),
                            rank=topo.role_rank, world_size=topo.num_learners,
                            timeout=timedelta(seconds=timeout_s))


def publish_group(topo: Topology, store: dist.Store, backend: str, timeout_s: float):
    """The standalone learner->samplers weight broadcast group (None for non-publishing learners)."""
    rank = topo.publish_rank
    if rank is None:
        return None
    size = 1 + topo.num_samplers
    sub = dist.PrefixStore("publish/", store)
    timeout = timedelta(seconds=timeout_s)
    if resolve_backend(backend) == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(sub, rank, size, opts)
    return dist.ProcessGroupGloo(sub, rank, size, timeout)
