"""HF <-> megatron-core weight mapping of mixture-of-experts MLPs (pure functions), and the megatron
``TransformerConfig`` arguments that make megatron's MoE layer route like the HF model.

Owns the MoE half of megarl.models.convert: which HF MoE layouts megarl takes, the per-expert names
``save_pretrained`` writes (transformers 5.x fuses experts in memory, but writes one tensor per expert
and projection on disk: the names SGLang, vLLM and megarl's own engine load), and their megatron names
under the local layer spec with ``SequentialMLP`` experts
(``get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)``).

Layouts (HF on disk -> megatron, per decoder layer i, relative to ``decoder.layers.{i}.``):
  * Mixtral (``model_type: mixtral``): ``block_sparse_moe.gate.weight`` -> ``mlp.router.weight``;
    expert e ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down).  Routing: softmax over
    the top-k logits, which is softmax over all experts renormalised to the top k: megatron's default
    (top-k, then softmax).
  * Qwen3-MoE (``model_type: qwen3_moe``): ``mlp.gate.weight``; ``mlp.experts.{e}.gate_proj / up_proj /
    down_proj``.  ``norm_topk_prob: true`` routes as Mixtral; ``false`` keeps the top-k of the softmax over
    all experts unnormalised: megatron's ``moe_router_pre_softmax``.  (Its attention's q/k RMSNorm is
    convert's.)
  * GLM-4.5 (``model_type: glm4_moe``): Qwen3-MoE's names, plus ``mlp.gate.e_score_correction_bias`` ->
    ``mlp.router.expert_bias`` and the shared experts' ``mlp.shared_experts.gate_proj / up_proj / down_proj`` ->
    ``mlp.shared_experts.linear_fc1`` (cat[gate, up]) / ``linear_fc2``; its first ``first_k_dense_replace`` layers
    have a dense MLP (``mlp.gate_proj / up_proj / down_proj``, ``intermediate_size`` wide: megatron's
    ``moe_layer_freq`` list). Routing: sigmoid scores, the top-k chosen on scores + bias among the best
    ``topk_group`` of ``n_group`` groups (a group scored by its best two), their scores renormalised and scaled by
    ``routed_scaling_factor``: megatron's sigmoid router with expert bias (held fixed: update rate 0, as HF's is a
    buffer), group-limited top-k and top-k scaling factor.
  * gpt-oss (``model_type: gpt_oss``): ``mlp.router.weight`` / ``bias`` -> ``mlp.router.weight`` / ``bias``; its
    experts fused on disk as in memory (GPT_OSS_EXPERTS: gate and up interleaved by column, x @ W layout), split
    into megatron's per-expert linears with their biases. Routing: softmax over the top-k biased logits, megatron's
    default, as Mixtral.
  * DeepSeek-V3 (``model_type: deepseek_v3``; Kimi-K2's and DeepSeek-R1's architecture): GLM-4.5's MLP, names and
    routing exactly (``n_routed_experts``, ``n_shared_experts``, ``first_k_dense_replace`` and the router fields);
    its attention is megarl.models.latent_attention's.
  * megatron expert e: ``mlp.experts.local_experts.{e}.linear_fc1.weight`` = cat[gate, up] (SwiGLU, as the
    dense MLP) and ``...linear_fc2.weight`` = down.  With expert parallelism each EP rank holds
    ``E / ep`` consecutive experts, numbered locally from 0 (``expert_offset`` below).

What it takes and refuses (``check_moe``) is megarl.models.moe_config's, read without torch.
"""
from __future__ import annotations

import re
from typing import Iterator

import torch

from megarl import protocols
# (read from config.json without torch; the names stay importable from here, where their callers read them)
from megarl.models.moe_config import (SIGMOID_ROUTED, _groups, check_moe, expert_ffn_field,  # noqa: F401
                                      first_dense_layers, fused_experts_on_disk, is_moe, num_experts, top_k)


def expert_ffn_size(cfg: dict) -> int:
    return int(cfg[expert_ffn_field(cfg)])




def is_moe_layer(cfg: dict, layer: int) -> bool:
    return is_moe(cfg) and layer >= first_dense_layers(cfg)


def num_moe_layers(cfg: dict) -> int:
    """MoE layers of the model: the decoder layers after the first dense ones. A sample's routes hold one entry per
    MoE layer, in order (route index = layer index - first_dense_layers)."""
    return int(cfg["num_hidden_layers"]) - first_dense_layers(cfg) if is_moe(cfg) else 0


