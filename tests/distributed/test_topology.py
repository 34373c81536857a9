"""Who is in which publish group: whole tensors from each stage's first rank (at learner TP 1 to every TP rank
of a TP engine, each keeping its slices), or shard to shard from each TP rank of the stage's first DP replica to
the same TP rank of every sampler engine, or with publish.senders = k from the first rank of each of the stage's
first k DP replicas. Every start-up group first waits, stoppably, for all its members."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from megarl.distributed.ranks import Topology
from megarl.distributed.topology import wait_for_members
from tests.helpers import REPO


def world(tp: int, dp: int, pp: int, engines: int, sampler_tp: int = 1, senders: int = 1) -> list[Topology]:
    learners = tp * dp * pp
    size = learners + engines * sampler_tp
    return [Topology(rank=r, world_size=size, num_learners=learners, num_samplers=size - learners,
                     learners_per_stage=tp * dp, sampler_tp=sampler_tp, learner_tp=tp, publish_senders=senders)
            for r in range(size)]


def members(ranks: list[Topology]) -> dict[tuple[int, int, int], list[tuple[int, int]]]:
    """publish part -> [(group rank, global rank)] in group-rank order."""
    groups: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for t in ranks:
        for part in t.publish_parts:
            groups.setdefault(part, []).append((t.publish_rank, t.rank))
    return {part: sorted(m) for part, m in groups.items()}


def test_whole_tensors_go_from_each_stage_first_rank_to_every_engine():
    # tp2 dp2 pp2: stage 0 = learner ranks 0-3, stage 1 = 4-7; two engines of one rank: 8, 9.
    assert members(world(2, 2, 2, engines=2)) == {(0, 0, 0): [(0, 0), (1, 8), (2, 9)],
                                                  (1, 0, 0): [(0, 4), (1, 8), (2, 9)]}


def test_shard_to_shard_pairs_learner_tp_rank_r_with_tp_rank_r_of_every_engine():
    # tp2 dp2 pp2 learner (megatron order: tp fastest, then dp, then pp), two engines of 2 ranks: 8-9, 10-11.
    ranks = world(2, 2, 2, engines=2, sampler_tp=2)
    assert members(ranks) == {(0, 0, 0): [(0, 0), (1, 8), (2, 10)], (0, 1, 0): [(0, 1), (1, 9), (2, 11)],
                              (1, 0, 0): [(0, 4), (1, 8), (2, 10)], (1, 1, 0): [(0, 5), (1, 9), (2, 11)]}
    assert ranks[0].engine_leads == [8, 10]
    assert [(t.engine_index, t.engine_tp_rank) for t in ranks[8:]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert ranks[2].publish_parts == [] and ranks[2].publish_rank is None  # DP replica 1 sends nothing


def test_at_learner_tp_1_every_tp_rank_of_every_engine_receives_the_whole_tensors():
    # tp1 dp2 pp2 learner (stage 0 = ranks 0-1, stage 1 = 2-3), two engines of 2 ranks: 4-5, 6-7 (an MoE model).
    ranks = world(1, 2, 2, engines=2, sampler_tp=2)
    assert members(ranks) == {(0, 0, 0): [(0, 0), (1, 4), (2, 5), (3, 6), (4, 7)],
                              (1, 0, 0): [(0, 2), (1, 4), (2, 5), (3, 6), (4, 7)]}
    assert {t.publish_group_size for t in ranks} == {5}
    assert all(t.slices_on_arrival and not t.shard_to_shard for t in ranks)
    assert [(t.engine_index, t.engine_tp_rank) for t in ranks[4:]] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_several_senders_are_the_first_rank_of_each_of_the_first_k_dp_replicas_of_every_stage():
    # tp2 dp3 pp2, senders=2: stage 0 = ranks 0-5 (replicas at offsets 0, 2, 4), stage 1 = 6-11; engines 12, 13.
    ranks = world(2, 3, 2, engines=2, senders=2)
    assert members(ranks) == {(0, 0, 0): [(0, 0), (1, 12), (2, 13)], (0, 0, 1): [(0, 2), (1, 12), (2, 13)],
                              (1, 0, 0): [(0, 6), (1, 12), (2, 13)], (1, 0, 1): [(0, 8), (1, 12), (2, 13)]}
    assert ranks[4].publish_parts == [] and ranks[1].publish_parts == []  # replica 2, and a TP rank 1


def test_context_parallel_ranks_sit_between_tp_and_dp_and_only_cp_rank_0_publishes():
    # tp2 cp2 dp2 pp1 (megatron order: tp fastest, then cp, then dp), senders=2: replicas at offsets 0 and 4.
    from megarl.config.load import load_config, world_size_for
    from megarl.distributed.ranks import rank_topology
    from tests.helpers import REPO

    cfg = load_config(REPO / "configs" / "demo.yaml", ["learner.tp=2", "learner.cp=2", "learner.dp=2",
                                                       "publish.senders=2", "sampler.num_engines=1"])
    assert world_size_for(cfg) == 9
    ranks = [rank_topology(cfg, r, 9) for r in range(9)]
    assert ranks[0].num_learners == 8 and ranks[0].learners_per_stage == 8
    assert members(ranks) == {(0, 0, 0): [(0, 0), (1, 8)], (0, 0, 1): [(0, 4), (1, 8)]}


# The sampler side of a one-learner, one-engine world whose learner never comes (it failed, or is still starting):
# a rank of that world waits for the publish group's other member under dist.timeout_s (600 s here).
WAITS_FOR_ITS_LEARNER = textwrap.dedent("""
    from datetime import timedelta
    import torch.distributed as dist
    from megarl.distributed.lifetime import install_stop_handlers, run_then_exit
    from megarl.distributed.ranks import Topology
    from megarl.distributed.signed_store import SignedStore
    from megarl.distributed.topology import publish_groups

    def main():
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
        sampler = Topology(rank=1, world_size=2, num_learners=1, num_samplers=1, learners_per_stage=1)
        install_stop_handlers()
        print("ready", flush=True)
        publish_groups(sampler, SignedStore(store, b"secret"), "gloo", 600)

    run_then_exit(main)
""")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_rank_stopped_while_it_waits_for_a_start_up_groups_members_leaves_at_once_saying_so(sig):
    proc = subprocess.Popen([sys.executable, "-c", WAITS_FOR_ITS_LEARNER], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO), "RANK": "1"})
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(getattr(signal, sig))
        # Without the stop check the rank sits in torch's rendezvous for its whole 600 s timeout: 120 s is far beyond
        # what leaving takes on a loaded machine (one poll of the store) and far below that timeout.
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()  # a rank that did not leave must not outlive the test
    assert proc.returncode == 128 + getattr(signal, sig), err
    assert err == (f"megarl: rank 1 stopped by {sig} while waiting for every member of publish group (stage 0, TP "
                   f"rank 0, sender 0): group rank 0 is its learner source, 1..1 the engines\n")


def test_a_start_up_group_whose_member_never_comes_times_out_naming_the_group_and_the_missing_member():
    store = dist.HashStore()
    with pytest.raises(TimeoutError, match=r"waited 0s for every member of the learner group \(3 learner ranks\); "
                                           r"still missing store key\(s\) \['arrived/0', 'arrived/2'\]"):
        wait_for_members(store, 1, 3, 0.3, "the learner group (3 learner ranks)")
