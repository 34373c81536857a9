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
    # config.json's `sliding_window` (null: none) limits every layer's attention to the keys of the last
    # `sliding_window` positions (Mistral); other families' field is refused or ignored as transformers does.
    sliding_window: bool = False
    # HF holds q/k/v as one `self_attn.qkv_proj` (rows: q, k, v) and gate/up as one `mlp.gate_up_proj` (rows: gate,
    # up) (Phi-3): megarl.models.convert splits and fuses them; the built-in engine and a direct shard publish run
    # them at tensor parallel size 1.
    fused_projections: bool = False
    # config.json's `no_rope_layers` (per layer 1: RoPE on q and k, 0: none) picks the layers that rotate (SmolLM3)
    no_rope_layers: bool = False
    # OLMo 2: no norm before attention or the MLP; an RMSNorm on each one's output before its residual add
    # (`post_attention_layernorm`, `post_feedforward_layernorm`), and q_norm / k_norm over the whole q / k projection
    # (every head's dims, [heads * head_dim]) instead of per head. The megatron learner computes them with
    # megarl.learner.post_norms, the built-in engine in its forward; a TP rank holds only its heads of q_norm /
    # k_norm, so whole tensors are published and the engine runs at sampler.tp = 1.
    post_norms: bool = False
    # GLM-4.5: config.json says whether q/k/v carry a bias (`attention_bias`; o_proj never does) and whether q and k
    # get a per-head RMSNorm (`use_qk_norm`), in place of the two flags above (families.qkv_bias / qk_norm)
    config_attention: bool = False
    # `partial_rotary_factor` < 1: RoPE rotates the first head_dim * factor dims of each head (GLM-4.5)
    partial_rotary: bool = False
    # Gemma 3 text: embeddings scaled by sqrt(hidden_size) in the weights' dtype; RMSNorms of (1 + weight); four
    # norms per layer (input, post_attention and post_feedforward on each block's output before its residual add,
    # pre_feedforward); per-head q/k norms; GeGLU (gelu tanh); a softmax scale of query_pre_attn_scalar^-0.5; local
    # (sliding-window) and global layers (`layer_types`), each kind with its own RoPE (`layer_rope`). The megatron
    # learner builds them with megarl.learner.gemma3, the built-in engine in its forward.
    gemma: bool = False
    # gpt-oss: a learned sink logit per head in every attention softmax (`self_attn.sinks`: megatron's
    # softmax_type='learnable'), sliding and full layers (`layer_types`, families.layer_windows), and a bias on
    # every linear (o_proj, the router, the experts) besides q/k/v
    gpt_oss_blocks: bool = False
    # DeepSeek-V3: multi-latent attention (q and k/v each from a low-rank latent with its own RMSNorm, per-head q/k of
    # qk_nope_head_dim + qk_rope_head_dim dims, v of v_head_dim; the k RoPE part shared by every head):
    # megatron-core's MLASelfAttention, mapped by megarl.models.latent_attention
    latent_attention: bool = False
    # Qwen3.5 text: gated-DeltaNet linear attention in the `layer_types` places "linear_attention" (megatron-core's
    # GatedDeltaNet, mapped by megarl.models.gated_delta_net), full attention elsewhere with an output gate (q_proj's
    # rows per head: [q_h | gate_h], megatron's attention_output_gate) and partial RoPE; RMSNorms of (1 + weight)
    # except the gated one. The megatron learner builds it with megarl.learner.hybrid, on unpacked rows.
    linear_attention: bool = False


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False, moe=False),
    Family("llama", "LlamaForCausalLM", qkv_bias=False, qk_norm=False, moe=False),
    Family("qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True, moe=False),
    Family("mistral", "MistralForCausalLM", qkv_bias=False, qk_norm=False, moe=False, sliding_window=True),
    Family("phi3", "Phi3ForCausalLM", qkv_bias=False, qk_norm=False, moe=False, sliding_window=True,
           fused_projections=True),
    Family("smollm3", "SmolLM3ForCausalLM", qkv_bias=False, qk_norm=False, moe=False, no_rope_layers=True),
    Family("olmo2", "Olmo2ForCausalLM", qkv_bias=False, qk_norm=True, moe=False, post_norms=True),
    Family("gemma3_text", "Gemma3ForCausalLM", qkv_bias=False, qk_norm=True, moe=False, gemma=True),
    Family("mixtral", "MixtralForCausalLM", qkv_bias=False, qk_norm=False, moe=True),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True, moe=True),
    Family("glm4_moe", "Glm4MoeForCausalLM", qkv_bias=False, qk_norm=False, moe=True, config_attention=True,
           partial_rotary=True),
    Family("gpt_oss", "GptOssForCausalLM", qkv_bias=True, qk_norm=False, moe=True, gpt_oss_blocks=True),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", qkv_bias=False, qk_norm=False, moe=True, latent_attention=True),
)}
MODEL_TYPES = tuple(FAMILIES)
ARCHITECTURES = tuple(f.architecture for f in FAMILIES.values())
# Families only the megatron learner maps: the built-in engine samples them and the DeepSpeed learner trains them on
# the generic path (transformers' own modules: its per-slot recurrent state, unpacked rows), so they are no native
# family there (is_native) and the engine's and the sampler tests' parametrizations over FAMILIES leave them out.
LEARNER_FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("qwen3_5_text", "Qwen3_5ForCausalLM", qkv_bias=False, qk_norm=True, moe=False, partial_rotary=True,
           linear_attention=True),
)}
# transformers' layer kind of a gated-DeltaNet layer (`layer_types`)
LINEAR = "linear_attention"


