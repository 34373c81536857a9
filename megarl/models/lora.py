"""LoRA adapters in HF / PEFT terms: which modules a model has to adapt, the adapter tensors' names and shapes,
the check of `learner.lora.*` against a model, merging an adapter into base weights, and the PEFT files.

Pure functions over tensors and config dicts; the learner's adapter modules (megarl/learner/lora.py) and the
built-in engine's adapter application (megarl/sampler/lora.py) both speak the names defined here:
``model.layers.{i}.self_attn.q_proj.lora_A.weight`` [rank, in] and ``...lora_B.weight`` [out, rank], exactly
PEFT's keys without its ``base_model.model.`` prefix, so what is published is also what is exported.

megatron fuses q/k/v into one linear (``linear_qkv``) and gate/up into another (``linear_fc1``); one adapter on a
fused linear is, in HF terms, one adapter per projection that shares its A and splits its B's rows. So on the
megatron learner those projections are adapted together or not at all (`LORA_FUSED_GROUPS` in megarl/config/schema.py).
The HF modules a family's targets adapt (Phi-3's fused ``qkv_proj``, DeepSeek-V3's latent projections) are
megarl.models.lora_targets's.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

# (checked against config.json without torch, by `megarl train` too; the names stay importable from here)
from megarl.models.lora_targets import ATTENTION_TARGETS, check, modules  # noqa: F401
from megarl.portable import lora_merge

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def scale(lora_cfg) -> float:
    """The factor of the adapter's output B @ A x (peft's lora_alpha / r)."""
    return lora_cfg.alpha / lora_cfg.rank


def adapter_names(layer: int, module: str) -> tuple[str, str]:
    """The HF names of the A and B of one module of a decoder layer (`self_attn.q_proj`: PEFT's keys without the
    base_model.model. prefix)."""
    base = f"model.layers.{layer}.{module}"
    return f"{base}.lora_A.weight", f"{base}.lora_B.weight"


def adapter_spec(hf_config: dict, lora_cfg, layers: range | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every adapter tensor of `layers` (all by default), in publish order: layer by
    layer, the adapted modules in lora_targets.modules' order, A before B."""
    adapted, r = modules(hf_config, lora_cfg.target_modules), lora_cfg.rank
    layers = range(int(hf_config["num_hidden_layers"])) if layers is None else layers
    spec = []
    for layer in layers:
        for module, (fan_in, fan_out) in adapted.items():
            a, b = adapter_names(layer, module)
            spec += [(a, (r, fan_in), torch.float32), (b, (fan_out, r), torch.float32)]
    return spec


def merge(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    """Full HF weights with the adapter merged: W + factor * B @ A for every adapted weight (new tensors, in
    W's dtype, computed in fp32); every other weight is `base`'s own tensor (shared, not copied). The math is
    megarl.portable.lora_merge's, which megarl's vLLM worker runs too."""
    return dict(lora_merge.merged_weights(base, adapter, factor))


def peft_config(lora_cfg, base_model: str, target_modules) -> dict:
    """adapter_config.json for peft: a LoraConfig adapting the HF modules `target_modules` (their names in a
    decoder layer: `qkv_proj` on Phi-3) whose merged weights are `merge`'s."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha, "lora_dropout": lora_cfg.dropout,
            "target_modules": sorted(target_modules), "bias": "none", "use_rslora": False,
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
    # (the modules peft adapts are the adapter's own: its A names' last module, e.g. `...self_attn.qkv_proj`)
    targets = {lora_merge.adapted_weight(name).rsplit(".", 2)[-2]
               for name in adapter if name.endswith(lora_merge.LORA_A)}
    (directory / ADAPTER_CONFIG).write_text(json.dumps(peft_config(lora_cfg, base_model, targets), indent=2) + "\n")
    return directory
