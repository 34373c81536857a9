"""LoRA adapters in HF / PEFT terms: which modules a model has to adapt, the adapter tensors' names and shapes,
the check of `learner.lora.*` against a model, merging an adapter into base weights, and the PEFT files.

Pure functions over tensors and config dicts; the learner's adapter modules (megarl/learner/lora.py) and the
built-in engine's adapter application (megarl/sampler/lora.py) both speak the names defined here:
``model.layers.{i}.self_attn.q_proj.lora_A.weight`` [rank, in] and ``...lora_B.weight`` [out, rank], exactly
PEFT's keys without its ``base_model.model.`` prefix, so what is published is also what is exported.

megatron fuses q/k/v into one linear (``linear_qkv``) and gate/up into another (``linear_fc1``); one adapter on a
fused linear is, in HF terms, one adapter per projection that shares its A and splits its B's rows. So on the
megatron learner those projections are adapted together or not at all (`LORA_FUSED_GROUPS` in megarl/config/schema.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from megarl.config.schema import LORA_TARGETS as TARGETS
# (checked against config.json without torch, by `megarl train` too; the names stay importable from here)
from megarl.models.lora_targets import ATTENTION_TARGETS, check, target_dims  # noqa: F401
from megarl.portable import lora_merge

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def scale(lora_cfg) -> float:
    """The factor of the adapter's output B @ A x (peft's lora_alpha / r)."""
    return lora_cfg.alpha / lora_cfg.rank


def module_path(target: str) -> str:
    """`q_proj` -> `self_attn.q_proj`: where an HF decoder layer holds the projection."""
    return f"self_attn.{target}" if target in ATTENTION_TARGETS else f"mlp.{target}"


def adapter_names(layer: int, target: str) -> tuple[str, str]:
    """The HF names of one projection's A and B (PEFT's keys without the base_model.model. prefix)."""
    base = f"model.layers.{layer}.{module_path(target)}"
    return f"{base}.lora_A.weight", f"{base}.lora_B.weight"


def adapter_spec(hf_config: dict, lora_cfg, layers: range | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every adapter tensor of `layers` (all by default), in publish order: layer by
    layer, projections in `TARGETS` order, A before B."""
    dims, r = target_dims(hf_config), lora_cfg.rank
    layers = range(int(hf_config["num_hidden_layers"])) if layers is None else layers
    spec = []
    for layer in layers:
        for target in (t for t in TARGETS if t in lora_cfg.target_modules):
            a, b = adapter_names(layer, target)
            spec += [(a, (r, dims[target][0]), torch.float32), (b, (dims[target][1], r), torch.float32)]
    return spec


def merge(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    """Full HF weights with the adapter merged: W + factor * B @ A for every adapted weight (new tensors, in
    W's dtype, computed in fp32); every other weight is `base`'s own tensor (shared, not copied). The math is
    megarl.portable.lora_merge's, which megarl's vLLM worker runs too."""
    return dict(lora_merge.merged_weights(base, adapter, factor))


def peft_config(lora_cfg, base_model: str) -> dict:
    """adapter_config.json for peft: a LoraConfig whose merged weights are `merge`'s."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha, "lora_dropout": lora_cfg.dropout,
            "target_modules": sorted(lora_cfg.target_modules), "bias": "none", "use_rslora": False,
            "fan_in_fan_out": False, "inference_mode": True}


def save_peft(directory: str | Path, adapter: dict[str, torch.Tensor], lora_cfg, base_model: str) -> Path:
    """Write `adapter` (HF adapter names -> tensors) as a PEFT adapter directory that
    ``peft.PeftModel.from_pretrained(base, directory)`` loads onto the HF base model."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # (clones: the projections of one fused megatron linear share their A, and safetensors refuses shared memory)
    save_file({PEFT_PREFIX + name: t.detach().clone() for name, t in adapter.items()}, str(directory / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG).write_text(json.dumps(peft_config(lora_cfg, base_model), indent=2) + "\n")
    return directory