def family_of(cfg: dict) -> Family:
    """The Family of a config dict (FAMILIES, or LEARNER_FAMILIES); ValueError naming the model types megarl takes,
    docs/models.md and the generic path."""
    model_type = cfg.get("model_type")
    if model_type in LEARNER_FAMILIES:
        return LEARNER_FAMILIES[model_type]
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {MODEL_TYPES + tuple(LEARNER_FAMILIES)}"
                         f"; {generic_path_hint()}")
    return FAMILIES[model_type]


def qkv_bias(cfg: dict) -> bool:
    """Whether the model's q/k/v projections carry a bias."""
    family = family_of(cfg)
    return bool(cfg.get("attention_bias", False)) if family.config_attention else family.qkv_bias


def qk_norm(cfg: dict) -> bool:
    """Whether the model's q and k get an RMSNorm before RoPE (per head, or OLMo 2's over the projection)."""
    family = family_of(cfg)
    return bool(cfg.get("use_qk_norm", False)) if family.config_attention else family.qk_norm


def is_native(cfg: dict) -> bool:
    """Whether the config's model_type is a row of FAMILIES (megarl's engine and learners map it themselves); any
    other transformers causal LM, LEARNER_FAMILIES' included, takes the generic path there
    (docs/models.md#the-generic-path)."""
    return cfg.get("model_type") in FAMILIES


def generic_path_hint() -> str:
    """What every refusal of a model type adds: where the families are listed and the path that takes the rest."""
    return ("the families megarl maps are listed in docs/models.md; any other transformers causal LM trains on the "
            "generic path: learner.backend=deepspeed (docs/models.md#the-generic-path)")


def whole_tensors_only(cfg: dict) -> str | None:
    """Why the family's megatron shards have no per-TP-rank HF slices (megarl.models.tp_shard), so its learner
    publishes whole tensors and (but for engine_tp_refusal's exception) the built-in engine runs it at sampler.tp = 1;
    None where they have."""
    family = FAMILIES.get(cfg.get("model_type"))
    if family is not None and family.fused_projections:
        return "fused qkv_proj / gate_up_proj"
    if family is not None and family.post_norms:
        return "q_norm / k_norm over the whole projection"
    if family is not None and family.latent_attention:
        return "multi-latent attention's latent projections"
    if cfg.get("model_type") in LEARNER_FAMILIES:
        return "hybrid layers (the built-in engine's generic path)"
    return None


def engine_tp_refusal(cfg: dict) -> str | None:
    """Why the built-in engine cannot cut the family's HF tensors into sampler.tp ranks' slices (megarl.models.tp_shard),
    so it runs at sampler.tp = 1; None where it can. Multi-latent attention's megatron shards have no HF slices
    (whole_tensors_only: its learner publishes whole tensors), but its HF tensors do: the engine cuts q_proj /
    q_b_proj and kv_b_proj by heads and o_proj by columns, and computes the latents (q_a_proj, kv_a_proj_with_mqa)
    whole on every rank."""
    family = FAMILIES.get(cfg.get("model_type"))
    if family is not None and family.latent_attention:
        return None
    return whole_tensors_only(cfg)


def sliding_window(cfg: dict) -> int | None:
    """How many positions back (the query's own included) every layer attends to, or None for full attention:
    transformers' sliding-window mask lets query position q see key position k when q - window < k <= q.
    (A family whose layers differ: layer_windows.)"""
    window = cfg.get("sliding_window") if family_of(cfg).sliding_window else None
    if window is not None and int(window) < 1:
        raise ValueError(f"sliding_window={window} must be >= 1 (or null for full attention)")
    return None if window is None else int(window)


def rope_layers(cfg: dict) -> tuple[bool, ...] | None:
    """Per decoder layer whether it applies RoPE to q and k, or None when every layer does. SmolLM3's
    `no_rope_layers` (1: rotates), or transformers' default for it: every `no_rope_layer_interval`-th layer
    (the 4th, 8th, ...) without."""
    if not family_of(cfg).no_rope_layers:
        return None
    layers = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise ValueError(f"no_rope_layers={flags!r}: one 0 or 1 per layer (num_hidden_layers={layers})")
    return tuple(bool(f) for f in flags)


def generic_attention_windows(cfg: dict) -> dict[str, int | None] | None:
    """A generic-path model's sliding windows by transformers layer type ({"full_attention": None,
    "sliding_attention": w}) where its layers differ, {"": w} where every layer slides (a `sliding_window` and no
    `layer_types`), None where none does. transformers builds its masks itself, but takes a ready 4D mask -- one
    tensor, or a dict by layer type -- as it is: packed rows need the windows put in."""
    text = cfg.get("text_config") or cfg
    window, types = text.get("sliding_window"), text.get("layer_types")
    if not window or text.get("use_sliding_window") is False:
        return None
    if types:
        return {t: (int(window) if t == "sliding_attention" else None) for t in set(types)} \
            if "sliding_attention" in types else None
    return {"": int(window)}


