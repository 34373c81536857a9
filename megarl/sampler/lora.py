"""Adapter-only versions for the built-in engine: publish receives the adapter, the engine runs base + adapter.

`AdapterStager` keeps the frozen base weights (HF names, loaded once from the model directory) and, for each
published version's adapter tensors, stages W = W_base + alpha / r * B @ A for the adapted weights (the other
weights are the base's own tensors) through `BuiltinEngine.stage_weights`. So the engine applies an adapter
version exactly as it applies full weights: merged on the receiving thread, swapped in at the next step
boundary, running requests continue, each token tagged with the version that computed it. A version is always
merged into the base, never into the previous version, so no error accumulates over thousands of versions.

The price: the sampler holds the base weights once more (HF names) beside the engine's current and staged
versions. The wire carries only the adapter (megabytes, not gigabytes).
"""
from __future__ import annotations

import torch

from megarl.models import lora
from megarl.sampler.model import load_pretrained


class AdapterStager:
    """The publish receiver's target for adapter versions (see the module docstring): `weight_spec()` is
    what each version must carry, `stage(tensors, version)` merges and stages it on `engine`."""

    def __init__(self, engine, base: dict[str, torch.Tensor], hf_config: dict, lora_cfg):
        lora.check(hf_config, lora_cfg)
        self.engine = engine
        self.base = {name: t.to(engine.device) for name, t in base.items()}
        self.factor = lora.scale(lora_cfg)
        self._spec = {name: (torch.Size(shape), dtype) for name, shape, dtype in lora.adapter_spec(hf_config, lora_cfg)}

    @classmethod
    def from_pretrained(cls, engine, model_dir: str, lora_cfg) -> "AdapterStager":
        hf_config, base = load_pretrained(str(model_dir))
        return cls(engine, base, hf_config, lora_cfg)

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def version(self) -> int:
        return self.engine.version

    def weight_spec(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Adapter name -> (shape, dtype) of every tensor a version carries."""
        return dict(self._spec)

    def stage(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Merge one version's adapter into the base and stage it (safe to call from another thread)."""
        names = set(tensors)
        if names != set(self._spec):
            raise ValueError(f"adapter version {version}: missing {sorted(set(self._spec) - names)[:3]}, "
                             f"unexpected {sorted(names - set(self._spec))[:3]}")
        for name, t in tensors.items():
            if t.shape != self._spec[name][0]:
                raise ValueError(f"adapter version {version}: {name} is {tuple(t.shape)}, "
                                 f"expected {tuple(self._spec[name][0])}")
        with torch.inference_mode():
            merged = lora.merge(self.base, {n: t.to(self.device) for n, t in tensors.items()}, self.factor)
        self.engine.stage_weights(merged, version)
