"""Process groups and the rendezvous store: builds every group of the world megarl.distributed.ranks lays out.

Nothing else in megarl creates process groups. The layout of a world of L learner ranks and S
sampler ranks is fixed (megarl.distributed.ranks): ranks [0, L) are learners, ranks [L, L+S) are samplers, `sampler_tp`
consecutive ranks per engine (one rank per engine unless the built-in engine runs tensor parallel;
the engine's first rank is its lead: scheduling, rewards, queue).

Groups:
  * learners: the *default* torch.distributed group of a learner process holds only the learner ranks
    (megatron's parallel_state builds TP/PP/DP from it), rendezvoused through a prefix of
    torchrun's store. Sampler processes have no default group: they never join a learner collective.
  * publish: a standalone group (not registered with torch.distributed, like the weight-update
    groups SGLang and vLLM create) per publish part: the publishing learner rank (group rank 0) and
    every engine (group ranks 1..E). A part is (pipeline stage, TP rank, sender): one per pipeline
    stage; with sampler_tp = learner_tp > 1 one per stage and TP rank (shard to shard; with learner_tp 1
    and sampler_tp > 1 the stage's one group holds every TP rank of every engine, each keeping its
    slices of the whole tensors); with publish.senders = k > 1
    one per stage and DP replica 0..k-1, each sending its share of the stage's buckets
    (publish.sender_share). Standalone because it spans roles whose default groups differ, and because
    an external engine (SGLang) can join such a group without being part of the torchrun world.
  * engine TP (sampler_tp > 1): the ranks of one built-in engine; its lead broadcasts each step's plan
    and the forward all-reduces over it.
  * SGLang weight update (sampler.engine=sglang): replaces the publish group. The learner's publish
    source is rank 0 and every SGLang TP worker joins through the server's /init_weights_update_group,
    built the way SGLang builds it (`init_sglang_update_group`); `sglang_group_layout` gives the ranks.
The torchrun store also carries small control records: the queue address, publish headers, stop; they
are signed with the run secret (megarl.distributed.signed_store), the groups' own keys are torch's.

Before torch builds a start-up group (learners, publish, engine TP), every member sets `arrived/<rank>` under the
group's prefix and waits for all the others' in Python (`wait_for_members`): torch's own rendezvous blocks in C++,
deaf to stop signals, so a rank whose peers failed or were stopped would otherwise sit out dist.timeout_s there.
Once all arrived, torch's rendezvous is immediate.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from megarl.config.load import ConfigError
from megarl.distributed.lifetime import wait_for_keys
from megarl.distributed.ranks import Topology
from megarl.distributed.signed_store import SignedStore
from megarl.distributed.store_server import tcp_store_server
from megarl.secret import run_secret

STORE_PREFIX = "megarl/"


def connect_store(topo: Topology, timeout_s: float) -> SignedStore:
    """The rendezvous store of this torchrun launch, prefixed for megarl's keys, its records signed with the
    run secret (megarl.distributed.signed_store; process groups rendezvous over its `.raw` store).

    Under torchrun the agent hosts a TCPStore at MASTER_ADDR:MASTER_PORT and workers connect as
    clients (TORCHELASTIC_USE_AGENT_STORE=True); in any other launcher rank 0 hosts it.
    """
    key = run_secret()
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    agent_hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = dist.TCPStore(host, port, world_size=None if agent_hosted else topo.world_size,
                              is_master=(not agent_hosted and topo.rank == 0),
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except Exception as exc:
        raise RuntimeError(f"rank {topo.rank}: could not reach the rendezvous store at {host}:{port} "
                           f"within {timeout_s:.0f}s: {exc}") from exc
    # torchrun keeps its store across the restarts of fault.on_failure=restart: every attempt gets its
    # own key space, so a restarted run never sees the failed attempt's queue address, publish
    # headers, heartbeats or stop flag.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return SignedStore(dist.PrefixStore(f"{STORE_PREFIX}attempt{attempt}/", store), key)


def resolve_backend(name: str) -> str:
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return name


def wait_for_members(group_store: dist.Store, rank: int, size: int, timeout_s: float, group: str,
                     should_stop: Callable[[], bool] | None = None) -> None:
    """Say that group rank `rank` arrived at the group whose keys `group_store` holds, then wait until all `size`
    members did (megarl.distributed.lifetime.wait_for_keys: a stop signal ends the wait at once, or `should_stop`)."""
    group_store.set(f"arrived/{rank}", "1")
    wait_for_keys(group_store, [f"arrived/{r}" for r in range(size)], timeout_s, f"every member of {group}",
                  should_stop)


def init_learner_group(topo: Topology, store: SignedStore, backend: str, timeout_s: float) -> None:
    """Make the learner ranks (and only them) the default process group of this learner process."""
    assert topo.role == "learner"
    backend = resolve_backend(backend)
    # The learners also reduce small CPU tensors (loss, token counts, micro-batch counts), which a plain
    # nccl group refuses: CUDA tensors go over NCCL, CPU ones over gloo.
    if backend == "nccl":
        backend = "cpu:gloo,cuda:nccl"
    group_store = dist.PrefixStore("learners/", store.raw)
    wait_for_members(group_store, topo.role_rank, topo.num_learners, timeout_s,
                     f"the learner group ({topo.num_learners} learner ranks)")
    dist.init_process_group(backend=backend, store=group_store,
                            rank=topo.role_rank, world_size=topo.num_learners,
                            timeout=timedelta(seconds=timeout_s))


def publish_stage_store(store: SignedStore, stage: int, tp_rank: int = 0, sender: int = 0) -> SignedStore:
    """Where publish part (stage, TP rank, sender)'s records (spec, headers) live: part (0, 0, 0) uses
    the plain keys, and its headers carry the run's bookkeeping."""
    prefix = _part_prefix(stage, tp_rank, sender)
    return store.prefixed(prefix) if prefix else store


