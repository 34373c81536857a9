"""HF <-> megatron-core mapping of DeepSeek-V3's multi-latent attention (MLA; pure functions), and the megatron
``MLATransformerConfig`` arguments that make megatron's ``MLASelfAttention`` compute transformers' function.

Owns the attention half of a latent-attention family (megarl.models.families ``latent_attention``) in
megarl.models.convert. Per decoder layer i, HF (relative to ``model.layers.{i}.self_attn.``) -> megatron (relative
to ``decoder.layers.{i}.self_attention.``), every tensor as it is (the two layouts agree row for row):
  * ``q_proj`` (``q_lora_rank: null``) -> ``linear_q_proj``; else ``q_a_proj`` -> ``linear_q_down_proj``,
    ``q_a_layernorm`` -> ``q_layernorm``, ``q_b_proj`` -> ``linear_q_up_proj``. Rows: per head
    [qk_nope_head_dim, qk_rope_head_dim].
  * ``kv_a_proj_with_mqa`` -> ``linear_kv_down_proj`` (rows [kv_lora_rank latent, qk_rope_head_dim shared k RoPE
    part]); ``kv_a_layernorm`` -> ``kv_layernorm``; ``kv_b_proj`` -> ``linear_kv_up_proj`` (rows per head
    [qk_nope_head_dim k, v_head_dim v]); ``o_proj`` -> ``linear_proj``.

RoPE: transformers' ``rope_interleave: true`` (DeepSeek-V3's, Kimi-K2's) rotates the rope dims as interleaved pairs
and writes them back de-interleaved, which is megatron's MLA rotation (``multi_latent_attention``: x[0::2], x[1::2]
then rotate-half). The angles and the YaRN attention factor on cos / sin are transformers' (megarl.learner.
rotary_positions.use_latent_frequencies); the softmax scale is megatron's mscale(factor, mscale_all_dim)^2 /
sqrt(qk_nope + qk_rope), transformers' ``yarn_apply_mscale``.

Refused (ValueError naming the field): ``attention_bias: true`` (megatron's MLA projections have none),
``rope_interleave: false``, ``num_key_value_heads`` != ``num_attention_heads``.
"""
from __future__ import annotations

# (HF name, megatron name) under ``self_attn.`` / ``self_attention.``: always, and by q_lora_rank
_KV = (("kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight"), ("kv_a_layernorm.weight", "kv_layernorm.weight"),
       ("kv_b_proj.weight", "linear_kv_up_proj.weight"), ("o_proj.weight", "linear_proj.weight"))
_Q_LORA = (("q_a_proj.weight", "linear_q_down_proj.weight"), ("q_a_layernorm.weight", "q_layernorm.weight"),
           ("q_b_proj.weight", "linear_q_up_proj.weight"))
_Q_FULL = (("q_proj.weight", "linear_q_proj.weight"),)


def check(cfg: dict) -> None:
    """ValueError naming the field of a latent-attention config whose mapping would not be exact."""
    if cfg.get("attention_bias"):
        raise ValueError("unsupported feature attention_bias=True (megatron's multi-latent attention projections "
                         "carry no bias)")
    if cfg.get("rope_interleave", True) is False:
        raise ValueError("unsupported feature rope_interleave=False (megatron's multi-latent attention rotates "
                         "interleaved pairs, DeepSeek-V3's layout)")
    heads = int(cfg["num_attention_heads"])
    if int(cfg.get("num_key_value_heads") or heads) != heads:
        raise ValueError(f"num_key_value_heads={cfg['num_key_value_heads']} != num_attention_heads={heads} "
                         "(multi-latent attention expands every head's k and v from the latent)")


def rope_dim(cfg: dict) -> int:
    """The dims of each head RoPE rotates (transformers' head_dim of a DeepSeek-V3 config)."""
    return int(cfg["qk_rope_head_dim"])


def softmax_scale(cfg: dict, rope_scaling: dict | None) -> float:
    """The attention's softmax scale as transformers computes it (``yarn_apply_mscale``; `rope_scaling`:
    megarl.models.convert.rope_scaling of `cfg`): (qk_nope_head_dim + qk_rope_head_dim)^-0.5, times
    mscale(factor, mscale_all_dim)^2 under YaRN with a non-zero mscale_all_dim."""
    from megarl.models.support import _yarn_mscale  # (support imports this module for its check)

    scale = (int(cfg["qk_nope_head_dim"]) + rope_dim(cfg)) ** -0.5
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    if rope_scaling is not None and params.get("mscale_all_dim"):
        scale *= _yarn_mscale(rope_scaling["factor"], float(params["mscale_all_dim"])) ** 2
    return scale


def names(cfg: dict) -> tuple[tuple[str, str], ...]:
    """(HF name relative to ``self_attn.``, megatron name relative to ``self_attention.``) of every attention
    tensor of one layer."""
    return (_Q_FULL if cfg.get("q_lora_rank") is None else _Q_LORA) + _KV


def hf_to_mcore(hf_state: dict, cfg: dict, layer: int) -> dict:
    """One layer's attention: HF tensors -> megatron names relative to the layer."""
    return {f"self_attention.{m}": hf_state[f"model.layers.{layer}.self_attn.{h}"] for h, m in names(cfg)}


def mcore_to_hf(mcore_layer: dict, cfg: dict, layer: int) -> dict:
    """One layer's attention: megatron names relative to the layer -> HF names with the global layer index."""
    return {f"model.layers.{layer}.self_attn.{h}": mcore_layer[f"self_attention.{m}"] for h, m in names(cfg)}


def transformer_config_kwargs(cfg: dict, rope_scaling: dict | None, rope_theta: float) -> dict:
    """megatron MLATransformerConfig arguments of the attention (`rope_scaling`: megarl.models.convert.rope_scaling
    of `cfg`). megatron's own rotary tables are replaced by transformers' (rope_type yarn only makes megatron's MLA
    take an attention factor from its rotary embedding); rotary_scaling_factor and mscale_all_dim set its softmax
    scale."""
    check(cfg)
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    yarn = rope_scaling is not None and rope_scaling["rope_type"] == "yarn"
    if rope_scaling is not None and not yarn:
        raise ValueError(f"unsupported rope scaling {rope_scaling['rope_type']!r} with multi-latent attention "
                         "(default or yarn)")
    return dict(
        multi_latent_attention=True,
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_pos_emb_head_dim=rope_dim(cfg),
        v_head_dim=int(cfg["v_head_dim"]),
        kv_channels=int(cfg["v_head_dim"]),
        num_query_groups=int(cfg["num_attention_heads"]),
        # the latent RMSNorms (q_a_layernorm, kv_a_layernorm) are megatron's q_layernorm / kv_layernorm
        qk_layernorm=True,
        rope_type="yarn",
        rotary_base=rope_theta,
        rotary_scaling_factor=rope_scaling["factor"] if yarn else 1.0,
        original_max_position_embeddings=int(rope_scaling["original_max_position_embeddings"] if yarn
                                             else cfg.get("max_position_embeddings", 4096)),
        beta_fast=rope_scaling["beta_fast"] if yarn else 32.0,
        beta_slow=rope_scaling["beta_slow"] if yarn else 1.0,
        mscale=float(params.get("mscale") or 1.0) if yarn else 1.0,
        # (transformers folds mscale_all_dim into the softmax scale only when it is set and non-zero, as megatron)
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0) if yarn else 0.0,
    )
