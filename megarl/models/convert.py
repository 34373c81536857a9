"""HF <-> megatron-core weight conversion for the causal LMs of megarl.models.families (Qwen2, Llama, Qwen3,
Mistral, Phi-3, SmolLM3, OLMo 2, Gemma 3 and the mixture-of-experts Mixtral, Qwen3-MoE, GLM-4.5, gpt-oss and
DeepSeek-V3; pure functions; the MoE MLP mapping is megarl.models.moe's, DeepSeek-V3's multi-latent attention
megarl.models.latent_attention's), plus
`load_pretrained`, the HF-directory reader the learner and the built-in engine share. Which configs it takes
(`check_supported`) and the config fields it reads (RoPE scaling, dimensions) are megarl.models.support's, which
imports no torch.

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
  * megatron's ``linear_fc1`` is the fused SwiGLU input projection: rows = cat[gate, up] (Phi-3's
    ``gate_up_proj`` exactly; its ``qkv_proj`` rows are [all q heads, all k heads, all v heads], regrouped).
  * tied embeddings: megatron has no ``output_layer.weight`` and HF has no ``lm_head.weight``.
  * SmolLM3's layers without RoPE (``no_rope_layers``) have the same weights: the learner skips their rotation
    (megarl.learner.rotary_positions.skip_layers).
  * Mistral's sliding window is no weight: the learners put it in the attention mask (megarl.learner.packing).
  * Qwen3's and Qwen3-MoE's per-head q/k RMSNorm (``self_attn.q_norm`` / ``k_norm``) is megatron's ``qk_layernorm``
    (``self_attention.q_layernorm`` / ``k_layernorm``); OLMo 2's, over the whole projection, is the same weight in
    megarl.learner.post_norms' norm, and its norms after attention and the MLP are held by the layer's
    bias-dropout-adds (``POST_NORMS``); it has no input or pre-MLP norm.
  * Gemma 3's four norms per layer are ``input_layernorm``, ``pre_mlp_layernorm`` and the bias-dropout-adds' norms
    after attention and the MLP (``GEMMA_NORMS``), its q/k norms per head as Qwen3's; every weight keeps HF's value
    (the norms compute ``(1 + weight)``, the embedding's scale is no weight: megarl.learner.gemma3). Its local and
    global layers differ in their mask and RoPE only: the global layers' RoPE is the model's (`inv_freq`), the local
    ones' `local_inv_freq`.
  * GLM-4.5's partial RoPE (``partial_rotary_factor``: the first head_dim * factor dims of each head rotate,
    rotate-half style, the rest pass) is megatron's ``rotary_percent``; its ``attention_bias`` is a q/k/v bias only
    (o_proj has none) and ``use_qk_norm`` its per-head q/k RMSNorm (families.qkv_bias / qk_norm).
  * gpt-oss: every linear has a bias (megatron's ``add_bias_linear``: q/k/v, ``o_proj`` = ``linear_proj.bias``, the
    router's, the experts'); ``self_attn.sinks`` is the core attention's ``softmax_offset`` (megarl.learner.
    sdpa_attention); its experts' clamped SwiGLU, ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with
    ``g = min(gate, l)``, is megatron's GLU with ``activation_func_clamp_value`` l, ``glu_linear_offset`` 1 and
    ``gpt_oss_gate``; its router (logits with a bias, top-k, softmax over the k) is megatron's softmax router; the
    experts' fused layout is megarl.models.moe's; its sliding and full layers' windows are masks
    (families.layer_windows).
  * Qwen3.5 text (families' ``linear_attention``): a gated-DeltaNet layer's ``linear_attn.*`` is megatron
    GatedDeltaNet's ``self_attention.*`` (megarl.models.gated_delta_net); a full-attention layer's q_proj rows are
    [q_h | gate_h] per head, megatron's gated linear_qkv rows per query group [its q heads | their gates | k | v]
    (``attention_output_gate``); its partial RoPE is ``rotary_percent``; every norm but the gated one computes
    ``(1 + weight)`` (megarl.learner.hybrid) on HF's weights as they are.
  * DeepSeek-V3's multi-latent attention is megatron's MLASelfAttention (``MLATransformerConfig``); its RoPE
    dims are ``qk_rope_head_dim`` (what `_dims` calls head_dim, as transformers' config does).
"""
from __future__ import annotations

import functools
import json
import math
import os

import torch

