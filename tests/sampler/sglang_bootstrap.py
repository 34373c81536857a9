"""A torchrun worker (test_sglang_engine.py) whose children do SGLang's torch.distributed bootstrap.

SGLang's model runner initialises torch.distributed with init_method tcp://127.0.0.1:<free port>,
world size tp and rank tp_rank, even at TP 1. Each child here does that at world size 1, once with
the worker's own environment and once with `server_env` of it; prints {"inherited", "cleaned"}: "ok" or
"failed: ..." for each. The inherited one is given 3 s: a store nobody hosts never answers, however long it is
waited for, while the cleaned one starts at once (its 60 s are there only for a loaded machine).
"""
import json
import os
import subprocess
import sys

from megarl.distributed.sglang_publish import free_port
from megarl.sampler.sglang_engine import server_env

CHILD = """
import sys
from datetime import timedelta
import torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", world_size=1, rank=0,
                        timeout=timedelta(seconds=float(sys.argv[2])))
dist.barrier()
dist.destroy_process_group()
"""


def bootstrap(env: dict, timeout_s: float) -> str:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(free_port("127.0.0.1")), str(timeout_s)], env=env,
                          capture_output=True, text=True, timeout=120)
    return "ok" if proc.returncode == 0 else f"failed: {proc.stderr.strip().splitlines()[-1:]}"


assert os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True", "not run as a torchrun worker"
print(json.dumps({"inherited": bootstrap(dict(os.environ), 3), "cleaned": bootstrap(server_env(os.environ), 60)}))
