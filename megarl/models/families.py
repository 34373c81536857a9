"""The model families megarl trains and serves, one row each: what sets a family's decoder apart from the plain
pre-norm RoPE SwiGLU decoder that megarl.models.convert maps and megarl.sampler.model runs.

A family is admitted here only when its conversion is exact against transformers' own forward (tests/models,
tests/sampler, tests/learner parametrize over FAMILIES); every place that refuses a model type reads this table,
so a new family is a row (and, where it needs one, a mapping of its own beside megarl.models.moe).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures[0], the transformers class save_pretrained names
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2); o_proj never does
    qk_norm: bool  # a per-head RMSNorm on q and on k before RoPE (Qwen3): megatron's qk_layernorm
    moe: bool  # every decoder layer's MLP is a routed mixture of experts (megarl.models.moe)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False, moe=False),
    Family("llama", "LlamaForCausalLM", qkv_bias=False, qk_norm=False, moe=False),
    Family("qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True, moe=False),
    Family("mixtral", "MixtralForCausalLM", qkv_bias=False, qk_norm=False, moe=True),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True, moe=True),
)}
MODEL_TYPES = tuple(FAMILIES)
ARCHITECTURES = tuple(f.architecture for f in FAMILIES.values())


def family_of(cfg: dict) -> Family:
    """The Family of a config dict; ValueError naming the model types megarl takes."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {MODEL_TYPES}")
    return FAMILIES[model_type]


def is_native(cfg: dict) -> bool:
    """Whether the config's model_type is a row above (megarl maps it itself); any other transformers causal LM
    takes the generic path (docs/models.md#the-generic-path)."""
    return cfg.get("model_type") in FAMILIES


def generic_path_hint() -> str:
    """What every refusal of a model type adds: where the families are listed and the path that takes the rest."""
    return ("the families megarl maps are listed in docs/models.md; any other transformers causal LM trains on the "
            "generic path: learner.backend=deepspeed (docs/models.md#the-generic-path)")
