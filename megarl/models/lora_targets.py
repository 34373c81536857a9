"""Which projections of an HF model LoRA adapts, and the check of `learner.lora.*` against a model's config.json.

`learner.lora.target_modules` names a decoder layer's projections in the plain decoder's terms (q/k/v/o, gate/up/
down: megarl.config.schema.LORA_TARGETS). A family whose HF layer holds other linears adapts the modules those
projections live in, which are what peft adapts and what megarl publishes and exports (`modules`):
  * Phi-3's fused ``self_attn.qkv_proj`` (rows q, k, v) and ``mlp.gate_up_proj`` (rows gate, up): one adapter on each
    fused linear, as peft puts it, so q/k/v are adapted together or not at all, and so are gate/up;
  * DeepSeek-V3's multi-latent attention: q_proj is the query path (``q_proj``, or ``q_a_proj`` and ``q_b_proj``
    around the q latent), k_proj and v_proj are the shared k/v latent's ``kv_a_proj_with_mqa`` and ``kv_b_proj``
    (whose rows are every head's k and v, so k and v go together), o_proj is ``o_proj``.
A mixture-of-experts layer has no gate/up/down projection (its experts are not adapted).

No torch: `megarl train` runs the check before any worker starts (megarl/cli.py check_model_dir), and the
learners and engines again on their own. The adapters themselves are megarl.models.lora's (megatron learner,
built-in engine) and megarl.learner.hf_lora's (peft, the DeepSpeed learner).
"""
from __future__ import annotations

from megarl.config.schema import LORA_TARGETS as TARGETS
from megarl.models import families
from megarl.models.moe_config import is_moe

ATTENTION_TARGETS = TARGETS[:4]  # q, k, v, o: the attention block's projections; the rest are the MLP's


def _fused(hf_config: dict) -> bool:
    """Whether the model's family holds q/k/v and gate/up fused (Phi-3)."""
    family = families.FAMILIES.get(hf_config.get("model_type"))
    return family is not None and family.fused_projections


def _latent(hf_config: dict) -> bool:
    """Whether the model's family has multi-latent attention (DeepSeek-V3)."""
    family = families.FAMILIES.get(hf_config.get("model_type"))
    return family is not None and family.latent_attention