def routes_dtype(cfg: dict):
    """The integer dtype a sample's routes travel in (megarl.protocols.routes_dtype); `cfg` is the model's
    config.json (or just {"num_experts": E})."""
    return protocols.routes_dtype(num_experts(cfg))


def route_shape(cfg: dict) -> protocols.RouteShape | None:
    """What every sample's routes must look like for the model of config.json `cfg`; None for a dense model."""
    if not is_moe(cfg):
        return None
    return protocols.RouteShape(num_moe_layers(cfg), top_k(cfg), num_experts(cfg))


def transformer_config_kwargs(cfg: dict) -> dict:
    """megatron TransformerConfig arguments of the MoE layers (none for a dense model)."""
    if not is_moe(cfg):
        return {}
    check_moe(cfg)
    pre_softmax = cfg["model_type"] == "qwen3_moe" and not cfg.get("norm_topk_prob", False)
    return dict(**_glm4_moe_kwargs(cfg), **dict(
        num_moe_experts=num_experts(cfg),
        moe_router_topk=top_k(cfg),
        moe_ffn_hidden_size=expert_ffn_size(cfg),
        moe_router_pre_softmax=pre_softmax,
        # RL trains the policy's own objective; HF's router aux loss is a pre-training regulariser that
        # its forward does not compute either (output_router_logits off).
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall",
        # fp32 router logits, as HF computes them for the softmax
        moe_router_dtype="fp32",
    ))


def _glm4_moe_kwargs(cfg: dict) -> dict:
    """The router and layer arguments where GLM-4.5 differs (softmax routing, every layer MoE for the others)."""
    if cfg["model_type"] not in SIGMOID_ROUTED:
        return dict(moe_router_score_function="softmax")
    groups, kept = _groups(cfg)
    limited = kept < groups  # (all groups kept: no limit, whatever the groups' scores)
    dense = first_dense_layers(cfg)
    return dict(
        moe_router_score_function="sigmoid",
        # HF's e_score_correction_bias is a fixed buffer: megatron's expert bias, never updated
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=groups if limited else None,
        moe_router_group_topk=kept if limited else None,
        moe_router_topk_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        moe_shared_expert_intermediate_size=expert_ffn_size(cfg) * int(cfg["n_shared_experts"]),
        moe_layer_freq=[0] * dense + [1] * (int(cfg["num_hidden_layers"]) - dense),
    )


def _hf_prefix(cfg: dict, layer: int) -> str:
    block = "block_sparse_moe" if cfg["model_type"] == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}."


def hf_expert_names(cfg: dict, layer: int, expert: int) -> tuple[str, str, str]:
    """HF names of (gate, up, down) of one expert, as save_pretrained writes them (gpt-oss has none: its experts
    are saved fused, GPT_OSS_EXPERTS)."""
    if cfg["model_type"] == "gpt_oss":
        raise ValueError("gpt_oss saves its experts fused (mlp.experts.gate_up_proj [E, H, 2I], gate and up "
                         "interleaved; mlp.experts.down_proj [E, I, H]), not per expert")
    p = _hf_prefix(cfg, layer) + f"experts.{expert}."
    if cfg["model_type"] == "mixtral":
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def hf_router_name(cfg: dict, layer: int) -> str:
    return _hf_prefix(cfg, layer) + ("router.weight" if cfg["model_type"] == "gpt_oss" else "gate.weight")


# gpt-oss's experts as save_pretrained writes them (relative to the layer's ``mlp.experts.``), all experts in one
# tensor each, x @ W layout: gate_up_proj [E, H, 2I] whose columns interleave gate (even) and up (odd), its bias
# [E, 2I] likewise, down_proj [E, I, H] and its bias [E, H]. megatron's expert e: linear_fc1 rows cat[gate, up]
# (weight [2I, H], bias [2I]), linear_fc2 [H, I] and its bias [H].
GPT_OSS_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


# GLM-4.5's router bias and shared expert (HF names relative to the layer's ``mlp.``, megatron's to ``mlp.``)
EXPERT_BIAS = ("gate.e_score_correction_bias", "router.expert_bias")
SHARED_EXPERT = "shared_experts"


