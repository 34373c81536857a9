"""Under megarl.distributed.local_launch (no torch import: the test pays only for the launcher's): each rank writes
OUT.RANK with a digest of its run secret (never the secret); rank 0 adds what the torchrun agent, its parent,
listens on and the store address the ranks were given."""
import hashlib
import json
import os
import subprocess
import sys

report = {"secret": hashlib.sha256(os.environ["MEGARL_RUN_SECRET"].encode()).hexdigest()}
if os.environ["RANK"] == "0":
    agent = os.getppid()
    lines = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout.splitlines()
    report["listening"] = [line.split()[3] for line in lines if f"pid={agent}," in line]
    report["store"] = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
with open(f"{sys.argv[1]}.{os.environ['RANK']}", "w") as f:
    json.dump(report, f)