def _part_prefix(stage: int, tp_rank: int, sender: int) -> str:
    return (f"stage{stage}/" if stage else "") + (f"tp{tp_rank}/" if tp_rank else "") + \
        (f"sender{sender}/" if sender else "")


def publish_groups(topo: Topology, store: SignedStore, backend: str,
                   timeout_s: float) -> dict[tuple[int, int, int], object]:
    """(pipeline stage, TP rank, sender) -> its weight broadcast group, for the groups this rank is in.

    One group per learner pipeline stage: that stage's source (group rank 0) and every engine. Each
    stage broadcasts its own layers, so no learner rank ever gathers the whole model, and the stages
    send concurrently. With sampler_tp > 1 each stage has one group per TP rank r: the stage's TP rank
    r (first DP replica) sends its shards to TP rank r of every engine, nothing is gathered over TP.
    With publish.senders = k each stage has k groups, DP replica d sending share d of the buckets.
    """
    return {part: publish_group(topo, store, backend, timeout_s, *part) for part in topo.publish_parts}


def publish_group(topo: Topology, store: SignedStore, backend: str, timeout_s: float, stage: int = 0,
                  tp_rank: int = 0, sender: int = 0):
    """The standalone learner->engines weight broadcast group of publish part (stage, TP rank, sender):
    the source learner rank is group rank 0, engine i's TP rank `tp_rank` is group rank 1 + i (sampler
    rank i when slices_on_arrival)."""
    rank = topo.publish_rank
    if rank is None:
        return None
    sub = dist.PrefixStore("publish/" + _part_prefix(stage, tp_rank, sender), store.raw)
    wait_for_members(sub, rank, topo.publish_group_size, timeout_s,
                     f"publish group (stage {stage}, TP rank {tp_rank}, sender {sender}): group rank 0 is its "
                     f"learner source, 1..{topo.publish_group_size - 1} the engines")
    timeout = timedelta(seconds=timeout_s)
    if resolve_backend(backend) == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(sub, rank, topo.publish_group_size, opts)
    return dist.ProcessGroupGloo(sub, rank, topo.publish_group_size, timeout)


def epoch_publish_group(store: SignedStore, epoch: int, rank: int, size: int, backend: str, timeout_s: float,
                        stage: int = 0, tp_rank: int = 0, sender: int = 0,
                        should_stop: Callable[[], bool] | None = None):
    """The weight broadcast group of membership epoch `epoch` (fault.on_failure=replace,
    megarl.distributed.membership) for publish part (stage, TP rank, sender): built straight over the run's store,
    as vLLM's StatelessProcessGroup is, so only this epoch's members take part. Epoch 0 is the run's first group
    (publish_group); rank 0 is the part's source. Every part has a group per epoch, of the same members.

    Its rendezvous goes over a store connection of its own: torch's store client serves one call at a time, and a
    rendezvous blocked in C++ on a member that does not come would hold every other call of the process's client
    behind it for up to `timeout_s` (a sampler's heartbeat, which then reads as a hang, and the other parts'
    rendezvous, each part's receiver following the epochs on its own thread, so that part's source gives up on this
    member). The members first meet in Python (wait_for_members, `should_stop` ending the wait), so a member that
    is stopping leaves at once and torch's rendezvous starts only once all arrived."""
    sub = dist.PrefixStore(f"publish/{_part_prefix(stage, tp_rank, sender)}e{epoch}/", store.raw.clone())
    wait_for_members(sub, rank, size, timeout_s, f"publish epoch {epoch}'s group (stage {stage}, TP rank {tp_rank}, "
                                                 f"sender {sender}) of {size - 1} sampler(s)", should_stop)
    timeout = timedelta(seconds=timeout_s)
    if resolve_backend(backend) == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(sub, rank, size, opts)
    return dist.ProcessGroupGloo(sub, rank, size, timeout)


