"""A stand-in learner for the SGLang tests: rank 0 of the weight-update group, publishing one new version.

Usage: sglang_learner.py MODEL_DIR WEIGHTS_OUT PORT WORLD_SIZE WEIGHT_FORMAT VERSION [STORE_PORT]
Perturbs the weights found in WEIGHTS_OUT if it exists (the previous version), else MODEL_DIR's;
writes the new weights to WEIGHTS_OUT (so the test can recompute log-probs with them), joins the
group at 127.0.0.1:PORT and publishes them once with SGLangPublisher, tensors in sorted name order.
With STORE_PORT the publisher's keys go to the test's TCPStore there (where SGLangWeightFollower
reads them), the publish waits for the test to set "test/go", and the header's extra carries
{"retired": {"1": VERSION}}; without, an in-process HashStore holds them (nobody reads them).
"""
import sys
from datetime import timedelta
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed import HashStore, TCPStore

from megarl.distributed.sglang_publish import SGLangPublisher
from megarl.sampler.model import load_pretrained

model_dir, out, port, world, weight_format, version = sys.argv[1:7]
store_port = int(sys.argv[7]) if len(sys.argv) > 7 else None
old = load_file(out) if Path(out).exists() else load_pretrained(model_dir)[1]
gen = torch.Generator().manual_seed(int(version))
new = {name: t + 0.05 * torch.randn(t.shape, generator=gen, dtype=t.dtype) for name, t in sorted(old.items())}
save_file(new, out + ".tmp")
Path(out + ".tmp").rename(out)
store = HashStore() if store_port is None else TCPStore("127.0.0.1", store_port, is_master=False,
                                                         timeout=timedelta(seconds=60))
publisher = SGLangPublisher(store, world_size=int(world), host="127.0.0.1", port=int(port), backend="gloo",
                            weight_format=weight_format, bucket_mb=0.01, timeout_s=60, join_timeout_s=60)
if store_port is not None:
    store.wait(["test/go"])
publisher.publish(int(version), new.items(), extra={"retired": {"1": int(version)}})
publisher.close()
