"""HF <-> megatron-core weight conversion for the causal LMs of megarl.models.families (Qwen2, Llama, Qwen3 and
their mixture-of-experts relatives Mixtral and Qwen3-MoE; pure functions; the MoE MLP mapping is
megarl.models.moe's), plus
`load_pretrained`, the HF-directory reader the learner and the built-in engine share.

Owns the mapping between the HF state dict exactly as ``Qwen2ForCausalLM`` / ``LlamaForCausalLM``
``save_pretrained`` writes it (the weights' interchange format, docs/CONTRACTS.md) and the state
dict of a megatron-core ``GPTModel`` built with the local layer spec
(``get_gpt_layer_local_spec(normalization="RMSNorm")``), plus the ``TransformerConfig`` arguments
that make that GPTModel compute the same function.

All tensors are full (unsharded, TP=1 names); sharding for TP>1 is the learner's business, except that
``mcore_layer_to_hf(..., tp_size)`` also converts one TP rank's layer shard to its HF slices.
``hf_config`` may be a transformers config object or the dict from ``config.json``.

Layout facts the conversion encodes:
  * megatron's ``linear_qkv`` rows are grouped per query group g (GQA): [the q heads of group g,
    the k head of g, the v head of g], each head ``head_dim`` rows; the bias follows the weight.
  * megatron's ``linear_fc1`` is the fused SwiGLU input projection: rows = cat[gate, up].
  * tied embeddings: megatron has no ``output_layer.weight`` and HF has no ``lm_head.weight``.
  * Qwen3's and Qwen3-MoE's per-head q/k RMSNorm (``self_attn.q_norm`` / ``k_norm``) is megatron's ``qk_layernorm``
    (``self_attention.q_layernorm`` / ``k_layernorm``).
"""
from __future__ import annotations

import json
import os

import torch

from megarl.models import moe
from megarl.models.families import ARCHITECTURES, MODEL_TYPES, family_of

SUPPORTED_MODEL_TYPES = MODEL_TYPES


def _config_dict(hf_config) -> dict:
    return hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)


def _rope_params(cfg: dict) -> dict:
    # transformers >= 5 keeps rope settings in `rope_parameters`; older configs use
    # `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    params.setdefault("rope_type", "default")
    scaling = dict(cfg.get("rope_scaling") or {})
    scaling_type = scaling.get("rope_type", scaling.get("type", "default"))
    if params["rope_type"] == "default" and scaling_type != "default":  # whichever field names a scaling
        params.update(scaling, rope_type=scaling_type)
    return params


def _rope_theta(cfg: dict) -> float:
    return float(_rope_params(cfg).get("rope_theta", cfg.get("rope_theta", 10000.0)))


# megatron-core 0.16 implements Llama-3 RoPE scaling with these three constants fixed
# (RotaryEmbedding._apply_scaling); only `factor` is a GPTModel argument.
MEGATRON_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_scaling(hf_config) -> dict | None:
    """The RoPE scaling megarl maps, as {"rope_type", "factor", ...}; None when RoPE is unscaled.

    Supported: "linear" (positions divided by `factor`) and "llama3" (HF's Llama 3.x frequency
    scaling, with the constants megatron-core hard-codes). Anything else raises ValueError by name:
    "dynamic" NTK scaling depends on the running sequence length and "yarn"/"longrope" also rescale
    attention, which megatron's GPTModel rotary embedding does not do.
    """
    params = _rope_params(_config_dict(hf_config))
    kind = params["rope_type"]
    if kind == "default":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(params["factor"])}
    if kind == "llama3":
        fixed = {k: float(params[k]) for k in MEGATRON_LLAMA3_FIXED}
        if fixed != MEGATRON_LLAMA3_FIXED:
            raise ValueError(f"unsupported llama3 rope scaling {fixed}: megatron-core fixes {MEGATRON_LLAMA3_FIXED}")
        return {"rope_type": "llama3", "factor": float(params["factor"]), **fixed}
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """RoPE inverse frequencies after `rope_scaling(...)`'s scaling (HF's definition), for engines
    that build their own rotary tables."""
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths divided by factor, short ones kept, a smooth ramp in between.
    old_len = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * torch.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def check_supported(hf_config) -> dict:
    """The config as a dict, or ValueError naming the architecture/feature that is not supported."""
    cfg = _config_dict(hf_config)
    if moe.is_moe(cfg):
        moe.check_moe(cfg)
    family_of(cfg)
    for arch in cfg.get("architectures") or ():
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} (only silu/SwiGLU)")
    if cfg.get("use_sliding_window"):
        raise ValueError("unsupported feature use_sliding_window=True")
    if cfg.get("attention_bias"):  # Llama: bias on q/k/v AND o_proj; megatron maps only qkv bias
        raise ValueError("unsupported feature attention_bias=True (o_proj bias)")
    if cfg.get("mlp_bias"):
        raise ValueError("unsupported feature mlp_bias=True")
    rope_scaling(cfg)
    return cfg


