"""Which rank plays which role: the Topology of each rank of a run's torchrun world, and the ranks of each node.

Pure arithmetic on the config, without torch: `megarl train` checks the placement before it starts the launcher,
and the sooner that starts the more of the ranks' imports overlap the CLI's other checks
(megarl.distributed.launch_gate). The process groups built on this layout are megarl.distributed.topology's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from megarl.config.load import ConfigError, learner_ranks, world_size_for
from megarl.config.schema import Config


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    num_learners: int
    num_samplers: int  # sampler ranks: num_engines * sampler_tp
    # Learner ranks per pipeline stage (tp * cp * dp; megatron orders ranks tp fastest, then cp, then dp, then pp,
    # so stage s holds learner ranks [s * this, (s + 1) * this)). 0 = one stage of all learners.
    learners_per_stage: int = 0
    # Ranks per built-in sampler engine (sampler.tp). Above 1 it equals learner.tp and the publish is
    # shard to shard: learner TP rank r (of each stage's first DP replica) -> TP rank r of every engine;
    # or learner.tp is 1 and every TP rank receives the whole tensors and keeps its slices (`slices_on_arrival`).
    sampler_tp: int = 1
    learner_tp: int = 1  # a stage's DP replica d starts at offset d * learner_tp * learner_cp
    learner_cp: int = 1  # (its CP rank 0 holds the TP ranks that publish: every CP rank holds the same weights)
    # DP replicas of each stage that publish (publish.senders), replica d sending share d of the buckets.
    publish_senders: int = 1

    @property
    def shard_to_shard(self) -> bool:
        """Learner TP rank r publishes its own slices to TP rank r of every engine (sampler_tp = learner_tp > 1)."""
        return self.sampler_tp > 1 and self.learner_tp == self.sampler_tp

    @property
    def slices_on_arrival(self) -> bool:
        """A TP engine under a learner of TP 1 (an MoE model: the megatron learner refuses TP for it, the
        DeepSpeed learner has none): whole tensors go to every sampler rank, each keeps its tp_shard slices."""
        return self.sampler_tp > 1 and self.learner_tp == 1

    @property
    def num_stages(self) -> int:
        return self.num_learners // (self.learners_per_stage or self.num_learners)

    @property
    def num_engines(self) -> int:
        return self.num_samplers // self.sampler_tp

    @property
    def role(self) -> str:
        return "learner" if self.rank < self.num_learners else "sampler"

    @property
    def role_rank(self) -> int:
        """Rank within the role: learner rank or sampler index."""
        return self.rank if self.role == "learner" else self.rank - self.num_learners

    @property
    def engine_index(self) -> int:
        """Which engine a sampler rank belongs to (its TP ranks are consecutive)."""
        return self.role_rank // self.sampler_tp

    @property
    def engine_tp_rank(self) -> int:
        """A sampler rank's TP rank within its engine; 0 is the engine's lead (queue, rewards, schedule)."""
        return self.role_rank % self.sampler_tp

    @property
    def engine_leads(self) -> list[int]:
        """The global ranks of every engine's lead."""
        return list(range(self.num_learners, self.world_size, self.sampler_tp))

    @property
    def publish_parts(self) -> list[tuple[int, int, int]]:
        """(pipeline stage, TP rank, sender) of every publish group this rank is in. A source learner rank
        is in its own: its stage's first rank, or shard to shard each TP rank of the stage's first DP
        replica, or with publish_senders = k the first rank of each of the stage's first k DP replicas.
        A sampler rank is in every group of its TP rank (of TP rank 0 when slices_on_arrival); other
        learner ranks are in none."""
        if self.role == "sampler":
            tp_rank = self.engine_tp_rank if self.shard_to_shard else 0
            return [(stage, tp_rank, sender)
                    for stage in range(self.num_stages) for sender in range(self.publish_senders)]
        stage, offset = divmod(self.rank, self.learners_per_stage or self.num_learners)
        if self.shard_to_shard:
            return [(stage, offset, 0)] if offset < self.sampler_tp else []
        replica, within = divmod(offset, self.learner_tp * self.learner_cp)
        return [(stage, 0, replica)] if within == 0 and replica < self.publish_senders else []

    @property
    def engine_lead(self) -> int:
        """The global rank of this sampler rank's engine lead: the rank that stands for the whole engine in the
        learner's records (heartbeat, queue, membership)."""
        return self.engine_leads[self.engine_index]

    @property
    def receivers_per_engine(self) -> int:
        """Ranks of one engine in each publish group: every TP rank when slices_on_arrival, else one (its TP rank
        of that part's shards, or the whole engine at sampler_tp 1)."""
        return self.sampler_tp if self.slices_on_arrival else 1

    @property
    def publish_offset(self) -> int:
        """A sampler rank's place among its engine's receivers in a publish group (its TP rank when
        slices_on_arrival, else 0): engine i's receivers are group ranks 1 + i * receivers_per_engine + offset."""
        return self.engine_tp_rank if self.slices_on_arrival else 0

    @property
    def publish_rank(self) -> int | None:
        """Rank in the publish group(s): 0 for a source, 1 + engine index for a sampler (1 + sampler index
        when slices_on_arrival: every TP rank is a member), else None."""
        if self.role == "sampler":
            return 1 + self.engine_index * self.receivers_per_engine + self.publish_offset
        return 0 if self.publish_parts else None

    @property
    def publish_group_size(self) -> int:
        """Members of each publish group: the source and one receiver per engine (per sampler rank when
        slices_on_arrival)."""
        return 1 + self.num_engines * self.receivers_per_engine


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
    return rank_topology(cfg, rank, world)


def placement(cfg: Config, nnodes: int, nproc_per_node: int | None = None) -> list[list[Topology]]:
    """Every rank's Topology, node by node, for a launch of `nnodes` torchrun agents.

    torchrun gives node (group rank) g the global ranks [g * nproc_per_node, (g + 1) * nproc_per_node),
    so with learners at ranks [0, L) the first nodes hold the learners and the last ones the samplers.
    Which machine becomes group rank g is the rendezvous' choice (docs/launch.md)."""
    world = world_size_for(cfg)
    if nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {nnodes}")
    per_node = nproc_per_node or world // nnodes
    if per_node < 1 or per_node * nnodes != world:
        raise ConfigError(
            f"sampler.num_engines/learner.*: the config needs {world} processes, which {nnodes} nodes "
            f"x {per_node} processes per node do not give (torchrun starts the same number on every node); "
            f"make the world size a multiple of the node count")
    return [[rank_topology(cfg, r, world) for r in range(node * per_node, (node + 1) * per_node)]
            for node in range(nnodes)]


def rank_topology(cfg: Config, rank: int, world: int) -> Topology:
    learners = learner_ranks(cfg.learner)
    return Topology(rank=rank, world_size=world, num_learners=learners, num_samplers=world - learners,
                    learners_per_stage=learners // cfg.learner.pp, sampler_tp=cfg.sampler.tp,
                    learner_tp=cfg.learner.tp, learner_cp=cfg.learner.cp, publish_senders=cfg.publish.senders)
