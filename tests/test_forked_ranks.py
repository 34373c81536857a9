"""tests/forked_ranks.py, the torchrun stand-in of the learner tests' worker scripts: each rank runs the script as
`__main__` with torchrun's environment (the default process group and megarl's store work unchanged), and the
launch's exit status is the first failing rank's."""
import subprocess

from tests.helpers import REPO, forked_ranks

SCRIPT = '''
import os, sys
import torch, torch.distributed as dist
from megarl.distributed.ranks import Topology
from megarl.distributed.topology import connect_store

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
store = connect_store(Topology(rank=rank, world_size=world, num_learners=1, num_samplers=world - 1), 60)
store.set(f"seen/{rank}", "1")
store.wait([f"seen/{r}" for r in range(world)])
line = f"rank {rank} of {world}: sum {total.item():.0f}, argv {sys.argv[1]}, local rank {os.environ['LOCAL_RANK']}"
with open(f"{sys.argv[2]}/rank{rank}.txt", "w") as f:  # (a file each: lines printed to one pipe can interleave)
    f.write(line)
dist.destroy_process_group()
if rank == int(sys.argv[1]):
    sys.exit(3)
'''


def test_each_rank_runs_the_script_as_torchrun_would_and_a_failing_rank_fails_the_launch(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(forked_ranks(3, script, "1", tmp_path, timeout_s=100), capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert [(tmp_path / f"rank{r}.txt").read_text() if (tmp_path / f"rank{r}.txt").exists() else proc.stderr[-3000:]
            for r in range(3)] == [f"rank {r} of 3: sum 6, argv 1, local rank {r}" for r in range(3)]
    assert proc.returncode == 3  # rank 1's sys.exit(3), after every rank finished its part
