"""Whether megarl maps an HF model, read from its config.json and file names alone: `check_supported` (the
families of megarl.models.families, the mixture-of-experts layouts of megarl.models.moe_config, RoPE scalings), the
config fields the conversion reads (RoPE parameters, dimensions) and whether a directory holds weights.

No torch: `megarl train` runs these checks before any worker starts, in a process that would otherwise import torch
for them alone (the ranks import it again). megarl.models.convert maps the weights of what passes here.
"""
from __future__ import annotations

import math
import os

from megarl.models import families, latent_attention, mxfp4
from megarl.models.families import family_of
from megarl.models.moe_config import check_moe, is_moe


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


def rope_scaling(hf_config) -> dict | None:
    """The RoPE scaling megarl maps, as {"rope_type", "factor", ...}; None when RoPE is unscaled.

    Supported, with transformers' definitions (its rope init functions, modeling_rope_utils): "linear" (positions
    divided by `factor`), "llama3" (Llama 3.x: long wavelengths divided by `factor`, a smooth ramp to the short
    ones) and "yarn" (frequencies blended between interpolated and extrapolated by a ramp over the dimensions, and
    cos/sin scaled by an attention factor). Anything else raises ValueError by name: "dynamic" NTK scaling depends
    on the running sequence length, "longrope" on it too (short/long factor sets).
    """
    cfg = _config_dict(hf_config)
    params = _rope_params(cfg)
    kind = params["rope_type"]
    if kind == "default":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(params["factor"])}
    if kind == "llama3":
        return {"rope_type": "llama3", **{k: float(params[k]) for k in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}}
    if kind == "yarn":
        original = float(params["original_max_position_embeddings"])
        # (DeepSeek-V3-style configs leave factor out: the context's growth is the factor)
        factor = float(params.get("factor") or cfg["max_position_embeddings"] / original)
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
            attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                                if mscale and mscale_all_dim else _yarn_mscale(factor))
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
                "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
                "truncate": bool(params.get("truncate", True)), "attention_factor": float(attention_factor)}
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, yarn)")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def check_supported(hf_config) -> dict:
    """The config as a dict, or ValueError naming the architecture/feature that is not supported."""
    cfg = _config_dict(hf_config)
    if is_moe(cfg):
        check_moe(cfg)
    family = family_of(cfg)
    if family.latent_attention:
        latent_attention.check(cfg)
    for arch in cfg.get("architectures") or ():
        if arch != family.architecture:
            raise ValueError(f"unsupported architecture {arch!r} for model_type {family.model_type!r} "
                             f"(megarl maps {family.architecture})")
    if cfg.get("hidden_act", "silu") != "silu" and not family.gemma:
        raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} (only silu/SwiGLU)")
    if cfg.get("use_sliding_window"):
        raise ValueError("unsupported feature use_sliding_window=True")
    families.sliding_window(cfg)  # (a window < 1: named)
    families.rope_layers(cfg)  # (a malformed no_rope_layers: named)
    families.layer_window(cfg)  # (Gemma 3's and gpt-oss's malformed layer_types, a missing window: named)
    families.linear_attention_layers(cfg)  # (Qwen3.5's malformed layer_types: named)
    if family.gpt_oss_blocks:
        _check_gpt_oss(cfg)
    if cfg.get("attention_bias") and not family.config_attention and not family.gpt_oss_blocks:  # Llama: o_proj too
        raise ValueError("unsupported feature attention_bias=True (o_proj bias)")
    if cfg.get("mlp_bias"):
        raise ValueError("unsupported feature mlp_bias=True")
    partial = rotary_fraction(cfg)
    if partial != 1.0 and not family.partial_rotary:
        raise ValueError(f"unsupported feature partial_rotary_factor={partial} (full rotary only)")
    if partial != 1.0 and (not 0 < partial < 1 or int(_dims(cfg)[3] * partial) % 2):
        raise ValueError(f"partial_rotary_factor={partial}: head_dim * factor must be an even number of dims")
    if family.gemma:
        _check_gemma(cfg)
    else:
        rope_scaling(cfg)
    return cfg


def _check_gemma(cfg: dict) -> None:
    """ValueError naming what megarl's Gemma 3 does not compute (megarl.learner.gemma3, the built-in engine)."""
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") not in GELU_TANH:
        raise ValueError(f"unsupported hidden_activation {cfg['hidden_activation']!r} (Gemma 3: {GELU_TANH})")
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention", "attention_bias"):
        if cfg.get(key):
            raise ValueError(f"unsupported feature {key}={cfg[key]!r} (Gemma 3 text as transformers' "
                             f"Gemma3ForCausalLM defaults it: null / false)")
    for kind in set(families.layer_types(cfg)):
        if rope_attention_factor(rope_scaling(layer_config(cfg, kind))) != 1.0:
            raise ValueError(f"rope_parameters[{kind!r}]: a RoPE scaling with an attention factor (yarn) differs by "
                             f"layer kind, which the one softmax scale of megarl's Gemma 3 does not take")


def _check_gpt_oss(cfg: dict) -> None:
    if cfg.get("quantization_config") and not mxfp4.is_mxfp4(cfg):
        raise ValueError(f"unsupported feature quantization_config={cfg['quantization_config'].get('quant_method')!r} "
                         "(megarl loads float weights, or MXFP4's dequantized: megarl.models.mxfp4)")
    if not cfg.get("attention_bias", True):
        raise ValueError("unsupported feature attention_bias=False for gpt_oss (megarl maps its biased linears)")


# transformers' names of the tanh-approximated GELU (Gemma 3's GeGLU activation)
GELU_TANH = ("gelu_pytorch_tanh", "gelu_python_tanh", "gelu_new", "gelu_fast")


def layer_config(cfg: dict, kind: str) -> dict:
    """A Gemma 3 config as one layer kind (families.SLIDING / FULL) sees it: that kind's RoPE as the model's."""
    return {**cfg, "rope_parameters": families.layer_rope(cfg, kind), "rope_scaling": None}


def rope_attention_factor(scaling: dict | None) -> float:
    """What transformers multiplies RoPE's cos and sin by (yarn's attention factor; 1 otherwise): every q.k
    product is scaled by its square."""
    return 1.0 if scaling is None else scaling.get("attention_factor", 1.0)


def rotary_fraction(cfg: dict) -> float:
    """The fraction of each head's dims RoPE rotates (the first ones; transformers' partial_rotary_factor)."""
    return float(_rope_params(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))


def _dims(cfg: dict) -> tuple[int, int, int, int]:
    """(layers, query heads, kv groups, head_dim; a latent-attention model's head_dim: its RoPE dims)."""
    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if family_of(cfg).latent_attention:
        head_dim = latent_attention.rope_dim(cfg)
    return cfg["num_hidden_layers"], heads, groups, head_dim


# The weights load_pretrained reads: one file, or an index of shards.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def has_weights(model_dir) -> bool:
    return any(os.path.isfile(os.path.join(model_dir, name)) for name in WEIGHT_FILES)