def engine_tp_group(topo: Topology, store: SignedStore, backend: str, timeout_s: float, incarnation: int = 0):
    """The group of one sampler engine's TP ranks (group rank = TP rank); None at sampler_tp 1.

    The lead broadcasts each step's plan over it and the forward all-reduces its row-parallel outputs.
    Registered with torch.distributed (identity ranks, as the SGLang group below) so `dist.*` calls take
    it, although a sampler process has no default group. Under fault.on_failure=replace an engine is replaced
    whole, all its ranks as the same `incarnation` (megarl.roles.sampler_keeper), and each incarnation's group
    is formed afresh under keys of its own: a dead predecessor's keys never meet its replacement's."""
    if topo.role != "sampler" or topo.sampler_tp == 1:
        return None
    name = f"megarl_engine{topo.engine_index}_tp"
    group_store = dist.PrefixStore(f"engine{topo.engine_index}/tp/" + (f"i{incarnation}/" if incarnation else ""),
                                   store.raw)
    wait_for_members(group_store, topo.engine_tp_rank, topo.sampler_tp, timeout_s,
                     f"engine {topo.engine_index}'s TP group (sampler.tp={topo.sampler_tp})")
    return _registered_group(group_store, topo.engine_tp_rank, topo.sampler_tp, resolve_backend(backend), name,
                             timedelta(seconds=timeout_s))


def _registered_group(store: dist.Store, rank: int, size: int, backend: str, name: str, timeout: timedelta):
    """A process group built by torch's `_new_process_group_helper` (private, as in SGLang) and
    registered with identity ranks, so `dist.broadcast(src=0, group=...)` works in any process."""
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    group, _ = _new_process_group_helper(size, rank, [], Backend(backend), store, group_name=name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(size)}
    return group


def sglang_group_layout(num_engines: int, tp: int) -> tuple[int, list[int]]:
    """(world size, rank offset of each engine) of the SGLang weight-update group.

    Rank 0 is the learner's publish source. SGLang's model runner joins as `rank_offset + tp_rank`, so
    engine i (one server on `tp` GPUs) owns ranks [1 + i*tp, 1 + (i+1)*tp).
    """
    return 1 + num_engines * tp, [1 + i * tp for i in range(num_engines)]


def sglang_gpu_slice(rank: int, local_rank: int, local_world_size: int, num_learners: int, tp: int,
                     gpus_per_node: int) -> list[int]:
    """The node-local GPUs of the SGLang server that sampler `rank` starts.

    Learner ranks use one GPU each, GPU = LOCAL_RANK; the samplers of a node take the GPUs after its
    learners, `tp` each, in rank order.
    """
    node_first = rank - local_rank
    learners_here = min(max(num_learners - node_first, 0), local_world_size)
    first = learners_here + (local_rank - learners_here) * tp
    if first + tp > gpus_per_node:
        raise ConfigError(f"sampler.sglang.tp: sampler rank {rank} needs GPUs {first}..{first + tp - 1} on its node, "
                          f"but sampler.sglang.gpus_per_node={gpus_per_node} ({learners_here} learner ranks there)")
    return list(range(first, first + tp))


def init_sglang_update_group(backend: str, host: str, port: int, world_size: int, rank: int, group_name: str,
                             timeout_s: float):
    """Join an SGLang weight-update group exactly as SGLang's `init_custom_process_group` builds one.

    Both sides must produce the same store keys, so this follows SGLang (python/sglang/srt/utils,
    called from model_runner.init_weights_update_group): the store of a `tcp://host:port` rendezvous
    (rank 0 hosts it), a PrefixStore(group_name), torch's `_new_process_group_helper` (private, as in
    SGLang), and the group registered with identity ranks so `dist.broadcast(src=0, group=...)` works.
    The TCPStore is built here with the tcp rendezvous handler's arguments rather than through
    `rendezvous()`: under torchrun (TORCHELASTIC_USE_AGENT_STORE) that handler would connect to the
    torchrun agent's store instead of hosting this group's. Blocks until all `world_size` members
    joined or `timeout_s` passed.
    """
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:  # listens on `host` only, not on every interface (megarl.distributed.store_server)
        store = tcp_store_server(host, port, timeout, world_size, wait_for_workers=True, multi_tenant=True)
    else:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout, multi_tenant=True)
    return _registered_group(dist.PrefixStore(group_name, store), rank, world_size, backend, group_name, timeout)
