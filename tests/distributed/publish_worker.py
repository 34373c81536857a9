"""torchrun worker for tests/distributed/test_publish.py: rank 0 publishes, the others receive.

Usage: publish_worker.py OUT_DIR MODE[,MODE...]   (MODE: ok | corrupt | senders | delta)
Several modes run one after the other in one launch (the same world: senders only alone), each over publish
groups of its own and writing into OUT_DIR/MODE; `corrupt` only last (its receivers stop at the refused bucket).
Each receiver writes, per version, the received tensors' checksums to OUT_DIR/rank{r}.json (the last
receiver receives into a `destination` of its own, the others into the receiver's staging sets); the
publisher writes what it sent to OUT_DIR/sent.json. `corrupt` makes the header's checksums wrong.
`senders`: ranks 0 and 1 are two DP replicas holding the same weights, each publishing its share
(publish.senders=2) over its own group; the receivers merge the parts (StagedReceiver), as a run does.
`delta`: bf16 on the wire (fp32 on both ends) with delta publish; versions 2 and 4 change 1% of the
elements, version 3 every one (sent whole), and `sent0.json` also has each publish's bytes.
"""
import json
import os
import sys
import threading
import zlib
from pathlib import Path

import torch

from megarl.config.schema import Config
from megarl.distributed import publish as pub
from megarl.distributed.lifetime import exit_process
from megarl.distributed.ranks import Topology
from megarl.distributed.topology import connect_store, publish_groups, publish_stage_store

VERSIONS = 4


def weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    # Mixed sizes: small tensors share a bucket (packed); ones bigger than a bucket get their own, sent
    # as they are when contiguous ("a", "c") and packed when not ("e", a transposed view).
    return {"a.weight": torch.randn(300, 200, generator=g), "b.bias": torch.randn(7, generator=g),
            "c.weight": torch.randn(64, 64, generator=g), "d.weight": torch.randn(3, 5, generator=g),
            "e.weight": torch.randn(90, 40, generator=g).t()}


def evolving(version: int) -> dict[str, torch.Tensor]:
    """Version 1's weights, then per version a share of the elements moved (delta mode)."""
    w = weights(1)
    for step in range(2, version + 1):
        g = torch.Generator().manual_seed(100 + step)
        frac = 1.0 if step == 3 else 0.01
        w = {n: torch.where(torch.rand(t.shape, generator=g) < frac, t + 0.5, t) for n, t in w.items()}
    return w


def crc(t: torch.Tensor) -> int:  # independent of the checksum under test
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy())


def run(mode: str, out: Path, topo: Topology, store, senders: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    groups = publish_groups(topo, store, "gloo", 60)
    if topo.role == "learner":
        (part, group), = groups.items()
        delta = mode == "delta"
        publisher = pub.WeightPublisher(group, publish_stage_store(store, *part), bucket_mb=0.01, timeout_s=60,
                                        checksum=True, sender=rank, senders=senders,
                                        wire_dtype=torch.bfloat16 if delta else None, delta=delta)
        if mode == "corrupt":
            real_checksum = pub.bucket_checksum
            # the sent sums lie: receivers must refuse
            pub.bucket_checksum = lambda b: [x ^ 1 for x in real_checksum(b)]
        sent, sizes = {}, {}
        for v in range(1, VERSIONS + 1):
            w = evolving(v) if delta else weights(v)
            sizes[v] = publisher.publish(v, w.items(), extra={"v": v})
            # What a receiver's fp32 engine must hold: the tensors, rounded to bf16 on the wire in delta mode.
            sent[v] = {n: crc(t.to(torch.bfloat16).float() if delta else t) for n, t in w.items()}
            if mode == "corrupt":
                break
        own = sorted(slot.name for bucket in publisher.buckets for slot in bucket.slots)
        (out / f"sent{rank}.json").write_text(json.dumps({"sent": sent, "buckets": len(publisher.buckets), "own": own,
                                                          "sizes": sizes}))
    else:
        engine_version = [0]
        received, done = {}, threading.Event()

        def on_version(version, tensors, extra):
            assert extra == {"v": version}
            received[version] = {n: crc(t.clone()) for n, t in tensors.items()}
            engine_version[0] = version
            if version == VERSIONS:
                done.set()

        spec = {n: (t.shape, t.dtype) for n, t in weights(0).items()}
        # The last receiver writes every version into storage of its own, as a built-in engine's
        # `staging_buffers` (two sets, by version parity; "e" a transposed, non-contiguous view).
        own_sets = [{n: torch.empty(t.shape[::-1]).t() if n == "e.weight" else torch.empty(t.shape)
                     for n, t in weights(0).items()} for _ in range(2)]
        recv = pub.StagedReceiver([(groups[part], publish_stage_store(store, *part)) for part in sorted(groups)],
                                  spec, torch.device("cpu"), on_version=on_version,
                                  current_version=lambda: engine_version[0], should_stop=done.is_set,
                                  timeout_s=60,
                                  destination=(lambda v: own_sets[v % 2]) if rank == world - 1 else None).start()
        recv.join(60)
        result = {"received": received, "error": repr(recv.error) if recv.error else None}
        (out / f"rank{rank}.json").write_text(json.dumps(result))


modes = sys.argv[2].split(",")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
senders = 2 if modes == ["senders"] else 1
assert ("senders" not in modes or senders == 2) and "corrupt" not in modes[:-1], f"{modes}: senders alone, corrupt last"
topo = Topology(rank=rank, world_size=world, num_learners=senders, num_samplers=world - senders,
                publish_senders=senders)
store = connect_store(topo, 60)
for mode in modes:
    run(mode, Path(sys.argv[1]) / mode, topo, store.prefixed(mode), senders)
exit_process(0)  # not a plain exit: see megarl.distributed.lifetime
