"""Under a raw torchrun without MEGARL_RUN_SECRET: each rank takes the run secret (the shared-file path of
megarl.secret), writes OUT.RANK with its digest and the secret files it sees, and exits once every
rank has (as a run's ranks all live until the run ends)."""
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from megarl.secret import _private_dir, run_secret

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
digest = hashlib.sha256(run_secret()).hexdigest()
files = sorted(p.name for p in _private_dir().iterdir())
Path(f"{sys.argv[1]}.{rank}").write_text(json.dumps({"digest": digest, "files": files}))
deadline = time.monotonic() + 60
while not all(Path(f"{sys.argv[1]}.{r}").exists() for r in range(world)):
    assert time.monotonic() < deadline, "the other ranks never wrote"
    time.sleep(0.05)
