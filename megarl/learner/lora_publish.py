"""A LoRA policy published as merged weights: what `sampler.engine=sglang` receives under `learner.lora`.

SGLang's own adapter route (`/load_lora_adapter`, `lora_path` per request) pins each request to one adapter for its
whole life and keys the radix cache by it, so a running request cannot move to the next version: not the in-flight
picture (docs/lora.md; tests/sampler/sglang_contract/check.py records it against SGLang's code). So for SGLang the
learner merges the adapter itself and publishes, through SGLang's weight-update path that full weights take, only
the weights the adapter adapts, W_base + alpha / r * B @ A under their HF names: a partial update, which SGLang's
model loaders take name by name (the contract check holds SGLang's code to that). Every other weight stays what
the server loaded.

The publishing rank keeps the frozen base of the adapted weights (whole, fp32, CPU), read once from the learner at
start (`learner.adapted_base_tensors()`: gathered over TP, or ZeRO-3, the way the full-weight publish is); every
version is merged into that base, never into the previous version, so no rounding accumulates. The merge is
megarl.portable.lora_merge's, the one every engine uses.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from megarl.models.lora import scale
from megarl.portable import lora_merge
from megarl.portable.lora_merge import Spec


class MergedLoraSource:
    """Stands in for the learner where `publish_weights` reads it (version, publish_tensors, publish_spec): each
    version is the adapted weights with the learner's current adapter merged, in the adapter spec's order.

    Construction is collective like publish_tensors (every learner rank reads the base; only `keep` ranks, the
    publish source, hold it)."""

    def __init__(self, learner, lora_cfg, keep: bool):
        self.learner, self.factor = learner, scale(lora_cfg)
        self.spec: Spec = lora_merge.merged_spec(learner.publish_spec())
        self.base: dict[str, torch.Tensor] | None = None
        if not keep:
            for _ in learner.adapted_base_tensors():  # its collectives; nothing kept
                pass
            return
        self.base = dict(learner.adapted_base_tensors())
        got, want = [(n, tuple(t.shape)) for n, t in self.base.items()], [(n, s) for n, s, _ in self.spec]
        if got != want:
            raise RuntimeError(f"the learner's adapted base weights {got} are not its adapter's targets {want}")

    @property
    def version(self) -> int:
        return self.learner.version

    @property
    def base_bytes(self) -> int:
        """What the kept base costs the publish source (0 on other ranks)."""
        return sum(t.numel() * t.element_size() for t in self.base.values()) if self.base is not None else 0

    def publish_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The merged adapted weights (fp32; on the publish source only, one at a time: a streaming consumer holds
        one merged weight beyond the base). Collective like the learner's publish_tensors: every rank reads the
        adapter."""
        adapter = dict(self.learner.publish_tensors())
        if self.base is None:
            return
        lora_merge.check(self.base, adapter)
        yield from lora_merge.merged_weights(self.base, adapter, self.factor)

    def publish_spec(self, shards: bool = False) -> Spec:
        """What publish_tensors yields (whole tensors: learner.lora takes no shard-to-shard publish)."""
        return self.spec
