"""A stand-in learner for the SGLang tests: rank 0 of the weight-update group, publishing one new version.

Usage: sglang_learner.py MODEL_DIR WEIGHTS_OUT PORT WORLD_SIZE WEIGHT_FORMAT VERSION [STORE_PORT] [--lora]
Perturbs the weights found in WEIGHTS_OUT if it exists (the previous version), else MODEL_DIR's;
writes the new weights to WEIGHTS_OUT (so the test can recompute log-probs with them), joins the
group at 127.0.0.1:PORT and publishes them once with SGLangPublisher, tensors in sorted name order.
With STORE_PORT the publisher's keys go to the test's TCPStore there (where SGLangWeightFollower
reads them), the publish waits for the test to set "test/go", and the header's extra carries
{"retired": {"1": VERSION}}; without, an in-process HashStore holds them (nobody reads them).

--lora (learner.lora on SGLang): the version is an adapter of LORA on every projection instead, drawn so that its
update is about half each adapted weight's spread, written to WEIGHTS_OUT as a PEFT adapter directory (the test
merges it with peft), and published as the learner publishes it to SGLang: `MergedLoraSource` (the learner's own
code) over MODEL_DIR's base, i.e. only the adapted weights, merged.
"""
import sys
from datetime import timedelta
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed import HashStore, TCPStore

from megarl.distributed.sglang_publish import SGLangPublisher
from megarl.sampler.model import load_pretrained
from tests.helpers import draw_adapter

LORA = {"rank": 4, "alpha": 8.0}


class AdapterLearner:
    """What MergedLoraSource reads from a learner: its frozen base, its adapter (spec and tensors), its version."""

    def __init__(self, base: dict, adapter: dict, version: int):
        self.base, self.adapter, self.version = base, adapter, version

    def publish_spec(self):
        return [(name, tuple(t.shape), t.dtype) for name, t in self.adapter.items()]

    def publish_tensors(self):
        return iter(self.adapter.items())

    def adapted_base_tensors(self):
        from megarl.portable.lora_merge import merged_spec

        return ((name, self.base[name]) for name, _, _ in merged_spec(self.publish_spec()))


def lora_version(model_dir: str, out: str, version: int):
    """Draw the adapter, save it as PEFT, and return the merged weights' source."""
    from megarl.config.schema import LoraConfig
    from megarl.learner.lora_publish import MergedLoraSource
    from megarl.models import lora

    cfg = LoraConfig(**LORA)
    hf_config, base = load_pretrained(model_dir)
    adapter = draw_adapter(base, hf_config, cfg, seed=version)
    lora.save_peft(out + ".tmp", adapter, cfg, model_dir)
    Path(out + ".tmp").rename(out)
    return MergedLoraSource(AdapterLearner(base, adapter, version), cfg, keep=True)


args = [a for a in sys.argv[1:] if a != "--lora"]
model_dir, out, port, world, weight_format, version = args[:6]
store_port = int(args[6]) if len(args) > 6 else None
if "--lora" in sys.argv:
    tensors = lora_version(model_dir, out, int(version)).publish_tensors()
else:
    old = load_file(out) if Path(out).exists() else load_pretrained(model_dir)[1]
    gen = torch.Generator().manual_seed(int(version))
    new = {name: t + 0.05 * torch.randn(t.shape, generator=gen, dtype=t.dtype) for name, t in sorted(old.items())}
    save_file(new, out + ".tmp")
    Path(out + ".tmp").rename(out)
    tensors = new.items()
store = HashStore() if store_port is None else TCPStore("127.0.0.1", store_port, is_master=False,
                                                         timeout=timedelta(seconds=60))
publisher = SGLangPublisher(store, world_size=int(world), host="127.0.0.1", port=int(port), backend="gloo",
                            weight_format=weight_format, bucket_mb=0.01, timeout_s=60, join_timeout_s=60)
if store_port is not None:
    store.wait(["test/go"])
publisher.publish(int(version), tensors, extra={"retired": {"1": int(version)}})
publisher.close()
