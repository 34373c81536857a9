"""LoRA on HF models through peft (the DeepSpeed learner's `learner.lora`): wrapping the model, and peft's parameter
and checkpoint keys as megarl's HF adapter names.

peft (0.21) does the adapter itself: `wrap` hangs a LoraLayer on every targeted projection of the HF model and
freezes everything else, so DeepSpeed's optimizer gets the adapter only. What peft calls
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.default.weight`` is published and exported under
megarl.models.lora's names (``model.layers.{i}.self_attn.q_proj.lora_A.weight``: PEFT's saved keys without their
``base_model.model.`` prefix), the names the megatron learner publishes and the built-in engine's AdapterStager
expects; the frozen ``...q_proj.base_layer.weight`` is the HF ``...q_proj.weight``.
"""
from __future__ import annotations

import torch
from torch import nn

from megarl.models import lora
from megarl.models.lora_targets import check_peft, peft_modules
from megarl.portable import lora_merge

ADAPTER_NAME = "default"  # peft's name of the one adapter megarl trains


def wrap(model: nn.Module, hf_config: dict, lora_cfg) -> nn.Module:
    """`model` as a peft LoRA model of `lora_cfg` (rank, alpha, dropout, target modules; A Kaiming-uniform, B zero,
    so the wrapped model starts as the base): only the adapter parameters require gradients. Refuses (naming the
    key) a target the model lacks or a rank above a target's dimensions, before peft does anything."""
    check_peft(hf_config, lora_cfg)
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ImportError("learner.lora with learner.backend=deepspeed needs peft: `pip install -e \".[lora]\"` "
                          "(or `pip install \"peft>=0.21\"`)") from exc
    config = LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                        target_modules=peft_modules(hf_config, lora_cfg.target_modules), bias="none", use_rslora=False)
    return get_peft_model(model, config, adapter_name=ADAPTER_NAME)


def peft_key(name: str) -> str:
    """megarl's adapter name -> the peft model's parameter / state-dict key of that tensor."""
    base, matrix = name[:-len(".lora_A.weight")], name[-len("lora_A.weight"):-len(".weight")]
    return f"{lora.PEFT_PREFIX}{base}.{matrix}.{ADAPTER_NAME}.weight"


def adapter_parameters(peft_model: nn.Module, hf_config: dict, lora_cfg) -> list[tuple[str, nn.Parameter]]:
    """(megarl adapter name, peft parameter) of every adapter tensor, in megarl.models.lora.adapter_spec's order
    (what the engine's AdapterStager checks a version against)."""
    params = dict(peft_model.named_parameters())
    return [(name, params[peft_key(name)]) for name, _, _ in lora.adapter_spec(hf_config, lora_cfg)]


def base_parameters(peft_model: nn.Module, hf_config: dict, lora_cfg) -> list[tuple[str, nn.Parameter]]:
    """(HF weight name, peft's frozen ``base_layer`` parameter) of every weight the adapter adapts, in adapter_spec's
    order of their A tensors."""
    params = dict(peft_model.named_parameters())
    return [(name, params[f"{lora.PEFT_PREFIX}{name[:-len('.weight')]}.base_layer.weight"])
            for name, _, _ in lora_merge.merged_spec(lora.adapter_spec(hf_config, lora_cfg))]


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A peft model's state dict (a DeepSpeed checkpoint's keys) -> (HF base weights, megarl adapter tensors):
    the prefix dropped, ``.base_layer.`` out of the adapted projections' own weights, ``.default`` out of the
    adapter's. Values are passed through as they are (lazy tensors stay lazy)."""
    base, adapter = {}, {}
    for key, tensor in state.items():
        if not key.startswith(lora.PEFT_PREFIX):
            raise ValueError(f"{key!r} is not a peft model's key (no {lora.PEFT_PREFIX!r} prefix)")
        name = key[len(lora.PEFT_PREFIX):]
        if f".{ADAPTER_NAME}." in name and (".lora_A." in name or ".lora_B." in name):
            adapter[name.replace(f".{ADAPTER_NAME}.", ".")] = tensor
        else:
            base[name.replace(".base_layer.", ".")] = tensor
    return base, adapter
