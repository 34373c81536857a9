"""Reading a mixture-of-experts config.json (no torch): which MoE layouts megarl takes (`check_moe`), whether a
config is one (`is_moe`), its experts and top-k, and the field of one expert's width.

`megarl train` checks a model before any worker starts, in a process that imports no torch for it
(megarl.models.support); megarl.models.moe maps the weights and holds these names too.

Refused (ValueError naming the config field): Qwen2-MoE's gated shared expert
(``shared_expert_intermediate_size``: megatron's shared expert gate is not the same function in 0.16.1,
so the conversion would not be exact), Qwen3-MoE with dense layers among the sparse ones
(``decoder_sparse_step`` / ``mlp_only_layers``), Mixtral's training-time ``router_jitter_noise``; GLM-4.5 with
``norm_topk_prob: false`` (megatron's sigmoid router always renormalises the top k) or a group limit megatron scores
otherwise (it scores a group by its best ``top_k // topk_group`` experts, HF by its best two).
"""
from __future__ import annotations

from megarl.models.families import generic_path_hint

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "glm4_moe", "gpt_oss", "deepseek_v3")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM", "GptOssForCausalLM",
                     "DeepseekV3ForCausalLM")
# The sigmoid-routed MoEs with a fixed expert bias, shared experts and first dense layers (GLM-4.5's layout), and
# how many dense layers transformers gives each when its config leaves first_k_dense_replace out
SIGMOID_ROUTED = {"glm4_moe": 1, "deepseek_v3": 3}
# Model types that are mixtures of experts megarl names when it refuses them.
REFUSED_MOE_TYPES = {"qwen2_moe": "shared_expert_intermediate_size", "olmoe": "model_type",
                     "qwen3_next": "model_type"}


def is_moe(cfg: dict) -> bool:
    return cfg.get("model_type") in MOE_MODEL_TYPES or cfg.get("model_type") in REFUSED_MOE_TYPES


def fused_experts_on_disk(cfg: dict) -> bool:
    """Whether save_pretrained writes the model's experts fused, under the names transformers holds them by in
    memory (gpt-oss), rather than per expert."""
    return cfg.get("model_type") == "gpt_oss"


def check_moe(cfg: dict) -> None:
    """ValueError naming the field of an MoE config whose conversion megarl cannot make exact."""
    model_type = cfg.get("model_type")
    if model_type in REFUSED_MOE_TYPES:
        field = REFUSED_MOE_TYPES[model_type]
        why = ("a gated shared expert next to the routed ones, which megatron-core 0.16.1's shared expert does "
               "not compute identically" if model_type == "qwen2_moe" else "a layout megarl does not map")
        raise ValueError(f"unsupported MoE model {model_type!r} ({field}): {why}; supported MoE model types: "
                         f"{MOE_MODEL_TYPES}; {generic_path_hint()}")
    if model_type == "mixtral" and float(cfg.get("router_jitter_noise") or 0.0) != 0.0:
        raise ValueError(f"unsupported feature router_jitter_noise={cfg['router_jitter_noise']} (random router "
                         "noise: megatron routes deterministically)")
    if model_type == "mixtral" and cfg.get("sliding_window"):
        raise ValueError(f"unsupported feature sliding_window={cfg['sliding_window']}")
    if model_type == "qwen3_moe":
        if int(cfg.get("decoder_sparse_step", 1)) != 1:
            raise ValueError(f"unsupported feature decoder_sparse_step={cfg['decoder_sparse_step']} (dense layers "
                             "between MoE layers; megarl maps models whose every layer is MoE)")
        if cfg.get("mlp_only_layers"):
            raise ValueError(f"unsupported feature mlp_only_layers={cfg['mlp_only_layers']} (dense layers among "
                             "the MoE layers)")
    if model_type in SIGMOID_ROUTED:
        _check_glm4_moe(cfg)
    if num_experts(cfg) < 2 or not 1 <= top_k(cfg) <= num_experts(cfg):
        raise ValueError(f"MoE config needs num_experts >= 2 and 1 <= num_experts_per_tok <= num_experts "
                         f"(got {num_experts(cfg)}, {top_k(cfg)})")


def _check_glm4_moe(cfg: dict) -> None:
    if top_k(cfg) > 1 and not cfg.get("norm_topk_prob", True):
        raise ValueError("unsupported feature norm_topk_prob=False (megatron's sigmoid router renormalises the "
                         "top-k scores)")
    if int(cfg.get("n_shared_experts") or 0) < 1:
        raise ValueError(f"unsupported feature n_shared_experts={cfg.get('n_shared_experts')} (megarl maps GLM-4.5's "
                         "shared expert; >= 1)")
    groups, kept = _groups(cfg)
    if num_experts(cfg) % groups or not 1 <= kept <= groups:
        raise ValueError(f"n_group={groups} must divide n_routed_experts={num_experts(cfg)} and "
                         f"1 <= topk_group={kept} <= n_group")
    if kept < groups and (top_k(cfg) // kept != 2 or num_experts(cfg) // groups < 2):
        raise ValueError(f"unsupported feature topk_group={kept} < n_group={groups} with num_experts_per_tok="
                         f"{top_k(cfg)}: HF scores a group by its best 2 experts, megatron by its best "
                         f"num_experts_per_tok // topk_group")
    if first_dense_layers(cfg) >= int(cfg["num_hidden_layers"]):
        raise ValueError(f"first_k_dense_replace={first_dense_layers(cfg)} leaves no MoE layer "
                         f"(num_hidden_layers={cfg['num_hidden_layers']})")


def _groups(cfg: dict) -> tuple[int, int]:
    """(n_group, topk_group) of a group-limited router (1, 1: no limit)."""
    return int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)


def num_experts(cfg: dict) -> int:
    return int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)


def top_k(cfg: dict) -> int:
    return int(cfg.get("num_experts_per_tok") or 0)


def expert_ffn_field(cfg: dict) -> str:
    """The config field of one expert's width: Mixtral's experts use intermediate_size; Qwen3-MoE's
    moe_intermediate_size (its intermediate_size is for dense layers, which megarl refuses)."""
    return "moe_intermediate_size" if cfg["model_type"] in ("qwen3_moe", *SIGMOID_ROUTED) else "intermediate_size"


def first_dense_layers(cfg: dict) -> int:
    """How many leading decoder layers have a dense MLP (GLM-4.5's and DeepSeek-V3's first_k_dense_replace; 0 for the
    others: check_moe refuses dense layers elsewhere)."""
    model_type = cfg.get("model_type")
    if model_type not in SIGMOID_ROUTED:
        return 0
    dense = cfg.get("first_k_dense_replace")
    return int(SIGMOID_ROUTED[model_type] if dense is None else dense)
