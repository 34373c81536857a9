"""Merging a LoRA adapter into base weights: W + factor * B @ A, computed in fp32, cast to W's dtype.

The one definition of the merge. The built-in engine's AdapterStager uses it through `megarl.models.lora.merge`;
megarl's vLLM worker extension runs it inside the vLLM server (which is why it imports only torch: see
megarl/portable/__init__.py); the learner runs it to publish merged weights to SGLang (megarl/learner/lora_publish.py).
Adapter tensors are named as PEFT names them without its ``base_model.model.`` prefix: ``<weight name minus
.weight>.lora_A.weight`` [rank, in] and ``...lora_B.weight`` [out, rank].
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

LORA_A = ".lora_A.weight"
LORA_B = ".lora_B.weight"
Spec = list[tuple[str, tuple[int, ...], torch.dtype]]  # (name, shape, dtype) of each tensor, in order


def adapted_weight(a_name: str) -> str:
    """`model.layers.0.self_attn.q_proj.lora_A.weight` -> `model.layers.0.self_attn.q_proj.weight`."""
    return a_name[:-len(LORA_A)] + ".weight"


def merge_one(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, factor: float) -> torch.Tensor:
    """W + factor * B @ A: a new tensor, computed in fp32 on W's device, in W's dtype."""
    a = a.to(device=w.device, dtype=torch.float32)
    b = b.to(device=w.device, dtype=torch.float32)
    return torch.addmm(w.float(), b, a, alpha=factor).to(w.dtype)


def check(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor]) -> None:
    """ValueError naming the first adapter tensor that cannot merge into `base`: a name that is no A or B, an A
    without its B (or the reverse), a weight `base` lacks, or shapes with B @ A != W's."""
    for name in adapter:
        if not name.endswith((LORA_A, LORA_B)):
            raise ValueError(f"adapter tensor {name!r} is neither a LoRA A ({LORA_A}) nor a B ({LORA_B})")
        partner = name[:-len(LORA_A)] + LORA_B if name.endswith(LORA_A) else name[:-len(LORA_B)] + LORA_A
        if partner not in adapter:
            raise ValueError(f"adapter tensor {name!r} comes without {partner!r}")
    for a_name in (n for n in adapter if n.endswith(LORA_A)):
        weight = adapted_weight(a_name)
        if weight not in base:
            raise ValueError(f"adapter tensor {a_name!r} adapts {weight!r}, which the base model does not have")
        a, b, w = adapter[a_name], adapter[a_name[:-len(LORA_A)] + LORA_B], base[weight]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise ValueError(f"adapter of {weight!r}: A {tuple(a.shape)} and B {tuple(b.shape)} do not make a "
                             f"B @ A of the weight's shape {tuple(w.shape)}")


def merged_weights(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor],
                   factor: float) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of `base`, in its order: `merge_one` where the adapter has an A and B for it, else base's own
    tensor (shared, not copied). One merged weight at a time, so a consumer that streams (vLLM's reload) holds at
    most one extra weight."""
    for name, w in base.items():
        a_name = name.removesuffix(".weight") + LORA_A
        if not name.endswith(".weight") or a_name not in adapter:
            yield name, w
            continue
        yield name, merge_one(w, adapter[a_name], adapter[name.removesuffix(".weight") + LORA_B], factor)


def merged_spec(adapter_spec: Spec) -> Spec:
    """(weight name, (out, in), dtype) of every weight an adapter with this (name, shape, dtype) spec adapts, in the
    order of its A tensors: what a version carries when it is published merged (megarl/learner/lora_publish.py)."""
    shapes = {name: shape for name, shape, _ in adapter_spec}
    return [(adapted_weight(name), (shapes[name[:-len(LORA_A)] + LORA_B][0], shape[1]), dtype)
            for name, shape, dtype in adapter_spec if name.endswith(LORA_A)]
