"""Under megarl.distributed.local_launch: every rank uses the store; rank 0 writes to OUT what the torchrun agent
(its parent) listens on, the store's address and a digest of each rank's run secret (never the secret)."""
import hashlib
import json
import os
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist

store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                      timeout=timedelta(seconds=60))
rank = os.environ["RANK"]
store.set(f"secret/{rank}", hashlib.sha256(os.environ["MEGARL_RUN_SECRET"].encode()).hexdigest())
store.wait(["secret/0", "secret/1"])
if rank == "0":
    agent = os.getppid()
    lines = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout.splitlines()
    json.dump({"listening": [line.split()[3] for line in lines if f"pid={agent}," in line],
               "store": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
               "secrets": [store.get(f"secret/{r}").decode() for r in "01"]}, open(sys.argv[1], "w"))
