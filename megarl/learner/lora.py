"""LoRA on the megatron learner: adapter modules on a GPTModel's linears, and their tensors in HF / PEFT names.

Megatron-Bridge's PEFT is the well-kept megatron implementation, but 0.3.1 (PyPI) requires transformers < 5,
Transformer Engine and CUDA packages (mamba-ssm, causal-conv1d): it does not install here. So the adapter is a
small module hung on each targeted megatron linear (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`) with
a forward hook that adds ``alpha / r * B(A(dropout(x)))`` to the linear's output: the base weights keep their
names and stay frozen (loaded once, no gradient, no optimizer state); only A and B train. Its math is peft's
LoraLayer's (tests/learner/test_lora.py compares the two on the same weights).

One adapter on a fused linear is, in HF names, one adapter per projection sharing A with B's rows split the way
megarl.models.convert splits the weight's (`hf_adapter`): that is what the learner publishes and exports.
Tensor-parallel size 1 only (megarl/config/load.py refuses learner.tp > 1 with LoRA).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from megarl.models import convert
from megarl.models.lora import FUSED_GROUPS, TARGETS, adapter_names
from megarl.portable.lora_merge import merge_one


class LoraAdapter(nn.Module):
    """alpha / r * B(A(dropout(x))): A [r, in] initialised as peft does (Kaiming-uniform, a=sqrt(5)), B [out, r]
    zero, so a fresh adapter changes nothing."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float,
                 generator: torch.Generator, dtype: torch.dtype):
        super().__init__()
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) of an [r, in] matrix
        self.lora_A = nn.Parameter((torch.rand(rank, in_features, generator=generator) * 2 - 1).mul_(bound).to(dtype))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, dtype=dtype))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.dropout(x) @ self.lora_A.t()) @ self.lora_B.t() * self.scale


def _add_adapter_output(linear: nn.Module, args: tuple, output):
    """Forward hook of an adapted megatron linear: its (output, bias) with the adapter's output added."""
    out, bias = output
    return out + linear.lora(args[0]), bias


def attach(gpt, lora_cfg, layer_offset: int, seed: int) -> list[nn.Parameter]:
    """Freeze every weight of `gpt` and hang an adapter on the targeted linears of its decoder layers; return the
    adapter parameters (the only ones left trainable). A is drawn from a generator seeded by `seed` and the
    layer's global index, so every layout and every DP rank starts from the same adapter."""
    gpt.requires_grad_(False)
    dtype = next(gpt.parameters()).dtype
    params = []
    for local, layer in enumerate(gpt.decoder.layers):
        for k, (fused, group) in enumerate(FUSED_GROUPS.items()):
            if group[0] not in lora_cfg.target_modules:
                continue
            parent = layer.self_attention if fused in ("linear_qkv", "linear_proj") else layer.mlp
            linear = getattr(parent, fused)
            out_features, in_features = linear.weight.shape
            generator = torch.Generator().manual_seed(seed * 1_000_003 + (local + layer_offset) * len(FUSED_GROUPS) + k)
            linear.lora = LoraAdapter(in_features, out_features, lora_cfg.rank, lora_cfg.alpha, lora_cfg.dropout,
                                      generator, dtype).to(linear.weight.device)
            linear.register_forward_hook(_add_adapter_output)
            params += [linear.lora.lora_A, linear.lora.lora_B]
    return params


def hf_adapter(fused: dict[str, tuple[torch.Tensor, torch.Tensor]], layer: int, hf_config: dict,
               target_modules) -> dict[str, torch.Tensor]:
    """One decoder layer's adapters, megatron linear -> (A, B), as HF adapter names -> tensors in the order of
    megarl.models.lora.adapter_spec (q, k, v, o, gate, up, down; A before B)."""
    per_target: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, (a, b) in fused.items():
        if name == "linear_qkv":
            parts = convert.split_qkv_rows(b, hf_config)
        elif name == "linear_fc1":
            parts = b.chunk(2, dim=0)
        else:
            parts = (b,)
        per_target.update({t: (a, part.contiguous()) for t, part in zip(FUSED_GROUPS[name], parts)})
    out = {}
    for target in (t for t in TARGETS if t in target_modules):
        a_name, b_name = adapter_names(layer, target)
        out[a_name], out[b_name] = per_target[target]
    return out


def layer_adapters(layer: nn.Module, tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """megatron linear name -> (tensor(A), tensor(B)) of a decoder layer's adapted linears."""
    out = {}
    for fused in FUSED_GROUPS:
        parent = layer.self_attention if fused in ("linear_qkv", "linear_proj") else layer.mlp
        linear = getattr(parent, fused, None)
        if linear is not None and hasattr(linear, "lora"):
            out[fused] = (tensor(linear.lora.lora_A), tensor(linear.lora.lora_B))
    return out


def merge_layer(layer: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    """A decoder layer's megatron tensors (names relative to the layer, as a checkpoint holds them) with every
    adapter merged into its linear (W + factor * B @ A, in W's dtype) and the adapter tensors dropped."""
    out = {k: v for k, v in layer.items() if ".lora." not in k}
    for name in [k for k in layer if k.endswith(".lora.lora_A")]:
        linear = name[:-len(".lora.lora_A")]
        w = out[f"{linear}.weight"]
        out[f"{linear}.weight"] = merge_one(w, layer[name], layer[f"{linear}.lora.lora_B"], factor)
    return out


def checkpoint_adapters(layer: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """megatron linear name -> (A, B) of a checkpoint's decoder layer (names relative to the layer)."""
    out = {}
    for name in (k for k in layer if k.endswith(".lora.lora_A")):
        linear = name[:-len(".lora.lora_A")]
        out[linear.rsplit(".", 1)[-1]] = (layer[name], layer[f"{linear}.lora.lora_B"])
    return out