from megarl.models import families, gated_delta_net, latent_attention, moe, mxfp4
from megarl.models.families import MODEL_TYPES, family_of
# (what the conversion takes is decided from config.json without torch; the names stay importable from here)
from megarl.models.support import (_dims, _rope_theta, check_supported, has_weights, layer_config,  # noqa: F401
                                   rope_attention_factor, rope_scaling, rotary_fraction)

SUPPORTED_MODEL_TYPES = MODEL_TYPES


def rope_inv_freq(theta: float, head_dim: int, scaling: dict | None) -> torch.Tensor:
    """RoPE's inverse frequencies [head_dim / 2] (fp32) after `rope_scaling(...)`'s scaling, computed as
    transformers' rope init functions compute them: what the learner's rotary embedding and the engine's rotary
    tables are built from."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] == "llama3":
        # long wavelengths divided by factor, short ones kept, a smooth ramp in between
        old_len = scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    # yarn: dimensions rotating fewer than beta_slow times over the original context are interpolated (divided by
    # factor), those rotating more than beta_fast times kept, a linear ramp between
    pos_freqs = theta ** exponents
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation: transformers' gelu_pytorch_tanh (a module-level function, so configs pickle)."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def _rope_config(cfg: dict) -> dict:
    """The config whose RoPE the model's rotary embedding computes: a Gemma 3's global layers', or the config."""
    return layer_config(cfg, families.FULL) if family_of(cfg).gemma else cfg


def gpt_oss_gate(x: torch.Tensor, alpha: float = 1.702) -> torch.Tensor:
    """gpt-oss's gate activation, x * sigmoid(alpha * x) (megatron's quick_gelu at alpha 1.702)."""
    return x * torch.sigmoid(alpha * x)


def _gpt_oss_kwargs(cfg: dict) -> dict:
    """TransformerConfig arguments where gpt-oss differs: biases everywhere, sinks, the clamped SwiGLU."""
    if not family_of(cfg).gpt_oss_blocks:
        return {}
    return dict(add_bias_linear=True, softmax_type="learnable", glu_linear_offset=1.0,
                activation_func=functools.partial(gpt_oss_gate, alpha=float(cfg.get("swiglu_alpha", 1.702))),
                activation_func_clamp_value=float(cfg.get("swiglu_limit", 7.0)))


def _has_qkv_bias(cfg: dict) -> bool:
    return families.qkv_bias(cfg)  # (a Llama with attention_bias=True is refused: its o_proj has one too)


def _has_qk_norm(cfg: dict) -> bool:
    return families.qk_norm(cfg)


def _qkv_kinds(cfg: dict) -> tuple[str, ...]:
    """The tensors of megatron's fused linear_qkv (none under multi-latent attention: latent_attention's)."""
    if family_of(cfg).latent_attention:
        return ()
    return ("weight", "bias") if _has_qkv_bias(cfg) else ("weight",)


def layer_spec_kwargs(hf_config) -> dict:
    """Keyword arguments for megatron's ``get_gpt_layer_local_spec`` of this model."""
    cfg = check_supported(hf_config)
    kwargs = dict(normalization="RMSNorm", qk_layernorm=_has_qk_norm(cfg))  # (Gemma 3's norms: megarl.learner.gemma3)
    if family_of(cfg).latent_attention:  # (its latent norms are the spec's q/kv layernorms)
        kwargs.update(multi_latent_attention=True, qk_layernorm=True)
    if moe.is_moe(cfg):
        kwargs.update(num_experts=moe.num_experts(cfg), moe_grouped_gemm=False)
    return kwargs


def _tied(cfg: dict) -> bool:
    return bool(cfg.get("tie_word_embeddings", False))


