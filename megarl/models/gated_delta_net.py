"""HF <-> megatron-core names and layouts of one gated-DeltaNet layer (Qwen3.5 text, Qwen3-Next): pure functions.

megatron-core's GatedDeltaNet (megatron/core/ssm/gated_delta_net.py) holds one fused input projection whose output
rows are [q | k | v | z | b | a] (q, k: linear_num_key_heads x linear_key_head_dim; v, z: linear_num_value_heads x
linear_value_head_dim; b, a: one row per value head), a depthwise conv over [q | k | v], per-value-head dt_bias and
A_log, a gated RMSNorm over each value head (`out_norm`, a plain weight: the norm is x / rms(x) * w, then times
silu(z)) and the output projection. transformers' Qwen3.5 holds the same tensors as separate projections
(`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) in that order within each, so the fused projection is their
concatenation along the output rows and the rest map one to one: the conversion is exact both ways.
Qwen3-Next's HF checkpoint fuses them differently (`in_proj_qkvz` and `in_proj_ba`, grouped per key head);
`qwen3_next_to_qwen3_5` regroups them into Qwen3.5's layout first.

Under tensor parallelism megatron splits each of the six parts of the fused projection by heads, so a rank's rows
are [q_r | k_r | v_r | z_r | b_r | a_r] (its `_split_tensor_factory` in sharded_state_dict), and the conv the same
way over [q_r | k_r | v_r]; `tp_slice` gives a rank's share.
"""
from __future__ import annotations

import torch

# HF (Qwen3.5) parameter names under a layer's `linear_attn.` -> megatron's under its `self_attention.`, for the
# tensors that map one to one.
ONE_TO_ONE = {"conv1d.weight": "conv1d.weight", "dt_bias": "dt_bias", "A_log": "A_log",
              "norm.weight": "out_norm.weight", "out_proj.weight": "out_proj.weight"}
IN_PROJ_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def dims(hf_config: dict) -> dict:
    """The widths of the fused projection's parts: qk (each of q and k), v (each of v and z), heads (each of b, a)."""
    return {"qk": hf_config["linear_num_key_heads"] * hf_config["linear_key_head_dim"],
            "v": hf_config["linear_num_value_heads"] * hf_config["linear_value_head_dim"],
            "heads": hf_config["linear_num_value_heads"]}


