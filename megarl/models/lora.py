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
from megarl.models import families, moe
from megarl.portable import lora_merge

ATTENTION_TARGETS = TARGETS[:4]  # q, k, v, o: the attention block's projections; the rest are the MLP's
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def scale(lora_cfg) -> float:
    """The factor of the adapter's output B @ A x (peft's lora_alpha / r)."""
    return lora_cfg.alpha / lora_cfg.rank


def module_path(target: str) -> str:
    """`q_proj` -> `self_attn.q_proj`: where an HF decoder layer holds the projection."""
    return f"self_attn.{target}" if target in ATTENTION_TARGETS else f"mlp.{target}"


def target_dims(hf_config: dict) -> dict[str, tuple[int, int]]:
    """HF projection -> (in_features, out_features) of every projection a dense decoder layer has."""
    hidden, heads = int(hf_config["hidden_size"]), int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    inter = int(hf_config["intermediate_size"])
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def check(hf_config: dict, lora_cfg) -> None:
    """ValueError naming the learner.lora key that this model cannot take: a target module it does not have
    (a mixture-of-experts layer has no gate/up/down projection), or a rank above a target's smaller dimension
    (the adapter would be no lower-rank than the weight)."""
    if lora_cfg.rank == 0:
        return
    if hf_config.get("model_type") in families.FAMILIES and families.family_of(hf_config).fused_projections:
        raise ValueError(f"learner.lora: {hf_config['model_type']!r} holds fused qkv_proj / gate_up_proj, whose "
                         f"adapters megarl does not map (learner.lora.rank=0 trains the whole model)")
    if hf_config.get("model_type") in families.FAMILIES and families.family_of(hf_config).latent_attention:
        raise ValueError(f"learner.lora: {hf_config['model_type']!r}'s multi-latent attention has no q/k/v/o_proj "
                         f"adapters megarl maps (learner.lora.rank=0 trains the whole model)")
    dims = target_dims(hf_config)
    if moe.is_moe(hf_config):
        dims = {t: d for t, d in dims.items() if t in ATTENTION_TARGETS}
    for target in lora_cfg.target_modules:
        if target not in dims:
            raise ValueError(f"learner.lora.target_modules: {hf_config.get('model_type')!r} layers have no "
                             f"{target!r} (adaptable: {', '.join(dims)})")
        if lora_cfg.rank > min(dims[target]):
            raise ValueError(f"learner.lora.rank={lora_cfg.rank} is larger than {target}'s dimensions "
                             f"{dims[target][0]} x {dims[target][1]} (in x out); use a rank <= {min(dims[target])}")


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