def transformer_config_kwargs(hf_config) -> dict:
    """Keyword arguments for megatron's ``TransformerConfig`` matching the HF model's function.

    Parallelism, dtype and initialisation arguments are the caller's; GPTModel arguments
    (vocab size, max length, rope base, tying) come from ``gpt_model_kwargs``. A latent-attention model's include
    ``multi_latent_attention=True``: they are ``MLATransformerConfig``'s.
    """
    cfg = check_supported(hf_config)
    layers, heads, groups, head_dim = _dims(cfg)
    gemma = family_of(cfg).gemma
    # Gemma 3 scales q.k by query_pre_attn_scalar^-0.5 (not head_dim's), its RoPE scalings have no attention factor
    scale = (float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5 if gemma
             else rope_attention_factor(rope_scaling(cfg)) ** 2 / math.sqrt(head_dim))
    kwargs = dict(
        num_layers=layers,
        hidden_size=cfg["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        ffn_hidden_size=cfg["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=cfg["rms_norm_eps"],
        gated_linear_unit=True,
        activation_func=gelu_tanh if gemma else torch.nn.functional.silu,  # (Gemma 3: GeGLU)
        add_bias_linear=False,
        add_qkv_bias=_has_qkv_bias(cfg),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # HF computes softmax in fp32 and RoPE in fp32; keep megatron on the same footing.
        attention_softmax_in_fp32=True,
        # (megatron sums q/k_layernorm gradients over TP when this is set, as per-head norms are replicated there;
        # OLMo 2's are split by heads, each rank's gradient its own: megarl.learner.post_norms builds them)
        qk_layernorm=_has_qk_norm(cfg) and not family_of(cfg).post_norms,
        # yarn's attention factor m scales RoPE's cos and sin in transformers, so every q.k by m^2: the same
        # scores as megatron's softmax scale times m^2
        softmax_scale=scale,
        **moe.transformer_config_kwargs(cfg),
    ) | _gpt_oss_kwargs(cfg)
    if family_of(cfg).latent_attention:  # (megatron's MLA sets its own softmax scale: latent_attention's doc)
        kwargs.update(latent_attention.transformer_config_kwargs(cfg, rope_scaling(cfg), _rope_theta(cfg)),
                      softmax_scale=None)
    if family_of(cfg).linear_attention:  # Qwen3.5: gated DeltaNet where layer_types says, gated full attention
        kwargs.update(gated_delta_net.transformer_config_kwargs(cfg, families.linear_attention_layers(cfg)),
                      attention_output_gate=True)
    return kwargs


def gpt_model_kwargs(hf_config) -> dict:
    """Keyword arguments for megatron's ``GPTModel`` (besides config / layer spec / pre/post_process); its rotary
    frequencies are then set to `inv_freq`'s."""
    cfg = check_supported(hf_config)
    return dict(
        vocab_size=cfg["vocab_size"],
        max_sequence_length=cfg.get("max_position_embeddings", 4096),
        position_embedding_type="rope",
        rotary_base=_rope_theta(_rope_config(cfg)),
        rotary_percent=rotary_fraction(cfg),
        share_embeddings_and_output_weights=_tied(cfg),
    )


def inv_freq(hf_config) -> torch.Tensor:
    """The model's RoPE inverse frequencies (`rope_inv_freq`): what the learner sets its GPTModel's rotary
    embedding to (megarl.learner.rotary_positions.use_frequencies), since megatron's own knows only linear and
    fixed-constant llama3 scalings. A Gemma 3's global layers'; its local layers' are `local_inv_freq`'s."""
    cfg = check_supported(hf_config)
    rope = _rope_config(cfg)
    return rope_inv_freq(_rope_theta(rope), int(_dims(cfg)[3] * rotary_fraction(cfg)), rope_scaling(rope))


def local_inv_freq(hf_config) -> torch.Tensor:
    """A Gemma 3's local (sliding-window) layers' RoPE inverse frequencies, as `inv_freq`."""
    local = layer_config(check_supported(hf_config), families.SLIDING)
    return rope_inv_freq(_rope_theta(local), _dims(local)[3], rope_scaling(local))


# Gemma 3's four norms per layer (HF name -> the megatron layer's): the ones after attention and the MLP are held by
# the layer's bias-dropout-adds, as OLMo 2's (megarl.learner.gemma3)
GEMMA_NORMS = {"input_layernorm": "input_layernorm.weight",
               "post_attention_layernorm": "self_attn_bda.norm.weight",
               "pre_feedforward_layernorm": "pre_mlp_layernorm.weight",
               "post_feedforward_layernorm": "mlp_bda.norm.weight"}


# OLMo 2's norms after attention and the MLP (HF name -> the megatron layer's): megarl.learner.post_norms holds
# each in the bias-dropout-add that adds its block's output to the residual.
POST_NORMS = {"post_attention_layernorm": "self_attn_bda.norm.weight",
              "post_feedforward_layernorm": "mlp_bda.norm.weight"}


# gpt-oss's attention tensors besides q/k/v (HF name relative to the layer -> the megatron layer's)
GPT_OSS_ATTENTION = {"self_attn.o_proj.bias": "self_attention.linear_proj.bias",
                     "self_attn.sinks": "self_attention.core_attention.softmax_offset"}


def hf_to_mcore(hf_state: dict, hf_config) -> dict:
    """HF state dict (save_pretrained names) -> full megatron GPTModel state dict (TP=1 names)."""
    cfg = check_supported(hf_config)
    layers, heads, groups, head_dim = _dims(cfg)
    q_per_group = heads // groups
    fused = family_of(cfg).fused_projections
    out = {"embedding.word_embeddings.weight": hf_state["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf_state["model.norm.weight"]}
    if not _tied(cfg):
        out["output_layer.weight"] = hf_state["lm_head.weight"]

    linear = families.linear_attention_layers(cfg)

    def pack_qkv(q, k, v):
        # [heads*d, ...], [groups*d, ...] -> [groups, (q_per_group + 2) * d, ...] -> flat rows
        rest = q.shape[1:]
        if linear is not None:  # Qwen3.5's q_proj: [q_h | gate_h] per head -> the group's [q heads | their gates]
            q = q.reshape(groups, q_per_group, 2, head_dim, *rest).transpose(1, 2)
        q = q.reshape(groups, -1, *rest)
        k = k.reshape(groups, head_dim, *rest)
        v = v.reshape(groups, head_dim, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)

    for i in range(layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        if family_of(cfg).gemma:
            out.update({mc + m: hf_state[hf + h + ".weight"] for h, m in GEMMA_NORMS.items()})
        elif family_of(cfg).post_norms:
            out.update({mc + m: hf_state[hf + h + ".weight"] for h, m in POST_NORMS.items()})
        else:
            out[mc + "input_layernorm.weight"] = hf_state[hf + "input_layernorm.weight"]
            out[mc + "pre_mlp_layernorm.weight"] = hf_state[hf + "post_attention_layernorm.weight"]
        if linear is not None and linear[i]:  # (a gated-DeltaNet layer: no q/k/v, no q/k norms)
            own = {k[len(hf + "linear_attn."):]: v for k, v in hf_state.items() if k.startswith(hf + "linear_attn.")}
            out.update({mc + "self_attention." + k: v for k, v in gated_delta_net.hf_to_mcore(own).items()})
            out[mc + "mlp.linear_fc1.weight"] = torch.cat(
                [hf_state[hf + "mlp.gate_proj.weight"], hf_state[hf + "mlp.up_proj.weight"]], dim=0)
            out[mc + "mlp.linear_fc2.weight"] = hf_state[hf + "mlp.down_proj.weight"]
            continue
        if family_of(cfg).latent_attention:
            out.update({mc + k: v for k, v in latent_attention.hf_to_mcore(hf_state, cfg, i).items()})
        else:
            out[mc + "self_attention.linear_proj.weight"] = hf_state[hf + "self_attn.o_proj.weight"]
        if family_of(cfg).gpt_oss_blocks:
            out.update({mc + m: hf_state[hf + h] for h, m in GPT_OSS_ATTENTION.items()})
        for kind in _qkv_kinds(cfg):
            if fused:  # Phi-3: one qkv_proj, rows [q heads, k heads, v heads]
                qkv = hf_state[hf + f"self_attn.qkv_proj.{kind}"].split(
                    [heads * head_dim, groups * head_dim, groups * head_dim])
            else:
                qkv = [hf_state[hf + f"self_attn.{p}_proj.{kind}"] for p in "qkv"]
            out[mc + f"self_attention.linear_qkv.{kind}"] = pack_qkv(*qkv)
        if _has_qk_norm(cfg):
            out[mc + "self_attention.q_layernorm.weight"] = hf_state[hf + "self_attn.q_norm.weight"]
            out[mc + "self_attention.k_layernorm.weight"] = hf_state[hf + "self_attn.k_norm.weight"]
        if moe.is_moe_layer(cfg, i):
            out.update({mc + k: v for k, v in moe.mlp_hf_to_mcore(hf_state, cfg, i).items()})
            continue
        out[mc + "mlp.linear_fc1.weight"] = (hf_state[hf + "mlp.gate_up_proj.weight"] if fused else torch.cat(
            [hf_state[hf + "mlp.gate_proj.weight"], hf_state[hf + "mlp.up_proj.weight"]], dim=0))
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
    fused = family_of(cfg).fused_projections
    whole = families.whole_tensors_only(cfg)
    if whole and tp_size > 1:
        raise ValueError(f"{cfg['model_type']}'s {whole} have no per-rank HF slices "
                         f"(megarl.models.tp_shard): convert the whole layer (tp_size=1)")
    hf = f"model.layers.{hf_layer_index}."
    if family_of(cfg).gemma:
        out = {hf + h + ".weight": mcore_layer[m] for h, m in GEMMA_NORMS.items()}
    elif family_of(cfg).post_norms:  # OLMo 2: the norms after attention and the MLP (megarl.learner.post_norms)
        out = {hf + "post_attention_layernorm.weight": mcore_layer[POST_NORMS["post_attention_layernorm"]],
               hf + "post_feedforward_layernorm.weight": mcore_layer[POST_NORMS["post_feedforward_layernorm"]]}
    else:
        out = {hf + "input_layernorm.weight": mcore_layer["input_layernorm.weight"],
               hf + "post_attention_layernorm.weight": mcore_layer["pre_mlp_layernorm.weight"]}
    linear = families.linear_attention_layers(cfg)
    if linear is not None and linear[hf_layer_index]:  # a gated-DeltaNet layer
        own = {k[len("self_attention."):]: v for k, v in mcore_layer.items() if k.startswith("self_attention.")
               and not k.endswith("_extra_state")}
        out.update({hf + "linear_attn." + k: v for k, v in gated_delta_net.mcore_to_hf(own, cfg).items()})
        gate, up = mcore_layer["mlp.linear_fc1.weight"].chunk(2, dim=0)
        out.update({hf + "mlp.gate_proj.weight": gate.contiguous(), hf + "mlp.up_proj.weight": up.contiguous(),
                    hf + "mlp.down_proj.weight": mcore_layer["mlp.linear_fc2.weight"]})
        return out
    for kind in _qkv_kinds(cfg):
        q, k, v = split_qkv_rows(mcore_layer[f"self_attention.linear_qkv.{kind}"], cfg, tp_size)
        if fused:  # Phi-3's layout, as save_pretrained writes it
            out[hf + f"self_attn.qkv_proj.{kind}"] = torch.cat([q, k, v])
            continue
        out[hf + f"self_attn.q_proj.{kind}"] = q
        out[hf + f"self_attn.k_proj.{kind}"] = k
        out[hf + f"self_attn.v_proj.{kind}"] = v
    if family_of(cfg).latent_attention:
        out.update(latent_attention.mcore_to_hf(mcore_layer, cfg, hf_layer_index))
    else:
        out[hf + "self_attn.o_proj.weight"] = mcore_layer["self_attention.linear_proj.weight"]
    if family_of(cfg).gpt_oss_blocks:
        out.update({hf + h: mcore_layer[m] for h, m in GPT_OSS_ATTENTION.items()})
    if _has_qk_norm(cfg):
        out[hf + "self_attn.q_norm.weight"] = mcore_layer["self_attention.q_layernorm.weight"]
        out[hf + "self_attn.k_norm.weight"] = mcore_layer["self_attention.k_layernorm.weight"]
    if moe.is_moe_layer(cfg, hf_layer_index):
        out.update(moe.mlp_mcore_to_hf(mcore_layer, cfg, hf_layer_index, expert_offset))
        return out
    if fused:  # megatron's linear_fc1 rows are [gate, up]: Phi-3's gate_up_proj as it is
        out[hf + "mlp.gate_up_proj.weight"] = mcore_layer["mlp.linear_fc1.weight"]
    else:
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
    gated = family_of(cfg).linear_attention  # (Qwen3.5: each group's q heads, then their output gates)
    q_rows = (2 if gated else 1) * q_per_group * head_dim
    grouped = qkv.reshape(groups // tp_size, q_rows + 2 * head_dim, *rest)
    q, k, v = grouped.split([q_rows, head_dim, head_dim], dim=1)
    if gated:  # -> HF's q_proj rows, [q_h | gate_h] per head
        q = q.reshape(groups // tp_size, 2, q_per_group, head_dim, *rest).transpose(1, 2)
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



def read_config(model_dir, where: str) -> dict:
    """model_dir's config.json as a dict; ValueError '{where}: config.json does not load: ...' otherwise."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: config.json does not load: {exc}") from exc


def load_pretrained(model_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, HF-named weights) from an HF model directory (single or sharded safetensors); an MXFP4
    checkpoint's packed tensors dequantized (megarl.models.mxfp4.dequantize_state)."""
    from safetensors.torch import load_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return cfg, mxfp4.dequantize_state(cfg, load_file(single))
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(os.path.join(model_dir, shard)))
    return cfg, mxfp4.dequantize_state(cfg, weights)
