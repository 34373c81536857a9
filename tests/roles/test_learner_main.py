"""The learner loop's intake: stale and (optionally) zero-variance groups are dropped, counted and
retired, over the real ZeroMQ queue fed by another process."""
import multiprocessing as mp
from collections import Counter
from datetime import timedelta

import torch.distributed as dist

from megarl.config.load import load_config
from megarl.distributed.queue import QueueReceiver, QueueSender
from megarl.protocols import Sample
from megarl.roles.learner_main import _collect_groups
from tests.distributed.test_queue import KEY, free_port
from tests.helpers import REPO


def group(gid: str, versions: list[int], rewards=(1.0, 0.0), rank: int = 1) -> list[Sample]:
    return [Sample(group_id=gid, prompt="1+1=", completion="2", prompt_ids=[1], token_ids=[2] * len(versions),
                   logprobs=[-0.1] * len(versions), versions=versions, reward=r, finish_reason="stop",
                   sampler_rank=rank) for r in rewards]


def _feed(port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
    sender = QueueSender(store, timeout_s=20, key=KEY, sender=1)
    for g in [group("s0-g0", [3, 4]), group("s0-g1", [6, 7]), group("s1-g0", [7], rewards=(1.0, 1.0), rank=2),
              group("s0-g2", [5, 9]), group("s0-g3", [0]), group("s0-g4", [9])]:
        sender.send_group(g)
    sender.close()


def test_stale_and_zero_variance_groups_are_dropped_counted_and_retired():
    cfg = load_config(REPO / "configs" / "demo.yaml",
                      ["algo.max_lag=4", "algo.prompts_per_step=3", "algo.advantage.filter_zero_variance=true"])
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=20))
    queue = QueueReceiver(store, "127.0.0.1", KEY, max_bytes=1 << 20)
    proc = mp.get_context("spawn").Process(target=_feed, args=(port,))
    proc.start()
    retired, sampler_stats = Counter(), {}
    groups, dropped, _ = _collect_groups(queue, cfg, learner_version=9, drop=lambda g: retired.update([g[0].sampler_rank]),
                                         sampler_stats=sampler_stats)
    proc.join(30)
    # learner version 9, max_lag 4: a group whose oldest token is version < 5 is stale.
    assert [g[0].group_id for g in groups] == ["s0-g1", "s0-g2", "s0-g4"]  # old, flat and older dropped
    assert dropped == Counter({"stale_groups": 2, "zero_variance_groups": 1})
    assert retired == Counter({1: 2, 2: 1})  # dropped groups free the sampler's budget at once
    assert set(sampler_stats) == {1, 2}
    queue.close()