def _dims(cfg: dict) -> tuple[int, int, int, int]:
    """(layers, query heads, kv groups, head_dim)."""
    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"], heads, groups, head_dim


def _has_qkv_bias(cfg: dict) -> bool:
    return family_of(cfg).qkv_bias  # (a Llama with attention_bias=True is refused: its o_proj has one too)


def _has_qk_norm(cfg: dict) -> bool:
    return family_of(cfg).qk_norm


def layer_spec_kwargs(hf_config) -> dict:
    """Keyword arguments for megatron's ``get_gpt_layer_local_spec`` of this model."""
    cfg = check_supported(hf_config)
    kwargs = dict(normalization="RMSNorm", qk_layernorm=_has_qk_norm(cfg))
    if moe.is_moe(cfg):
        kwargs.update(num_experts=moe.num_experts(cfg), moe_grouped_gemm=False)
    return kwargs


def _tied(cfg: dict) -> bool:
    return bool(cfg.get("tie_word_embeddings", False))


def transformer_config_kwargs(hf_config) -> dict:
    """Keyword arguments for megatron's ``TransformerConfig`` matching the HF model's function.

    Parallelism, dtype and initialisation arguments are the caller's; GPTModel arguments
    (vocab size, max length, rope base, tying) come from ``gpt_model_kwargs``.
    """
    cfg = check_supported(hf_config)
    layers, heads, groups, head_dim = _dims(cfg)
    return dict(
        num_layers=layers,
        hidden_size=cfg["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        ffn_hidden_size=cfg["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=cfg["rms_norm_eps"],
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=_has_qkv_bias(cfg),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # HF computes softmax in fp32 and RoPE in fp32; keep megatron on the same footing.
        attention_softmax_in_fp32=True,
        qk_layernorm=_has_qk_norm(cfg),
        **moe.transformer_config_kwargs(cfg),
    )


def gpt_model_kwargs(hf_config) -> dict:
    """Keyword arguments for megatron's ``GPTModel`` (besides config / layer spec / pre/post_process)."""
    cfg = check_supported(hf_config)
    return dict(
        vocab_size=cfg["vocab_size"],
        max_sequence_length=cfg.get("max_position_embeddings", 4096),
        position_embedding_type="rope",
        rotary_base=_rope_theta(cfg),
        share_embeddings_and_output_weights=_tied(cfg),
        **_megatron_rope_scaling(rope_scaling(cfg)),
    )


def _megatron_rope_scaling(scaling: dict | None) -> dict:
    if scaling is None:
        return {}
    if scaling["rope_type"] == "linear":  # megatron divides the positions, HF the frequencies: same angles
        return {"seq_len_interpolation_factor": scaling["factor"]}
    return {"rope_scaling": True, "rope_scaling_factor": scaling["factor"]}


def hf_to_mcore(hf_state: dict, hf_config) -> dict:
    """HF state dict (save_pretrained names) -> full megatron GPTModel state dict (TP=1 names)."""
    cfg = check_supported(hf_config)
    layers, heads, groups, head_dim = _dims(cfg)
    q_per_group = heads // groups
    out = {"embedding.word_embeddings.weight": hf_state["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf_state["model.norm.weight"]}
    if not _tied(cfg):
        out["output_layer.weight"] = hf_state["lm_head.weight"]

    def pack_qkv(q, k, v):
        # [heads*d, ...], [groups*d, ...] -> [groups, (q_per_group + 2) * d, ...] -> flat rows
        rest = q.shape[1:]
        q = q.reshape(groups, q_per_group * head_dim, *rest)
        k = k.reshape(groups, head_dim, *rest)
        v = v.reshape(groups, head_dim, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)

    for i in range(layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[mc + "input_layernorm.weight"] = hf_state[hf + "input_layernorm.weight"]
        out[mc + "pre_mlp_layernorm.weight"] = hf_state[hf + "post_attention_layernorm.weight"]
        out[mc + "self_attention.linear_proj.weight"] = hf_state[hf + "self_attn.o_proj.weight"]
        for kind in ("weight", "bias") if _has_qkv_bias(cfg) else ("weight",):
            out[mc + f"self_attention.linear_qkv.{kind}"] = pack_qkv(
                *(hf_state[hf + f"self_attn.{p}_proj.{kind}"] for p in "qkv"))
        if _has_qk_norm(cfg):
            out[mc + "self_attention.q_layernorm.weight"] = hf_state[hf + "self_attn.q_norm.weight"]
            out[mc + "self_attention.k_layernorm.weight"] = hf_state[hf + "self_attn.k_norm.weight"]
        if moe.is_moe(cfg):
            out.update({mc + k: v for k, v in moe.mlp_hf_to_mcore(hf_state, cfg, i).items()})
            continue
        out[mc + "mlp.linear_fc1.weight"] = torch.cat(
            [hf_state[hf + "mlp.gate_proj.weight"], hf_state[hf + "mlp.up_proj.weight"]], dim=0)
        out[mc + "mlp.linear_fc2.weight"] = hf_state[hf + "mlp.down_proj.weight"]
    return out


def mcore_layer_to_hf(mcore_layer: dict, hf_layer_index: int, hf_config, tp_size: int = 1,
                      expert_offset: int = 0) -> dict:
    """One decoder layer: megatron names relative to the layer (``self_attention.linear_qkv.weight``)
    -> HF names with the given global layer index.  Used by PP stages that hold only some layers.

    With ``tp_size`` > 1 the layer is ONE TP rank's megatron shard and the result is that rank's HF
    slices (megarl.models.tp_shard's layout): the local ``linear_qkv`` holds whole query groups, so it
    unpacks like the full one with groups / tp_size groups; the local ``linear_fc1`` is [gate_r; up_r];
    the row-parallel ``linear_proj`` / ``linear_fc2`` shards are already HF's column slices.

    MoE layers convert the experts the layer holds (megarl.models.moe.mlp_mcore_to_hf; ``expert_offset``:
    the global index of an EP rank's first local expert)."""
    cfg = check_supported(hf_config)
    hf = f"model.layers.{hf_layer_index}."
    out = {
        hf + "input_layernorm.weight": mcore_layer["input_layernorm.weight"],
        hf + "post_attention_layernorm.weight": mcore_layer["pre_mlp_layernorm.weight"],
    }
    for kind in ("weight", "bias") if _has_qkv_bias(cfg) else ("weight",):
        q, k, v = split_qkv_rows(mcore_layer[f"self_attention.linear_qkv.{kind}"], cfg, tp_size)
        out[hf + f"self_attn.q_proj.{kind}"] = q
        out[hf + f"self_attn.k_proj.{kind}"] = k
        out[hf + f"self_attn.v_proj.{kind}"] = v
    out[hf + "self_attn.o_proj.weight"] = mcore_layer["self_attention.linear_proj.weight"]
    if _has_qk_norm(cfg):
        out[hf + "self_attn.q_norm.weight"] = mcore_layer["self_attention.q_layernorm.weight"]
        out[hf + "self_attn.k_norm.weight"] = mcore_layer["self_attention.k_layernorm.weight"]
    if moe.is_moe(cfg):
        out.update(moe.mlp_mcore_to_hf(mcore_layer, cfg, hf_layer_index, expert_offset))
        return out
    gate, up = mcore_layer["mlp.linear_fc1.weight"].chunk(2, dim=0)
    out[hf + "mlp.gate_proj.weight"] = gate.contiguous()
    out[hf + "mlp.up_proj.weight"] = up.contiguous()
    out[hf + "mlp.down_proj.weight"] = mcore_layer["mlp.linear_fc2.weight"]
    return out


def split_qkv_rows(qkv: torch.Tensor, hf_config, tp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's fused linear_qkv rows (grouped per query group: that group's q heads, its k, its v) ->
    HF's q_proj, k_proj, v_proj rows; any trailing dims (a weight's columns, a LoRA B's rank) ride along.
    With tp_size > 1, `qkv` is one TP rank's shard (whole query groups)."""
    cfg = check_supported(hf_config)
    _, heads, groups, head_dim = _dims(cfg)
    q_per_group = heads // groups
    if groups % tp_size:
        raise ValueError(f"tensor parallel size {tp_size} does not divide num_key_value_heads={groups}")
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups // tp_size, (q_per_group + 2) * head_dim, *rest)
    q, k, v = grouped.split([q_per_group * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous()


def mcore_to_hf(mcore_state: dict, hf_config) -> dict:
    """Full megatron GPTModel state dict (TP=1 names) -> HF state dict (save_pretrained names).

    Keys the HF side does not have (``_extra_state``, rotary buffers) are ignored.
    """
    cfg = check_supported(hf_config)
    layers = _dims(cfg)[0]
    out = {"model.embed_tokens.weight": mcore_state["embedding.word_embeddings.weight"]}
    for i in range(layers):
        prefix = f"decoder.layers.{i}."
        layer = {k[len(prefix):]: v for k, v in mcore_state.items() if k.startswith(prefix)}
        out.update(mcore_layer_to_hf(layer, i, cfg))
    out["model.norm.weight"] = mcore_state["decoder.final_layernorm.weight"]
    if not _tied(cfg):
        out["lm_head.weight"] = mcore_state["output_layer.weight"]
    return out


# The weights load_pretrained reads: one file, or an index of shards.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def has_weights(model_dir) -> bool:
    return any(os.path.isfile(os.path.join(model_dir, name)) for name in WEIGHT_FILES)


def read_config(model_dir, where: str) -> dict:
    """model_dir's config.json as a dict; ValueError '{where}: config.json does not load: ...' otherwise."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: config.json does not load: {exc}") from exc


def load_pretrained(model_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, HF-named weights) from an HF model directory (single or sharded safetensors)."""
    from safetensors.torch import load_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return cfg, load_file(single)
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(os.path.join(model_dir, shard)))
    return cfg, weights
