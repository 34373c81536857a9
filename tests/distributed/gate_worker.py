"""Under a gated megarl.distributed.local_launch: each rank reaches the launch gate as megarl's ranks do
(megarl.roles.worker), marks OUT.RANK.waiting, then writes OUT.RANK with what it was told: "go" or "refused". With a third argument (a
path), rank 0 first writes a forged verdict into the store (a process without the run secret) and marks that path."""
import os
import sys
from pathlib import Path

from megarl.distributed import launch_gate
from megarl.distributed.ranks import Topology
from megarl.distributed.topology import connect_store

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = connect_store(Topology(rank=rank, world_size=world, num_learners=world, num_samplers=0), 60)
if rank == 0 and len(sys.argv) > 2:
    store.raw.underlying_store.set(launch_gate.KEY, b"go" + bytes(32))  # the right shape, the wrong tag
    Path(sys.argv[2]).write_text("forged")
assert launch_gate.gated(), "the launcher did not tell its ranks they are gated"
Path(f"{sys.argv[1]}.{rank}.waiting").touch()
verdict = launch_gate.wait_for_go(store, 60, rank)
Path(f"{sys.argv[1]}.{rank}").write_text("go" if verdict else "refused")
