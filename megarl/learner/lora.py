"""LoRA on the megatron learner: adapter modules on a GPTModel's linears, and their tensors in HF / PEFT names.

Megatron-Bridge's PEFT is the well-kept megatron implementation, but 0.3.1 (PyPI) requires transformers < 5,
Transformer Engine and CUDA packages (mamba-ssm, causal-conv1d): it does not install here. So the adapter is a
small module hung on each targeted megatron linear (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`) with
a forward hook that adds ``alpha / r * B(A(dropout(x)))`` to the linear's output: the base weights keep their
names and stay frozen (loaded once, no gradient, no optimizer state); only A and B train. Its math is peft's
LoraLayer's (tests/learner/test_lora.py compares the two on the same weights).

One adapter on a fused linear is, in HF names, one adapter per projection sharing A with B's rows split the way
megarl.models.convert splits the weight's (`hf_adapter`): that is what the learner publishes and exports. Where the
HF module is fused too (Phi-3's ``qkv_proj`` and ``gate_up_proj``) it is one adapter there as well, B's rows in the
HF module's order (q, k, v: peft's adapter on ``qkv_proj``); multi-latent attention's linears (DeepSeek-V3) are
each one HF module, row for row (megarl.models.latent_attention), so each adapter is that module's.
Over tensor parallelism each adapter is split the way its linear is (`LoraAdapter`); the learner publishes and
exports the whole (TP=1) tensors. Multi-latent attention's down-projections are whole on every TP rank (megarl.
learner.layer_spec), so their adapters are too (`DUPLICATED`).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from megarl.config.schema import LORA_FUSED_GROUPS
from megarl.models import convert, families, latent_attention, lora_targets
from megarl.models.lora import adapter_names
from megarl.portable.lora_merge import merge_one


ROW_PARALLEL = ("linear_proj", "linear_fc2")  # megatron's RowParallelLinear: input split over TP; the rest column
# ... but these, whole on every TP rank over its sequence-parallel positions (layer_spec._whole_latent_projections)
DUPLICATED = ("linear_q_down_proj", "linear_kv_down_proj")
PARENT = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}


def linear_modules(hf_config: dict) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """megatron linear (its path in a decoder layer) -> (the LoRA targets that adapt it, the HF modules its rows
    are, as lora_targets.modules names them) of every linear a decoder layer can adapt, in a fixed order."""
    dims = lora_targets.module_dims(hf_config)
    latent = families.family_of(hf_config).latent_attention
    out = {}
    if latent:  # each latent-attention linear is one HF module, row for row
        for hf, megatron in latent_attention.names(hf_config):
            if "layernorm" not in hf:
                module = f"self_attn.{hf.removesuffix('.weight')}"
                out[f"self_attention.{megatron.removesuffix('.weight')}"] = (
                    tuple(t for t, held in dims.items() if module in held), (module,))
    for fused, group in LORA_FUSED_GROUPS.items():
        if not (latent and PARENT[fused] == "self_attention"):
            out[f"{PARENT[fused]}.{fused}"] = (group, tuple(dict.fromkeys(m for t in group for m in dims[t])))
    return out


def adapted_linears(hf_config: dict, targets) -> dict[str, tuple[str, ...]]:
    """megatron linear path -> the HF modules its adapter is, of the linears `targets` adapt."""
    return {linear: held for linear, (group, held) in linear_modules(hf_config).items()
            if any(t in targets for t in group)}


class LoraAdapter(nn.Module):
    """alpha / r * B(A(dropout(x))) on one TP rank's share of a megatron linear. At TP size 1 A is [r, in] and
    B [out, r]. Over TP it is split the way the linear is: on a column-parallel linear (output rows split) A is
    whole and B holds this rank's output rows; on a row-parallel one (input columns split) A holds this rank's
    input columns and B is whole. Its `tp_region` is megatron's differentiable TP collective on the [.., r] hidden:
    copy_to_tensor_model_parallel_region for column-parallel (identity forward; the backward sums the ranks'
    partial gradients of A and x) and reduce_from_tensor_model_parallel_region for row-parallel (sums the ranks'
    partial x_shard @ A_shard^T; its output is then added after the linear's own all-reduce). Both are the
    identity at TP size 1. Under sequence parallelism (an MoE model at TP > 1: megarl.learner.sequence_parallel) a
    column-parallel linear's input is this rank's positions and a row-parallel one's output must be, so the
    collectives are gather_from_sequence_parallel_region and reduce_scatter_to_sequence_parallel_region, and the
    factor every rank holds whole (A of column-parallel, B of row-parallel) gets gradients from this rank's positions
    only: it is marked `sequence_parallel`, which megatron's finalize_model_grads sums over TP (as for the norms).
    On a `duplicated` linear (whole on every TP rank: multi-latent attention's down-projections) A and B are whole,
    no collective runs (the linear's input and output are this rank's positions), and under sequence parallelism
    both are marked `sequence_parallel`, their gradients from this rank's positions summed over TP as the linear's.
    The parameters are created empty; `attach` fills them."""

    def __init__(self, a_shape: tuple[int, int], b_shape: tuple[int, int], alpha: float, dropout: float,
                 dtype: torch.dtype, row_parallel: bool, gate_up_rows: bool, sequence_parallel: bool = False,
                 duplicated: bool = False):
        from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                                   gather_from_sequence_parallel_region,
                                                   reduce_from_tensor_model_parallel_region,
                                                   reduce_scatter_to_sequence_parallel_region)

        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(a_shape, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(b_shape, dtype=dtype))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scale = alpha / a_shape[0]
        self.row_parallel, self.duplicated = row_parallel, duplicated
        if duplicated:
            self.tp_region = nn.Identity()
            if sequence_parallel:
                self.lora_A.sequence_parallel = self.lora_B.sequence_parallel = True
        elif sequence_parallel:
            self.tp_region = (reduce_scatter_to_sequence_parallel_region if row_parallel
                              else gather_from_sequence_parallel_region)
            (self.lora_B if row_parallel else self.lora_A).sequence_parallel = True
        else:
            self.tp_region = (reduce_from_tensor_model_parallel_region if row_parallel
                              else copy_to_tensor_model_parallel_region)
        self.gate_up_rows = gate_up_rows  # linear_fc1: B's rows are [gate rows; up rows] on every TP rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp_region(self.dropout(x) @ self.lora_A.t()) @ self.lora_B.t() * self.scale

    def sharded_state_dict(self, prefix: str, sharded_offsets: tuple, metadata: dict | None) -> dict:
        """A and B as megatron ShardedTensors named by their place in the TP=1 tensors (B of linear_fc1 in the
        [gate; up] order its weight is saved in), so a checkpoint of one TP size loads at another."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axis = {} if self.duplicated else {"lora_A": 1} if self.row_parallel else {"lora_B": 0}
        out = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axis,
                                                  sharded_offsets)
        if self.gate_up_rows:
            out[f"{prefix}lora_B"] = apply_swiglu_sharded_factory(
                out[f"{prefix}lora_B"], sharded_offsets, (metadata or {}).get("singleton_local_shards", False))
        return out


def initial_adapter(in_features: int, out_features: int, rank: int,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole (TP=1) fp32 A [r, in], initialised as peft does (Kaiming-uniform, a=sqrt(5)), and B [out, r],
    zero, so a fresh adapter changes nothing."""
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) of an [r, in] matrix
    return (torch.rand(rank, in_features, generator=generator) * 2 - 1).mul_(bound), torch.zeros(out_features, rank)


def _add_adapter_output(linear: nn.Module, args: tuple, output):
    """Forward hook of an adapted megatron linear: its (output, bias) with the adapter's output added."""
    out, bias = output
    return out + linear.lora(args[0]), bias


def _with_adapter_sharded_state(linear: nn.Module) -> None:
    """Make the linear's sharded_state_dict give its adapter's TP-split ShardedTensors (megatron's linears save
    every tensor but their weight and bias as replicated)."""
    own = linear.sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        out = own(prefix, sharded_offsets, metadata)
        out.update(linear.lora.sharded_state_dict(f"{prefix}lora.", sharded_offsets, metadata))
        return out

    linear.sharded_state_dict = sharded_state_dict


def attach(gpt, hf_config: dict, lora_cfg, layer_offset: int, seed: int, tp_size: int, tp_slice,
           sequence_parallel: bool = False) -> list[nn.Parameter]:
    """Freeze every weight of `gpt` and hang an adapter on the targeted linears of its decoder layers; return the
    adapter parameters (the only ones left trainable). The whole A is drawn from a generator seeded by `seed`, the
    layer's global index and the linear's place in `linear_modules`, so every layout and every DP rank starts from
    the same adapter; each TP rank keeps `tp_slice(name, local_param, whole)` of it (the learner's own weight
    slicing, which also marks a split parameter tensor-parallel for the grad norm)."""
    gpt.requires_grad_(False)
    dtype = next(gpt.parameters()).dtype
    every = list(linear_modules(hf_config))
    adapted = adapted_linears(hf_config, lora_cfg.target_modules)
    params = []
    for local, layer in enumerate(gpt.decoder.layers):
        for path in adapted:
            linear = layer.get_submodule(path)
            out_local, in_local = linear.weight.shape
            fused = path.rsplit(".", 1)[-1]
            row, duplicated = fused in ROW_PARALLEL, fused in DUPLICATED
            in_features, out_features = ((in_local, out_local) if duplicated else (in_local * tp_size, out_local)
                                         if row else (in_local, out_local * tp_size))
            generator = torch.Generator().manual_seed(
                seed * 1_000_003 + (local + layer_offset) * len(every) + every.index(path))
            whole = initial_adapter(in_features, out_features, lora_cfg.rank, generator)
            adapter = LoraAdapter((lora_cfg.rank, in_local), (out_local, lora_cfg.rank), lora_cfg.alpha,
                                  lora_cfg.dropout, dtype, row_parallel=row, gate_up_rows=fused == "linear_fc1",
                                  sequence_parallel=sequence_parallel, duplicated=duplicated)
            with torch.no_grad():
                for (part, param), full in zip(adapter.named_parameters(), whole):
                    param.copy_(tp_slice(f"decoder.layers.{local}.{path}.lora.{part}", param, full))
            linear.lora = adapter.to(linear.weight.device)
            linear.register_forward_hook(_add_adapter_output)
            _with_adapter_sharded_state(linear)
            params += [linear.lora.lora_A, linear.lora.lora_B]
    return params


def hf_adapter(fused: dict[str, tuple[torch.Tensor, torch.Tensor]], layer: int, hf_config: dict,
               target_modules) -> dict[str, torch.Tensor]:
    """One decoder layer's adapters, megatron linear path -> (A, B), as HF adapter names -> tensors in the order
    of megarl.models.lora.adapter_spec (A before B). A linear that is several HF modules (dense q/k/v, gate/up)
    gives each its rows of B and the shared A; one whose HF module is fused too (Phi-3) gives B's rows in that
    module's order."""
    held = adapted_linears(hf_config, target_modules)
    per_module: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for path, (a, b) in fused.items():
        name = path.rsplit(".", 1)[-1]
        if name == "linear_qkv":
            parts = convert.split_qkv_rows(b, hf_config)
        elif name == "linear_fc1":
            parts = b.chunk(2, dim=0)
        else:
            parts = (b,)
        if len(held[path]) == 1 and len(parts) > 1:
            parts = (torch.cat(parts),)
        per_module.update({m: (a, part.contiguous()) for m, part in zip(held[path], parts)})
    out = {}
    for module in lora_targets.modules(hf_config, target_modules):
        a_name, b_name = adapter_names(layer, module)
        out[a_name], out[b_name] = per_module[module]
    return out


def layer_adapters(layer: nn.Module, tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """megatron linear path -> (tensor(name, A), tensor(name, B)) of a decoder layer's adapted linears, each
    parameter named relative to the layer (`self_attention.linear_qkv.lora.lora_A`)."""
    out = {}
    for path, module in layer.named_modules():
        if isinstance(module, LoraAdapter):
            linear = path.removesuffix(".lora")
            out[linear] = tuple(tensor(f"{path}.{part}", param) for part, param in module.named_parameters())
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
    """megatron linear path -> (A, B) of a checkpoint's decoder layer (names relative to the layer)."""
    out = {}
    for name in (k for k in layer if k.endswith(".lora.lora_A")):
        linear = name[:-len(".lora.lora_A")]
        out[linear] = (layer[name], layer[f"{linear}.lora.lora_B"])
    return out
