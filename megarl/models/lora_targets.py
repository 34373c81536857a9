"""Which projections of an HF model LoRA adapts, and the check of `learner.lora.*` against a model's config.json.

No torch: `megarl train` runs the check before any worker starts (megarl/cli.py check_model_dir), and the
learners and engines again on their own. The adapters themselves are megarl.models.lora's (megatron learner,
built-in engine) and megarl.learner.hf_lora's (peft, the DeepSpeed learner).
"""
from __future__ import annotations

from megarl.config.schema import LORA_TARGETS as TARGETS
from megarl.models import families
from megarl.models.moe_config import is_moe

ATTENTION_TARGETS = TARGETS[:4]  # q, k, v, o: the attention block's projections; the rest are the MLP's


def target_dims(hf_config: dict) -> dict[str, tuple[int, int]]:
    """HF projection -> (in_features, out_features) of every projection a dense decoder layer has."""
    hidden, heads = int(hf_config["hidden_size"]), int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    inter = int(hf_config["intermediate_size"])
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def check(hf_config: dict, lora_cfg) -> None:
    """ValueError naming the learner.lora key that this model cannot take: a target module it does not have
    (a mixture-of-experts layer has no gate/up/down projection), or a rank above a target's smaller dimension
    (the adapter would be no lower-rank than the weight)."""
    if lora_cfg.rank == 0:
        return
    if hf_config.get("model_type") in families.FAMILIES and families.family_of(hf_config).fused_projections:
        raise ValueError(f"learner.lora: {hf_config['model_type']!r} holds fused qkv_proj / gate_up_proj, whose "
                         f"adapters megarl does not map (learner.lora.rank=0 trains the whole model)")
    if hf_config.get("model_type") in families.FAMILIES and families.family_of(hf_config).latent_attention:
        raise ValueError(f"learner.lora: {hf_config['model_type']!r}'s multi-latent attention has no q/k/v/o_proj "
                         f"adapters megarl maps (learner.lora.rank=0 trains the whole model)")
    dims = target_dims(hf_config)
    if is_moe(hf_config):
        dims = {t: d for t, d in dims.items() if t in ATTENTION_TARGETS}
    for target in lora_cfg.target_modules:
        if target not in dims:
            raise ValueError(f"learner.lora.target_modules: {hf_config.get('model_type')!r} layers have no "
                             f"{target!r} (adaptable: {', '.join(dims)})")
        if lora_cfg.rank > min(dims[target]):
            raise ValueError(f"learner.lora.rank={lora_cfg.rank} is larger than {target}'s dimensions "
                             f"{dims[target][0]} x {dims[target][1]} (in x out); use a rank <= {min(dims[target])}")


def check_peft(hf_config: dict, lora_cfg) -> None:
    """ValueError naming the learner.lora key this model cannot take on the DeepSpeed learner: megarl.models.lora's
    checks, and a mixture-of-experts model (its router replay and per-expert publish are not tried under peft)."""
    check(hf_config, lora_cfg)
    if lora_cfg.rank > 0 and is_moe(hf_config):
        raise ValueError(f"learner.lora.rank={lora_cfg.rank} with learner.backend=deepspeed: a mixture-of-experts "
                         f"model ({hf_config.get('model_type')!r}) under peft is not tried yet; use "
                         "learner.backend=megatron")