def module_dims(hf_config: dict) -> dict[str, dict[str, tuple[int, int]]]:
    """Target -> {HF module path in a decoder layer: (in_features, out_features)} of every projection the model's
    decoder layers have (a fused module is listed under each target it holds)."""
    hidden, heads = int(hf_config["hidden_size"]), int(hf_config["num_attention_heads"])
    inter = int(hf_config["intermediate_size"])
    if _latent(hf_config):
        q_head = int(hf_config["qk_nope_head_dim"]) + int(hf_config["qk_rope_head_dim"])
        q_rank, kv_rank = hf_config.get("q_lora_rank"), int(hf_config["kv_lora_rank"])
        query = ({"self_attn.q_proj": (hidden, heads * q_head)} if q_rank is None else
                 {"self_attn.q_a_proj": (hidden, int(q_rank)), "self_attn.q_b_proj": (int(q_rank), heads * q_head)})
        latent = {"self_attn.kv_a_proj_with_mqa": (hidden, kv_rank + int(hf_config["qk_rope_head_dim"])),
                  "self_attn.kv_b_proj": (kv_rank, heads * (int(hf_config["qk_nope_head_dim"])
                                                            + int(hf_config["v_head_dim"])))}
        attention = {"q_proj": query, "k_proj": latent, "v_proj": latent,
                     "o_proj": {"self_attn.o_proj": (heads * int(hf_config["v_head_dim"]), hidden)}}
    else:
        kv_heads = int(hf_config.get("num_key_value_heads") or heads)
        head_dim = int(hf_config.get("head_dim") or hidden // heads)
        q, kv = heads * head_dim, kv_heads * head_dim
        if _fused(hf_config):
            qkv = {"self_attn.qkv_proj": (hidden, q + 2 * kv)}
            attention = {"q_proj": qkv, "k_proj": qkv, "v_proj": qkv}
        else:
            attention = {"q_proj": {"self_attn.q_proj": (hidden, q)}, "k_proj": {"self_attn.k_proj": (hidden, kv)},
                         "v_proj": {"self_attn.v_proj": (hidden, kv)}}
        attention["o_proj"] = {"self_attn.o_proj": (q, hidden)}
    if _fused(hf_config):
        gate_up = {"mlp.gate_up_proj": (hidden, 2 * inter)}
        mlp = {"gate_proj": gate_up, "up_proj": gate_up}
    else:
        mlp = {"gate_proj": {"mlp.gate_proj": (hidden, inter)}, "up_proj": {"mlp.up_proj": (hidden, inter)}}
    mlp["down_proj"] = {"mlp.down_proj": (inter, hidden)}
    return {**attention, **mlp}


def modules(hf_config: dict, targets) -> dict[str, tuple[int, int]]:
    """HF module path in a decoder layer -> (in_features, out_features) of every linear `targets` adapt, in
    publish order (the targets' order in LORA_TARGETS, each module once)."""
    dims = module_dims(hf_config)
    out: dict[str, tuple[int, int]] = {}
    for target in (t for t in TARGETS if t in targets):
        out.update(dims[target])
    return out


def together(hf_config: dict) -> list[tuple[str, ...]]:
    """The groups of targets this model's HF modules adapt only together (one module holds each group's rows)."""
    if _latent(hf_config):
        return [("k_proj", "v_proj")]
    if _fused(hf_config):
        return [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]
    return []


def check(hf_config: dict, lora_cfg) -> None:
    """ValueError naming the learner.lora key that this model cannot take: a target module it does not have
    (a mixture-of-experts layer has no gate/up/down projection), half of a group one HF module holds, or a rank above
    a target's smaller dimension (the adapter would be no lower-rank than the weight)."""
    if lora_cfg.rank == 0:
        return
    dims = module_dims(hf_config)
    if is_moe(hf_config):
        dims = {t: d for t, d in dims.items() if t in ATTENTION_TARGETS}
    for target in lora_cfg.target_modules:
        if target not in dims:
            raise ValueError(f"learner.lora.target_modules: {hf_config.get('model_type')!r} layers have no "
                             f"{target!r} (adaptable: {', '.join(dims)})")
    for group in together(hf_config):
        chosen = [t for t in group if t in lora_cfg.target_modules]
        if chosen and len(chosen) < len(group):
            held = " and ".join(modules(hf_config, group))
            raise ValueError(f"learner.lora.target_modules: {'/'.join(group)} are {hf_config.get('model_type')}'s "
                             f"{held}, adapted together or not at all: add "
                             f"{[t for t in group if t not in chosen]} or drop {chosen}")
    for module, (fan_in, fan_out) in modules(hf_config, lora_cfg.target_modules).items():
        if lora_cfg.rank > min(fan_in, fan_out):
            raise ValueError(f"learner.lora.rank={lora_cfg.rank} is larger than {module.rsplit('.', 1)[-1]}'s "
                             f"dimensions {fan_in} x {fan_out} (in x out); use a rank <= {min(fan_in, fan_out)}")


def check_peft(hf_config: dict, lora_cfg) -> None:
    """ValueError naming the learner.lora key this model cannot take on the DeepSpeed learner: megarl.models.lora's
    checks, and a mixture-of-experts model (its router replay and per-expert publish are not tried under peft)."""
    check(hf_config, lora_cfg)
    if lora_cfg.rank > 0 and is_moe(hf_config):
        raise ValueError(f"learner.lora.rank={lora_cfg.rank} with learner.backend=deepspeed: a mixture-of-experts "
                         f"model ({hf_config.get('model_type')!r}) under peft is not tried yet; use "
                         "learner.backend=megatron")


def peft_modules(hf_config: dict, targets) -> list[str]:
    """The module names peft's LoraConfig.target_modules takes for `targets` on this model (its HF linears' own
    names: `qkv_proj` on Phi-3), sorted."""
    return sorted({path.rsplit(".", 1)[-1] for path in modules(hf_config, targets)})
