"""The embedded mixture-of-experts models' architectures: a tiny Mixtral and a tiny Qwen3-MoE with the embedded
tokenizer.

"tiny-mixtral-count" (registered in megarl.embedded.registry.EMBEDDED_MODELS, built and warm-started there
exactly like the dense count model) is what configs/moe.yaml trains and what the MoE tests serve. This
module owns only its config, so the builders stay one-way (tiny.py imports this, nothing here imports
back): Mixtral-style routing -- a softmax over `NUM_EXPERTS` router logits, the top `TOP_K` experts,
their probabilities renormalised to sum to 1 -- in front of SwiGLU experts (`block_sparse_moe.experts.{e}.
w1/w3/w2` = gate/up/down, `block_sparse_moe.gate` the router, as transformers' save_pretrained writes them).

Sizes: the dense tiny Qwen2's attention (hidden 64, 4 heads, 2 KV heads, no q/k/v bias: Mixtral has none)
and 4 experts of width 96, 2 per token: a token runs the dense model's MLP width (2 x 96 = 192) but the
weights are twice as many, so routing decides something.

"tiny-qwen3moe-count" is the same on Qwen3-MoE (`mlp.gate`, `mlp.experts.{e}.gate_proj/up_proj/down_proj`, per-head
q/k RMSNorm, no q/k/v bias): the same experts, routing and attention sizes, `norm_topk_prob: true` (Mixtral's
renormalised top-k, as Qwen3-30B-A3B's config sets it).

"tiny-deepseek-v3-count" is the same on DeepSeek-V3: the same hidden size, heads, experts (the routed ones of width
96, top-2) and layers, with multi-latent attention (no q latent, as DeepSeek-V2-Lite; a kv latent of 32, per-head
q/k of 16 + 16 RoPE dims, v of 16), a sigmoid router (top-2 renormalised, no group limit, scale 1) and a shared
expert of width 96; both layers MoE (first_k_dense_replace 0).
"""
from __future__ import annotations

NUM_EXPERTS = 4
TOP_K = 2


def build_moe_config(vocab_size: int, eos_id: int, pad_id: int, **overrides):
    """The tiny Mixtral config (`overrides` replace keys, as megarl.embedded.tiny.build_config's)."""
    from transformers import MixtralConfig

    kwargs = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, router_jitter_noise=0.0,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id, torch_dtype="float32",
    )
    kwargs.update(overrides)
    return MixtralConfig(**kwargs)


def build_qwen3moe_config(vocab_size: int, eos_id: int, pad_id: int, **overrides):
    """The tiny Qwen3-MoE config: build_moe_config's sizes (head_dim given, as Qwen3's config needs it; every layer
    sparse)."""
    from transformers import Qwen3MoeConfig

    mixtral = build_moe_config(vocab_size, eos_id, pad_id, **overrides).to_dict()
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "num_experts_per_tok", "router_jitter_noise", "rms_norm_eps",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    kwargs = {k: mixtral[k] for k in keys if k in mixtral}
    return Qwen3MoeConfig(**kwargs, head_dim=kwargs["hidden_size"] // kwargs["num_attention_heads"],
                          num_experts=mixtral["num_local_experts"], moe_intermediate_size=mixtral["intermediate_size"],
                          intermediate_size=mixtral["intermediate_size"] * mixtral["num_experts_per_tok"],
                          decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dtype="float32")


def build_deepseek_v3_config(vocab_size: int, eos_id: int, pad_id: int, **overrides):
    """The tiny DeepSeek-V3 config: build_moe_config's sizes with multi-latent attention and a shared expert (module
    docstring)."""
    from transformers import DeepseekV3Config

    mixtral = build_moe_config(vocab_size, eos_id, pad_id, **overrides).to_dict()
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
            "num_experts_per_tok", "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id",
            "pad_token_id")
    kwargs = {k: mixtral[k] for k in keys if k in mixtral}
    return DeepseekV3Config(**kwargs, num_key_value_heads=kwargs["num_attention_heads"], q_lora_rank=None,
                            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                            n_routed_experts=mixtral["num_local_experts"], n_shared_experts=1,
                            moe_intermediate_size=mixtral["intermediate_size"],
                            intermediate_size=mixtral["intermediate_size"] * mixtral["num_experts_per_tok"],
                            n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                            first_k_dense_replace=0, num_nextn_predict_layers=0, rope_interleave=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dtype="float32")