def hf_to_mcore(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer's HF `linear_attn.*` tensors (names relative to it) -> megatron GatedDeltaNet's."""
    out = {"in_proj.weight": torch.cat([hf[f"{part}.weight"] for part in IN_PROJ_PARTS], 0)}
    out.update({mcore: hf[name] for name, mcore in ONE_TO_ONE.items()})
    return out


def mcore_to_hf(mcore: dict[str, torch.Tensor], hf_config: dict) -> dict[str, torch.Tensor]:
    """The inverse of hf_to_mcore (split views of the fused projection, cloned: each HF tensor owns its storage)."""
    d = dims(hf_config)
    widths = (2 * d["qk"] + d["v"], d["v"], d["heads"], d["heads"])
    parts = torch.split(mcore["in_proj.weight"], widths, 0)
    out = {f"{part}.weight": t.clone() for part, t in zip(IN_PROJ_PARTS, parts)}
    out.update({name: mcore[m] for name, m in ONE_TO_ONE.items()})
    return out


def qwen3_next_to_qwen3_5(hf: dict[str, torch.Tensor], hf_config: dict) -> dict[str, torch.Tensor]:
    """Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` (rows grouped per key head: [q_h | k_h | v_h | z_h] and
    [b_h | a_h], each with that key head's value heads) regrouped as Qwen3.5's four projections; the rest as is."""
    nk, dk = hf_config["linear_num_key_heads"], hf_config["linear_key_head_dim"]
    per_group = hf_config["linear_num_value_heads"] // nk
    dv = per_group * hf_config["linear_value_head_dim"]
    qkvz = hf["in_proj_qkvz.weight"].view(nk, 2 * dk + 2 * dv, -1)
    q, k, v, z = torch.split(qkvz, [dk, dk, dv, dv], 1)
    b, a = torch.split(hf["in_proj_ba.weight"].view(nk, 2 * per_group, -1), [per_group, per_group], 1)
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731 - heads back into rows, head-major
    out = {"in_proj_qkv.weight": torch.cat([flat(q), flat(k), flat(v)], 0), "in_proj_z.weight": flat(z),
           "in_proj_b.weight": flat(b), "in_proj_a.weight": flat(a)}
    out.update({name: t for name, t in hf.items() if name not in ("in_proj_qkvz.weight", "in_proj_ba.weight")})
    return out


def transformer_config_kwargs(hf_config: dict, linear_layers: tuple[bool, ...]) -> dict:
    """The TransformerConfig fields megatron's GatedDeltaNet reads: its widths, Qwen's SiLU (the conv's activation
    and the output gate's; megatron's default is GELU), the norm's epsilon, and which layers are linear attention
    (`linear_layers`, megatron's linear_attention_freq as a per-layer list: 1 linear, 0 full attention)."""
    import torch.nn.functional as F

    keys = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
            "linear_num_value_heads")
    return {**{k: hf_config[k] for k in keys}, "activation_func": F.silu, "normalization": "RMSNorm",
            "layernorm_epsilon": hf_config["rms_norm_eps"], "experimental_attention_variant": "gated_delta_net",
            "linear_attention_freq": [int(linear) for linear in linear_layers]}


def _tp_widths(name: str, hf_config: dict) -> tuple[int, ...] | None:
    """The widths of the parts a fused tensor's rows split into, each split over TP by heads (None: one part)."""
    d = dims(hf_config)
    if name == "in_proj.weight":
        return (d["qk"], d["qk"], d["v"], d["v"], d["heads"], d["heads"])
    if name == "conv1d.weight":
        return (d["qk"], d["qk"], d["v"])
    return None


def tp_unslice(name: str, shares: list[torch.Tensor], hf_config: dict) -> torch.Tensor:
    """The whole megatron GatedDeltaNet tensor `name` from every TP rank's tp_slice share, in rank order."""
    tp = len(shares)
    if tp == 1 or name == "out_norm.weight":
        return shares[0]
    if name == "out_proj.weight":
        return torch.cat(shares, 1)
    widths = _tp_widths(name, hf_config)
    if widths is None:
        return torch.cat(shares, 0)
    parts = [torch.split(share, [w // tp for w in widths], 0) for share in shares]
    return torch.cat([torch.cat([p[i] for p in parts], 0) for i in range(len(widths))], 0)


# The names megatron's GatedDeltaNet.sharded_state_dict saves its fused tensors' parts under (`in_proj.weight.query`,
# ...; the conv's first three), in their order within the fused rows.
CHECKPOINT_PARTS = ("query", "key", "value", "z", "beta", "alpha")


def join_checkpoint_parts(layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer's tensors as a checkpoint holds them (megatron names relative to the layer) with each fused
    gated-DeltaNet tensor saved in parts (`self_attention.in_proj.weight.query`, ...) joined back into one."""
    out, parts = {}, {}
    for name, tensor in layer.items():
        base, _, part = name.rpartition(".")
        if part in CHECKPOINT_PARTS and base.endswith(("in_proj.weight", "conv1d.weight")):
            parts.setdefault(base, {})[part] = tensor
        else:
            out[name] = tensor
    for base, pieces in parts.items():
        out[base] = torch.cat([pieces[p] for p in CHECKPOINT_PARTS if p in pieces], 0)
    return out


def tp_slice(name: str, tensor: torch.Tensor, hf_config: dict, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s share of megatron GatedDeltaNet tensor `name` at tensor parallelism `tp`: every part of the
    fused projection and of the conv split by heads, dt_bias / A_log by value heads, out_proj by its input
    columns; out_norm (one weight over a value head) is whole on every rank."""
    if tp == 1 or name == "out_norm.weight":
        return tensor
    if name == "out_proj.weight":
        return tensor.chunk(tp, 1)[rank]
    widths = _tp_widths(name, hf_config)
    if widths is None and name in ("dt_bias", "A_log"):
        widths = (dims(hf_config)["heads"],)
    elif widths is None:
        raise KeyError(f"{name!r} is not a megatron GatedDeltaNet tensor")
    if hf_config["linear_num_key_heads"] % tp:
        raise ValueError(f"learner.tp={tp} does not divide linear_num_key_heads={hf_config['linear_num_key_heads']}")
    return torch.cat([part.chunk(tp, 0)[rank] for part in torch.split(tensor, widths, 0)], 0)