def linear_attention_layers(cfg: dict) -> tuple[bool, ...] | None:
    """Per decoder layer whether it is gated-DeltaNet linear attention (config.json's `layer_types`, LINEAR), None
    for a family without such layers; ValueError naming a malformed `layer_types`."""
    if not family_of(cfg).linear_attention:
        return None
    layers, kinds = int(cfg["num_hidden_layers"]), cfg.get("layer_types")
    if kinds is None or len(kinds) != layers or any(k not in (LINEAR, FULL) for k in kinds):
        raise ValueError(f"layer_types={kinds!r}: one of {LINEAR!r}, {FULL!r} per layer "
                         f"(num_hidden_layers={layers})")
    return tuple(k == LINEAR for k in kinds)


# transformers' layer kinds (`layer_types`): local layers attend to a sliding window, global ones to every position
SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(cfg: dict) -> tuple[str, ...] | None:
    """Each decoder layer's kind (SLIDING or FULL) in a family whose layers differ (Gemma 3, gpt-oss), None for
    other families: config.json's `layer_types`, or transformers' default (Gemma 3: every `sliding_window_pattern`-th
    layer global, the rest local; gpt-oss: alternating, sliding first)."""
    family = family_of(cfg)
    if not (family.gemma or family.gpt_oss_blocks):
        return None
    layers = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types")
    if kinds is None and family.gemma:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        kinds = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    elif kinds is None:
        kinds = [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
    if len(kinds) != layers or any(k not in (SLIDING, FULL) for k in kinds):
        raise ValueError(f"layer_types={kinds!r}: one of {SLIDING!r}, {FULL!r} per layer "
                         f"(num_hidden_layers={layers})")
    return tuple(kinds)


def layer_window(cfg: dict) -> int | None:
    """The sliding window of the SLIDING layers of layer_types (transformers' mask: query q sees key k when
    q - window < k <= q), None for other families or a model without such layers."""
    kinds = layer_types(cfg)
    if not kinds or SLIDING not in kinds:
        return None
    window = cfg.get("sliding_window")
    if window is None or int(window) < 1:
        raise ValueError(f"sliding_window={window} must be >= 1 for the sliding_attention layers of layer_types")
    return int(window)


def layer_windows(cfg: dict) -> tuple[int | None, ...]:
    """Each decoder layer's sliding window (sliding_window's meaning; None: full attention): layer_window for the
    SLIDING layers of layer_types, every other family's one window for all layers."""
    kinds = layer_types(cfg)
    if kinds is None:
        return (sliding_window(cfg),) * int(cfg["num_hidden_layers"])
    window = layer_window(cfg)
    return tuple(window if kind == SLIDING else None for kind in kinds)


def windows_by_layer_type(cfg: dict) -> dict[str, int | None]:
    """The windows of a native family's packed-row masks as transformers takes them ready: by layer type
    ({SLIDING: w, FULL: None}) where layer_types differ, else {"": w} for every layer (w None: full attention)."""
    kinds = layer_types(cfg)
    if kinds is None:
        return {"": sliding_window(cfg)}
    return dict(zip(kinds, layer_windows(cfg)))


def mask_windows(cfg: dict) -> tuple[tuple[int | None, ...], tuple[int, ...] | None]:
    """The distinct windows of layer_windows (in layer order: one attention mask each) and each layer's index into
    them, None where every layer has the same window (megarl.learner.sdpa_attention.use_layer_windows)."""
    per_layer = layer_windows(cfg)
    windows = tuple(dict.fromkeys(per_layer))
    return windows, (tuple(windows.index(w) for w in per_layer) if len(windows) > 1 else None)


def layer_rope(cfg: dict, kind: str) -> dict:
    """A Gemma 3 layer kind's RoPE as a flat `rope_parameters` dict ({"rope_type", "rope_theta", ...}):
    config.json's `rope_parameters` by layer kind, or the older fields (global: `rope_theta` and `rope_scaling`;
    local: `rope_local_base_freq`, unscaled) with transformers' defaults (1e6 global, 1e4 local)."""
    by_kind = cfg.get("rope_parameters") or {}
    if kind in by_kind:
        return {"rope_type": "default", **by_kind[kind]}
    if kind == FULL:
        scaling = cfg.get("rope_scaling") or {}
        if "type" in scaling and "rope_type" not in scaling:  # (transformers' Gemma 3 reads rope_type alone)
            raise ValueError(f"rope_scaling={scaling!r}: transformers' Gemma 3 ignores 'type' and runs unscaled; "
                             f"name the scaling 'rope_type' (or drop it)")
        return {"rope_type": "default", **scaling, "rope_theta": float(cfg.get("rope_theta") or 1e6)}
    return {"rope_type": "default", "rope_theta": float(cfg.get("rope_local_base_freq") or 1e4)}