# transformers 5.x's in-memory names of a layer's MoE MLP (both layouts: the sparse block is ``mlp``, its experts
# fused [E, 2I, H] gate-then-up and [E, H, I] down, as the experts' forward chunks and applies them).
_IN_MEMORY = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$")


def per_expert_tensors(cfg: dict, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One parameter of a transformers model in memory -> the (name, tensor) pairs save_pretrained writes for it:
    a fused expert tensor becomes one view per expert and projection, the router gets its on-disk name
    (Mixtral's ``mlp.gate`` is ``block_sparse_moe.gate`` on disk); anything else passes through. Pure; views of
    `tensor` (works on meta tensors too, for a publish spec)."""
    match = _IN_MEMORY.match(name) if is_moe(cfg) and not fused_experts_on_disk(cfg) else None
    if match is None:
        yield name, tensor
        return
    layer, part = int(match.group(1)), match.group(2)
    if part == "gate.weight":
        yield hf_router_name(cfg, layer), tensor
        return
    for e in range(tensor.shape[0]):
        gate_name, up_name, down_name = hf_expert_names(cfg, layer, e)
        if part == "experts.down_proj":
            yield down_name, tensor[e]
        else:
            gate, up = tensor[e].chunk(2, dim=0)
            yield gate_name, gate
            yield up_name, up


def mlp_hf_to_mcore(hf_state: dict, cfg: dict, layer: int) -> dict:
    """One layer's MoE MLP: HF tensors -> megatron names relative to the layer, all experts."""
    out = {"mlp.router.weight": hf_state[hf_router_name(cfg, layer)]}
    if cfg["model_type"] == "gpt_oss":
        return {**out, **_gpt_oss_hf_to_mcore(hf_state, cfg, layer)}
    if cfg["model_type"] in SIGMOID_ROUTED:
        p = _hf_prefix(cfg, layer)
        out["mlp." + EXPERT_BIAS[1]] = hf_state[p + EXPERT_BIAS[0]]
        s = p + SHARED_EXPERT + "."
        out[f"mlp.{SHARED_EXPERT}.linear_fc1.weight"] = torch.cat(
            [hf_state[s + "gate_proj.weight"], hf_state[s + "up_proj.weight"]], dim=0)
        out[f"mlp.{SHARED_EXPERT}.linear_fc2.weight"] = hf_state[s + "down_proj.weight"]
    for e in range(num_experts(cfg)):
        gate, up, down = (hf_state[n] for n in hf_expert_names(cfg, layer, e))
        out[f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = down
    return out


def mlp_mcore_to_hf(mcore_layer: dict, cfg: dict, hf_layer_index: int, expert_offset: int = 0) -> dict:
    """One layer's MoE MLP: megatron names relative to the layer -> HF names with the global layer
    index.  The experts present are converted (all of them, or one EP rank's, whose local expert j is
    global expert ``expert_offset + j``); the router is included when present."""
    out = {}
    if "mlp.router.weight" in mcore_layer:
        out[hf_router_name(cfg, hf_layer_index)] = mcore_layer["mlp.router.weight"]
    if cfg["model_type"] == "gpt_oss":
        return {**out, **_gpt_oss_mcore_to_hf(mcore_layer, cfg, hf_layer_index, expert_offset)}
    p = _hf_prefix(cfg, hf_layer_index)
    if "mlp." + EXPERT_BIAS[1] in mcore_layer:
        out[p + EXPERT_BIAS[0]] = mcore_layer["mlp." + EXPERT_BIAS[1]]
    if f"mlp.{SHARED_EXPERT}.linear_fc1.weight" in mcore_layer:
        gate, up = mcore_layer[f"mlp.{SHARED_EXPERT}.linear_fc1.weight"].chunk(2, dim=0)
        s = p + SHARED_EXPERT + "."
        out[s + "gate_proj.weight"], out[s + "up_proj.weight"] = gate.contiguous(), up.contiguous()
        out[s + "down_proj.weight"] = mcore_layer[f"mlp.{SHARED_EXPERT}.linear_fc2.weight"]
    prefix = "mlp.experts.local_experts."
    local = sorted({int(k[len(prefix):].split(".")[0]) for k in mcore_layer if k.startswith(prefix)})
    for j in local:
        gate_name, up_name, down_name = hf_expert_names(cfg, hf_layer_index, expert_offset + j)
        gate, up = mcore_layer[f"{prefix}{j}.linear_fc1.weight"].chunk(2, dim=0)
        out[gate_name], out[up_name] = gate.contiguous(), up.contiguous()
        out[down_name] = mcore_layer[f"{prefix}{j}.linear_fc2.weight"]
    return out


def _gpt_oss_hf_to_mcore(hf_state: dict, cfg: dict, layer: int) -> dict:
    """gpt-oss's router bias and fused experts (GPT_OSS_EXPERTS) -> megatron's per-expert linears."""
    p = _hf_prefix(cfg, layer)
    gate_up, gate_up_bias, down, down_bias = (hf_state[p + "experts." + n] for n in GPT_OSS_EXPERTS)
    out = {"mlp.router.bias": hf_state[p + "router.bias"]}
    for e in range(num_experts(cfg)):
        fc = f"mlp.experts.local_experts.{e}."
        out[fc + "linear_fc1.weight"] = torch.cat([gate_up[e, :, 0::2], gate_up[e, :, 1::2]], dim=1).t().contiguous()
        out[fc + "linear_fc1.bias"] = torch.cat([gate_up_bias[e, 0::2], gate_up_bias[e, 1::2]])
        out[fc + "linear_fc2.weight"] = down[e].t().contiguous()
        out[fc + "linear_fc2.bias"] = down_bias[e]
    return out


def _gpt_oss_mcore_to_hf(mcore_layer: dict, cfg: dict, layer: int, expert_offset: int) -> dict:
    """megatron's per-expert linears -> gpt-oss's fused experts (every expert: a fused tensor has no per-rank
    part) and router bias."""
    p, prefix = _hf_prefix(cfg, layer), "mlp.experts.local_experts."
    out = {p + "router.bias": mcore_layer["mlp.router.bias"]} if "mlp.router.bias" in mcore_layer else {}
    local = sorted({int(k[len(prefix):].split(".")[0]) for k in mcore_layer if k.startswith(prefix)})
    if not local:
        return out
    if expert_offset or local != list(range(num_experts(cfg))):
        raise ValueError(f"gpt_oss's fused expert tensors need all {num_experts(cfg)} experts of layer {layer} "
                         f"(got {len(local)} from expert {expert_offset}): gather them over expert parallelism")
    fc1, fc1_bias, fc2, fc2_bias = (torch.stack([mcore_layer[f"{prefix}{e}.linear_fc{n}.{kind}"] for e in local])
                                    for n, kind in ((1, "weight"), (1, "bias"), (2, "weight"), (2, "bias")))
    gate, up = fc1.chunk(2, dim=1)  # [E, I, H] each
    gate_bias, up_bias = fc1_bias.chunk(2, dim=1)
    e, i, h = gate.shape
    out[p + "experts.gate_up_proj"] = torch.stack([gate, up], dim=2).reshape(e, 2 * i, h).transpose(1, 2).contiguous()
    out[p + "experts.gate_up_proj_bias"] = torch.stack([gate_bias, up_bias], dim=2).reshape(e, 2 * i)
    out[p + "experts.down_proj"] = fc2.transpose(1, 2).contiguous()
    out[p + "experts.down_proj_bias"] = fc2_bias
    return out


def unstack_checkpoint_experts(layer: dict) -> dict:
    """One layer as megatron's dist checkpoint stores it -> the model's names. SequentialMLP saves every
    expert's tensor as one ``mlp.experts.experts.<name>`` stacked over the global experts (its
    sharded_state_dict), which becomes ``mlp.experts.local_experts.{e}.<name>`` per expert."""
    stacked = "mlp.experts.experts."
    out = {k: v for k, v in layer.items() if not k.startswith(stacked)}
    for key, tensor in layer.items():
        if key.startswith(stacked):
            for e, expert in enumerate(tensor):
                out[f"mlp.experts.local_experts.{e}.{key[len(stacked):]}"] = expert
    return out


def global_expert_name(local_name: str, expert_offset: int) -> str:
    """A megatron parameter name with an EP rank's local expert index replaced by the global one."""
    marker = "mlp.experts.local_experts."
    if marker not in local_name or expert_offset == 0:
        return local_name
    head, rest = local_name.split(marker, 1)
    index, tail = rest.split(".", 1)
    return f"{head}{marker}{int(index) + expert_offset}.{tail}"
