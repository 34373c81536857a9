"""Pure-torch forward pass of the decoders of megarl.models.families (Qwen2, Llama, Qwen3, Mistral, Phi-3, SmolLM3,
OLMo 2, Gemma 3 text, Mixtral, Qwen3-MoE, GLM-4.5, gpt-oss, DeepSeek-V3), for the built-in sampler engine.

This module owns the model math and the KV-cache layout; it owns no scheduling (that is
`megarl.sampler.engine`).  Weights arrive as a plain dict whose keys are exactly the HF names that
``Qwen2ForCausalLM.save_pretrained`` / ``LlamaForCausalLM`` write to ``model.safetensors`` (tied
embeddings -> no ``lm_head.weight``).  `prepare_weights` turns that dict into the forward's
`RuntimeWeights` (q/k/v and gate/up stacked, norm weights folded in, RoPE pairs interleaved) in a
`WeightArena`, the storage of one version, which a weight receiver can also fill directly; the
forward is a function over it, so swapping weights is replacing one reference: no nn.Module, no
parameter copying on the decode thread.

KV cache: preallocated K [layers, slots, kv_heads, head_dim, max_seq_len] and V [layers, slots,
kv_heads, max_seq_len, head_dim].  A forward call works on a contiguous range of slots
``[slot_start, slot_start + B)`` (the engine keeps its running sequences packed at the front), writes
the new tokens' K/V at their positions and attends to cache positions ``<= position`` of each query.
Every sequence thus has its own length inside one call, and the same function serves prefill
(T tokens per row, right-padded) and batched decode (T = 1).  A sliding window (Mistral) is a mask over the same
cache: a query also skips the keys `sliding_window` or more positions behind it.
The paged layout (`PagedKVCache`, sampler.kv_layout=paged) holds the same K and V in fixed-size blocks of a pool
shared by all slots, addressed through a per-slot block table; a decode step attends over each row's blocks block
by block (`_paged_decode_attention`), a prefill gathers them into the operand the contiguous layout holds.

Gemma 3 text (``spec.gemma``): the embedding rows times sqrt(hidden_size) in the weights' dtype; RMSNorms of
(1 + weight) in fp32 (the input and pre-feedforward ones folded into the projections as the others' are, the
norms after attention and the MLP, the per-head q/k norms and the final one applied as transformers applies them);
GeGLU (gelu tanh); q.k scaled by query_pre_attn_scalar^-0.5; its local layers (``spec.local_layers``) attend to
the last `sliding_window` positions and rotate by their own RoPE table (``ForwardTables.local_rotation``).

On CPU at the sizes this engine serves, a decode step is bound by the number of kernels and the
memory they touch, not by FLOPs; the layout choices (documented where they are made, and in
docs/sampler.md) remove kernels.  Numerics follow transformers' (RoPE and RMSNorm in fp32, HF's
``rotate_half`` pairing, same attention scale): fp32 log-probs agree with HF to ~2e-6.

Mixture of experts (``model_type: mixtral`` or ``qwen3_moe``): every layer's MLP is a router and `num_experts`
SwiGLU experts.  The router is transformers': softmax over the router logits in fp32, the top-k probabilities
(renormalised to sum to 1 for Mixtral, and for Qwen3-MoE with ``norm_topk_prob``), each chosen expert's output
weighted by its share.  Qwen3's and Qwen3-MoE's attention also RMS-normalises every query and key head
(``q_norm`` / ``k_norm``, over head_dim, before RoPE).  The forward computes all
experts of a layer in two matmuls and combines them with a [tokens, experts] weight that is zero off
the chosen k (the same sum transformers' per-expert loop makes, in another order): at the sizes this CPU
engine serves, a decode step is bound by kernel count, not FLOPs (E / k times the expert FLOPs is the
price).  `forward(..., routes=buf)` writes each position's top-k expert indices per MoE layer, in the
router's top-k order, into `buf` (the engine's route records, docs/moe.md).

gpt-oss (``spec.gpt_oss``): a bias on q/k/v and o_proj; each query head's learned sink logit joins its softmax as
one more column whose value is zero (transformers' eager attention: `_with_sinks`; a prefill computes its scores
itself there, SDPA has no such column); each layer attends over its own window (``spec.layer_windows``:
families.layer_windows, sliding then full by `layer_types`), one mask per distinct window; YaRN as convert maps it.
Its MoE layers route as transformers' GptOssTopKRouter (top-k of the biased logits, softmax over those k) and run its
fused experts in the stacked layout above (the router and every expert's interleaved gate/up columns in one matmul
with their biases, the downs stacked), with the clamped SwiGLU ``(clamp(up) + 1) * g * sigmoid(alpha * g)``,
g = gate clamped above; each expert's down bias enters weighted by its share. It runs at sampler.tp = 1 (its fused
experts have no tensor-parallel slices here) and records its routes as the other MoE families do.

GLM-4.5 (``spec.sigmoid_router``; moe_config.SIGMOID_ROUTED): partial RoPE (``spec.rotary_dim``: the first dims of
each head rotate, the RoPE-pair interleaving of the weights and the rotation confined to them), q/k/v biases and q/k
norms from its config. Its first ``dense_layers`` layers have a dense MLP; the others route as transformers'
Glm4MoeTopkRouter (`_sigmoid_routed_experts`) and add a shared expert, whose gate/up rows follow the router's in the
stacked projection and whose down leads the stacked downs (it is one more expert, of share 1). Routes are recorded
for the MoE layers only (route index = layer - dense_layers, as the learners' route shape). Under tensor parallelism
the shared expert splits as one more expert and the dense layers as a dense MLP; the router and its expert bias are
whole on every rank.

DeepSeek-V3 (``spec.latent``: multi-latent attention, megarl.models.latent_attention's tensors; GLM-4.5's MoE): the
cache holds per position and layer the kv latent c (kv_lora_rank values, after kv_a_layernorm) and the shared key's
rotated RoPE dims (`KVCache.latent`), kv_lora_rank + qk_rope_head_dim values where per-head K and V would take
heads * (qk_nope + qk_rope + v_head_dim); what a version wrote stays valid under `keep` (the next version expands it
with its own kv_b_proj, as transformers' cache does). Attention is absorbed (`_latent_attention`): each head's
q_nope times its W_UK (kv_b_proj's k rows) is a query in latent space that, with q's RoPE dims, attends to the cached
[c | k_rot] as one KV head shared by all heads; the output in latent space times W_UV (kv_b_proj's v rows) is the
head's value sum, then o_proj. The same form serves prefill (SDPA) and decode (two batched matmuls). q comes from
q_proj or through the q latent (q_a_proj, q_a_layernorm, q_b_proj); q_a_proj (or q_proj) and kv_a_proj_with_mqa are
one stacked projection with the input norm folded in. RoPE is interleaved YaRN: DeepSeek-V3's rope pairs are adjacent
already, the pairs `_rotate` takes; the softmax scale is transformers' (latent_attention.softmax_scale). Under tensor
parallelism a rank holds its heads of q_proj / q_b_proj, kv_b_proj and o_proj and computes (and caches) the same
latent as every other rank, as vLLM's and SGLang's MLA do; the paged layout holds the latents in blocks
(`PagedKVCache`).

Tensor parallelism: `ModelSpec.shard(t)` is the spec of one TP rank, whose weights are that rank's
slices in the layout of `megarl.models.tp_shard` (whole heads of q/k/v, rows of gate/up, columns of
o_proj/down_proj, vocab rows of the embedding and lm_head; norms whole; an MoE layer's router whole and
every expert's gate/up rows and down columns; multi-latent attention's heads, its latents whole).
`forward(..., tp_group=g)` sums the embedding lookups and the partial outputs of o_proj and down_proj (an MoE layer's
stacked downs) over g, gathers the logits' vocab slices and runs everything else replicated, so every rank of g ends
with the same logits (and routes).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarl.models import convert, latent_attention, moe, tp_shard
from megarl.models.convert import load_pretrained  # noqa: F401 - the engine's loader, shared with the learner
from megarl.models import families
from megarl.models.families import FAMILIES, MODEL_TYPES, generic_path_hint
from megarl.sampler.kv_blocks import BlockAllocator, blocks_for


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts the forward needs, parsed (and checked) from an HF config.json dict."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope_scaling: dict | None = None  # megarl.models.convert.rope_scaling: linear, llama3 or yarn (HF's definitions)
    # > 1: the spec of one tensor-parallel rank (`shard`): the head and intermediate counts are per rank.
    tp_size: int = 1
    # Mixture of experts (model_type mixtral): experts per MoE layer (every layer is one; 0 = dense) and
    # experts per token; `intermediate_size` is then one expert's width.
    num_experts: int = 0
    top_k: int = 0
    # Whether the router renormalises its top-k probabilities (Mixtral always; Qwen3-MoE's norm_topk_prob).
    norm_topk: bool = True
    # Per-head RMSNorm of queries and keys before RoPE (Qwen3's q_norm / k_norm).
    qk_norm: bool = False
    # Each query attends to the keys of its last `sliding_window` positions, its own included (Mistral); None: all.
    sliding_window: int | None = None
    # HF's q/k/v are one qkv_proj and gate/up one gate_up_proj (Phi-3): the stacked buffers the forward uses anyway.
    fused_projections: bool = False
    # Per layer whether it rotates q and k (SmolLM3's no_rope_layers); None: every layer does.
    rope_layers: tuple[bool, ...] | None = None
    # OLMo 2: no norm before attention or the MLP, an RMSNorm on each one's output before the residual add, and
    # q_norm / k_norm over the whole q / k projection (all heads at once, weights [heads * head_dim]).
    post_norms: bool = False
    # Gemma 3 text (families.gemma; see the module docstring): per layer whether it is local (sliding window
    # `sliding_window`, RoPE base `local_rope_theta`; the global layers: `rope_theta`, `rope_scaling`), and the
    # attention scale query_pre_attn_scalar^-0.5 (None: head_dim^-0.5)
    gemma: bool = False
    local_layers: tuple[bool, ...] | None = None
    local_rope_theta: float = 10000.0
    attn_scale: float | None = None
    # gpt-oss (families.gpt_oss_blocks; see the module docstring): attention sinks, a bias on every linear, each
    # layer's own window (`layer_windows`, families.layer_windows: None = full attention), a biased router whose
    # top-k logits are softmaxed, fused experts with biases and the clamped SwiGLU (swiglu_alpha, swiglu_limit)
    gpt_oss: bool = False
    layer_windows: tuple[int | None, ...] | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # The first `rotary_dim` dims of each q/k head rotate, the rest pass (GLM-4.5's partial_rotary_factor); None: all
    rotary_dim: int | None = None
    # Sigmoid-routed MoE (GLM-4.5, DeepSeek-V3: moe_config.SIGMOID_ROUTED; see the module docstring): the router's
    # sigmoid scores plus its e_score_correction_bias choose among the best `topk_group` of `n_group` groups, the
    # chosen unbiased scores (renormalised with norm_topk) times `routed_scaling` weigh the experts; a shared expert
    # `shared_ffn_size` wide runs for every token; the first `dense_layers` layers have a dense MLP
    # `dense_ffn_size` wide.
    sigmoid_router: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    shared_ffn_size: int = 0
    dense_layers: int = 0
    dense_ffn_size: int = 0
    # Multi-latent attention (DeepSeek-V3; see the module docstring): > 0, the kv latent's width, what the cache
    # holds per position with the `head_dim` (= qk_rope_head_dim) RoPE dims of the shared key; the q latent's width
    # (None: one q_proj), each head's q/k dims without RoPE and its v dims.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_dim: int = 0
    v_head_dim: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        """The layers whose routes a position records (the decoder layers after the first dense ones)."""
        return self.num_layers - self.dense_layers if self.is_moe else 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.dense_layers

    @property
    def latent(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """The dims of each q/k head RoPE rotates (the first ones)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelSpec":
        """Parse an HF config dict; raise ValueError naming the field of anything we cannot run."""
        model_type = cfg.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"model_type={model_type!r} is not supported (supported: {MODEL_TYPES}; "
                             f"{generic_path_hint()})")
        family = FAMILIES[model_type]
        if family.gemma:
            return cls._gemma(cfg)
        if family.gpt_oss_blocks:
            return cls._gpt_oss(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg['hidden_act']!r} is not supported (only 'silu')")
        if cfg.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported (full attention only)")
        if model_type == "mixtral" and cfg.get("sliding_window"):
            raise ValueError(f"sliding_window={cfg['sliding_window']} is not supported (full attention only)")
        layer_types = cfg.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"layer_types={layer_types!r} is not supported (full_attention only)")
        # Old configs put rope_theta / rope_scaling at the top level; transformers>=5 writes rope_parameters.
        # The learner's converter decides which scalings exist (the engine must compute what it trains).
        try:
            rope_scaling = convert.rope_scaling(cfg)
        except ValueError as exc:
            raise ValueError(f"rope_scaling/rope_parameters: {exc}") from None
        rope_params = cfg.get("rope_parameters") or {}
        partial = convert.rotary_fraction(cfg)
        if partial != 1.0 and not family.partial_rotary:
            raise ValueError(f"partial_rotary_factor={partial} is not supported for {model_type} (full rotary only)")
        rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))

        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if family.latent_attention:  # (its heads' RoPE dims; their other dims: the latent fields)
            latent_attention.check(cfg)
            head_dim = latent_attention.rope_dim(cfg)
        # Qwen2 always has q/k/v biases and none on o_proj; Llama's and Qwen3's attention_bias covers q/k/v/o,
        # GLM-4.5's q/k/v only (families.qkv_bias).
        attention_bias = bool(cfg.get("attention_bias", False))
        rotary_dim = int(head_dim * partial)
        if rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={partial}: head_dim={head_dim} * factor must be even")
        is_moe = family.moe
        num_experts, top_k = (moe.num_experts(cfg), moe.top_k(cfg)) if is_moe else (0, 0)
        if is_moe and not (num_experts >= 2 and 1 <= top_k <= num_experts):
            raise ValueError(f"num_experts={num_experts}, num_experts_per_tok={top_k}: a mixture of experts "
                             f"needs >= 2 experts and 1 <= experts per token <= experts")
        if is_moe:
            moe.check_moe(cfg)  # the layouts megarl maps exactly (dense layers in between, router noise: named)
        sigmoid = model_type in moe.SIGMOID_ROUTED
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=moe.expert_ffn_size(cfg) if is_moe else int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=families.qkv_bias(cfg) or attention_bias and not family.config_attention,
            o_bias=attention_bias and not (family.qkv_bias or family.config_attention),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope_scaling=rope_scaling,
            num_experts=num_experts,
            top_k=top_k,
            norm_topk=model_type == "mixtral" or bool(cfg.get("norm_topk_prob", sigmoid)),
            qk_norm=families.qk_norm(cfg),
            sliding_window=families.sliding_window(cfg),
            fused_projections=family.fused_projections,
            rope_layers=families.rope_layers(cfg),
            post_norms=family.post_norms,
            rotary_dim=None if rotary_dim == head_dim else rotary_dim,
            **(cls._sigmoid_routing(cfg) if sigmoid else {}),
            **(cls._latent_attention(cfg, rope_scaling) if family.latent_attention else {}),
        )

    @staticmethod
    def _latent_attention(cfg: dict, rope_scaling: dict | None) -> dict:
        """The spec fields of multi-latent attention (latent_attention.check has taken its config)."""
        q_lora = cfg.get("q_lora_rank")
        return dict(kv_lora_rank=int(cfg["kv_lora_rank"]), q_lora_rank=None if q_lora is None else int(q_lora),
                    qk_nope_dim=int(cfg["qk_nope_head_dim"]), v_head_dim=int(cfg["v_head_dim"]),
                    attn_scale=latent_attention.softmax_scale(cfg, rope_scaling))

    @staticmethod
    def _sigmoid_routing(cfg: dict) -> dict:
        """The spec fields of a sigmoid-routed MoE (moe_config.SIGMOID_ROUTED; check_moe has taken its config)."""
        groups, kept = moe._groups(cfg)
        return dict(sigmoid_router=True, n_group=groups, topk_group=kept,
                    routed_scaling=float(cfg.get("routed_scaling_factor") or 1.0),
                    shared_ffn_size=moe.expert_ffn_size(cfg) * int(cfg["n_shared_experts"]),
                    dense_layers=moe.first_dense_layers(cfg), dense_ffn_size=int(cfg["intermediate_size"]))

    @classmethod
    def _gemma(cls, cfg: dict) -> "ModelSpec":
        """A Gemma 3 text config's spec (what the learner maps: megarl.models.convert.check_supported's refusals)."""
        cfg = convert.check_supported(cfg)
        full, local = (convert.layer_config(cfg, kind) for kind in (families.FULL, families.SLIDING))
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        return cls(
            model_type=cfg["model_type"], vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=convert._rope_theta(full),
            rope_scaling=convert.rope_scaling(full), local_rope_theta=convert._rope_theta(local),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), qkv_bias=False, o_bias=False,
            mlp_bias=False, qk_norm=True, sliding_window=families.layer_window(cfg), gemma=True,
            local_layers=tuple(kind == families.SLIDING for kind in families.layer_types(cfg)),
            attn_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5)

    @classmethod
    def _gpt_oss(cls, cfg: dict) -> "ModelSpec":
        """A gpt-oss config's spec (what the learner maps: megarl.models.convert.check_supported's refusals)."""
        cfg = convert.check_supported(cfg)
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        return cls(
            model_type=cfg["model_type"], vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            intermediate_size=moe.expert_ffn_size(cfg), num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=kv_heads, head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), rope_theta=convert._rope_theta(cfg),
            rope_scaling=convert.rope_scaling(cfg), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True, o_bias=True, mlp_bias=False, num_experts=moe.num_experts(cfg), top_k=moe.top_k(cfg),
            gpt_oss=True, layer_windows=families.layer_windows(cfg),
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))

    def shard(self, tp_size: int) -> "ModelSpec":
        """The spec of one of `tp_size` tensor-parallel ranks: its heads, KV heads and MLP width (an MoE
        model's: every expert's, the shared expert's and the first dense layers') are 1/tp_size of the model's
        (hidden size, head_dim and the experts and their router unchanged; `vocab_size` stays the model's, its
        embedding and lm_head rows are `shard_vocab`), so `weight_shapes` gives the shapes of that rank's `tp_shard`
        slices.  ValueError naming the dimension tp_size does not divide."""
        if self.tp_size != 1:
            raise ValueError(f"this spec is already one of {self.tp_size} tensor-parallel shards")
        whole = families.engine_tp_refusal(self._hf_config)
        if whole and tp_size != 1:
            raise ValueError(f"{self.model_type}'s {whole} have no tensor-parallel slices "
                             f"(megarl.models.tp_shard): the built-in engine runs it at sampler.tp = 1")
        if tp_size < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {tp_size}")
        if self.gpt_oss and tp_size != 1:
            raise ValueError("gpt_oss's fused experts (mlp.experts.gate_up_proj, gate and up interleaved) have no "
                             "tensor-parallel slices in the built-in engine: it runs gpt-oss at sampler.tp = 1")
        tp_shard.check_divisible(self.num_heads, self.num_kv_heads, self.intermediate_size, self.vocab_size,
                                 tp_size, moe.expert_ffn_field(self._hf_config) if self.is_moe else "intermediate_size")
        if self.dense_ffn_size % tp_size:  # (a shared expert's width is a multiple of the experts')
            raise ValueError(f"tensor parallel size {tp_size} does not divide intermediate_size={self.dense_ffn_size} "
                             f"(the first dense layers' MLP)")
        return replace(self, num_heads=self.num_heads // tp_size, num_kv_heads=self.num_kv_heads // tp_size,
                       intermediate_size=self.intermediate_size // tp_size, tp_size=tp_size,
                       shared_ffn_size=self.shared_ffn_size // tp_size, dense_ffn_size=self.dense_ffn_size // tp_size)

    @property
    def _hf_config(self) -> dict:
        """What megarl.models.moe needs to name this model's MoE tensors."""
        return {"model_type": self.model_type}

    @property
    def shard_vocab(self) -> int:
        """Token ids per TP rank: its embedding and lm_head hold rows [rank * this, (rank + 1) * this)."""
        return self.vocab_size // self.tp_size

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every tensor the forward reads, in save_pretrained naming (this TP
        rank's slices for a `shard` spec; row-parallel biases are whole, see megarl.models.tp_shard)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q_out, kv_out = self.num_heads * d, self.num_kv_heads * d
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.shard_vocab, h)}
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}."
            if self.gemma:
                for norm in convert.GEMMA_NORMS:
                    shapes[p + norm + ".weight"] = (h,)
            elif self.post_norms:
                shapes[p + "post_attention_layernorm.weight"] = shapes[p + "post_feedforward_layernorm.weight"] = (h,)
            else:
                shapes[p + "input_layernorm.weight"] = (h,)
                shapes[p + "post_attention_layernorm.weight"] = (h,)
            if self.latent:
                shapes.update(self._latent_attention_shapes(p + "self_attn."))
            for name, out in () if self.latent else ((("qkv_proj", q_out + 2 * kv_out),) if self.fused_projections else
                                                     (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out))):
                shapes[p + f"self_attn.{name}.weight"] = (out, h)
                if self.qkv_bias:
                    shapes[p + f"self_attn.{name}.bias"] = (out,)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.num_heads * self.v_head_dim if self.latent else q_out)
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"], shapes[p + "self_attn.k_norm.weight"] = (
                    ((q_out,), (kv_out,)) if self.post_norms else ((d,), (d,)))
            if self.gpt_oss:
                e, m = self.num_experts, p + "mlp."
                shapes.update({p + "self_attn.sinks": (self.num_heads,), m + "router.weight": (e, h),
                               m + "router.bias": (e,), m + "experts.gate_up_proj": (e, h, 2 * i),
                               m + "experts.gate_up_proj_bias": (e, 2 * i), m + "experts.down_proj": (e, i, h),
                               m + "experts.down_proj_bias": (e, h)})
                continue
            if self.is_moe_layer(layer):
                shapes[moe.hf_router_name(self._hf_config, layer)] = (self.num_experts, h)
                if self.sigmoid_router:
                    shared, s = p + f"mlp.{moe.SHARED_EXPERT}.", self.shared_ffn_size
                    shapes[p + "mlp." + moe.EXPERT_BIAS[0]] = (self.num_experts,)
                    shapes.update({shared + "gate_proj.weight": (s, h), shared + "up_proj.weight": (s, h),
                                   shared + "down_proj.weight": (h, s)})
                for e in range(self.num_experts):
                    for name, shape in zip(moe.hf_expert_names(self._hf_config, layer, e), ((i, h), (i, h), (h, i))):
                        shapes[name] = shape
                continue
            w = self.dense_ffn_size if self.is_moe else i  # (a sigmoid-routed MoE's first layers: a dense MLP)
            for name, shape in ((("gate_up_proj", (2 * w, h)),) if self.fused_projections else
                                (("gate_proj", (w, h)), ("up_proj", (w, h)))) + (("down_proj", (h, w)),):
                shapes[p + f"mlp.{name}.weight"] = shape
                if self.mlp_bias:
                    shapes[p + f"mlp.{name}.bias"] = (shape[0],)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.shard_vocab, h)
        return shapes

    def _latent_attention_shapes(self, attn: str) -> dict[str, tuple[int, ...]]:
        """One layer's multi-latent attention tensors but o_proj (names relative to its `self_attn.`:
        latent_attention's), in HF shapes."""
        h, heads, rope = self.hidden_size, self.num_heads, self.head_dim
        q_out = heads * (self.qk_nope_dim + rope)
        shapes = {attn + "kv_a_proj_with_mqa.weight": (self.kv_lora_rank + rope, h),
                  attn + "kv_a_layernorm.weight": (self.kv_lora_rank,),
                  attn + "kv_b_proj.weight": (heads * (self.qk_nope_dim + self.v_head_dim), self.kv_lora_rank)}
        if self.q_lora_rank is None:
            return {attn + "q_proj.weight": (q_out, h), **shapes}
        return {attn + "q_a_proj.weight": (self.q_lora_rank, h), attn + "q_a_layernorm.weight": (self.q_lora_rank,),
                attn + "q_b_proj.weight": (q_out, self.q_lora_rank), **shapes}

    def check_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """ValueError naming the first missing, unexpected or wrongly shaped tensor."""
        expected = self.weight_shapes()
        for name, shape in expected.items():
            if name not in weights:
                raise ValueError(f"weights: missing tensor {name!r}")
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"weights: {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")
        for name in weights:
            if name not in expected:
                raise ValueError(f"weights: unexpected tensor {name!r} for {self.model_type} "
                                 f"(tie_word_embeddings={self.tie_word_embeddings})")


class KVCache:
    """Preallocated K and V: ``k`` [layers, slots, kv_heads, head_dim, max_seq_len] (transposed) and
    ``v`` [layers, slots, kv_heads, max_seq_len, head_dim].

    K is stored transposed so that both attention matmuls of a decode step (q @ K^T, p @ V) read
    their second operand row-major: CPU bmm with a transposed second operand is ~3x slower at decode
    shapes.  K's RoPE pairs are interleaved (see `prepare_weights`), which is invisible outside this
    module: attention only ever takes dot products of q and k permuted alike.

    Multi-latent attention (``spec.latent``) caches no per-head K or V: ``latent`` [layers, slots, max_seq_len,
    kv_lora_rank + rope dims] holds each position's kv latent (after kv_a_layernorm) and its shared key's RoPE
    dims (rotated), the keys of every head and the values of every head in latent space (`_latent_attention`);
    ``k`` and ``v`` are None.
    """

    def __init__(self, spec: ModelSpec, num_slots: int, max_seq_len: int, dtype: torch.dtype, device="cpu"):
        layers, heads, hd = spec.num_layers, spec.num_kv_heads, spec.head_dim
        self.max_seq_len = max_seq_len
        self.k = self.v = self.latent = None
        if spec.latent:
            self.latent = torch.zeros((layers, num_slots, max_seq_len, spec.kv_lora_rank + hd), dtype=dtype,
                                      device=device)
            return
        self.k = torch.zeros((layers, num_slots, heads, hd, max_seq_len), dtype=dtype, device=device)
        self.v = torch.zeros((layers, num_slots, heads, max_seq_len, hd), dtype=dtype, device=device)

    def locate(self, slots: slice, positions: torch.Tensor, attn_len: int):
        """Per forward call: where the rows' new entries go and what they read (`write_latent`)."""
        return slots, positions, attn_len

    def write_latent(self, layer: int, where, entry: torch.Tensor) -> torch.Tensor:
        """Write the new tokens' latent entries [B, T, kv_lora_rank + rope dims] at their positions of their slots;
        return each row's first attn_len positions [B, attn_len, kv_lora_rank + rope dims] (a view)."""
        slots, positions, attn_len = where
        latent = self.latent[layer, slots]
        latent.scatter_(1, positions[:, :, None].expand(*positions.shape, latent.shape[-1]), entry)
        return latent[:, :attn_len]

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy the first `length` positions of slots `src` into slots `dst` (used to keep slots packed)."""
        if self.latent is not None:
            self.latent[:, dst, :length] = self.latent[:, src, :length]
            return
        self.k[:, dst, :, :, :length] = self.k[:, src, :, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


class PagedKVCache:
    """K and V in a pool of fixed-size blocks shared by all slots (sampler.kv_layout=paged): ``k`` [layers,
    blocks + 1, kv_heads, head_dim, block_size] (transposed within a block, as `KVCache`'s) and ``v`` [layers,
    blocks + 1, kv_heads, block_size, head_dim]; position p of slot s lives at offset p % block_size of block
    ``table[s, p // block_size]``.

    Memory is the pool, not slots x max_seq_len: a slot holds only the blocks its request has reached, taken
    from the pool as it grows (`grow`) under a reservation of its worst-case length made at admission
    (`reserve`; megarl.sampler.kv_blocks), and returned when it ends (`release`).  Block 0 is a sink that no
    slot owns: every table entry past a slot's blocks points at it, so the writes of right padding (positions
    past a row's end, which `forward` may compute) land there instead of in another request's block, and a
    decode step's read of a shorter row's span past its end reads it (masked, never attended to).

    A decode step reads each row's blocks as they are (`write_and_blocks`, for `_paged_decode_attention`); a
    prefill gathers them into the contiguous [rows, kv_heads, head_dim, span] (and V's) operand that `_attention`
    reads (`write_and_gather`): the contiguous layout's matmuls over the same values.

    Multi-latent attention (``spec.latent``): ``latent`` [layers, blocks + 1, block_size, kv_lora_rank + rope dims]
    holds what `KVCache.latent` holds, in blocks (``k`` and ``v`` are None); every step, decode included, gathers a
    row's blocks into the contiguous [attn_len, kv_lora_rank + rope dims] operand `_latent_attention` reads
    (`write_latent`): one latent per position is small next to per-head K and V, and its decode is two matmuls over it.
    """

    def __init__(self, spec: ModelSpec, num_slots: int, max_seq_len: int, dtype: torch.dtype, device="cpu", *,
                 block_size: int, num_blocks: int):
        layers, heads, hd = spec.num_layers, spec.num_kv_heads, spec.head_dim
        self.allocator = BlockAllocator(num_blocks, block_size, first_id=1)  # (block 0: the sink)
        self.k = self.v = self.latent = None
        if spec.latent:
            self.latent = torch.zeros((layers, num_blocks + 1, block_size, spec.kv_lora_rank + hd), dtype=dtype,
                                      device=device)
        else:
            self.k = torch.zeros((layers, num_blocks + 1, heads, hd, block_size), dtype=dtype, device=device)
            self.v = torch.zeros((layers, num_blocks + 1, heads, block_size, hd), dtype=dtype, device=device)
        self.max_seq_len, self.block_size = max_seq_len, block_size
        self.table = torch.zeros((num_slots, blocks_for(max_seq_len, block_size)), dtype=torch.long, device=device)
        self.blocks: list[list[int]] = [[] for _ in range(num_slots)]  # each slot's blocks, in position order
        # Position of each offset of each table column [columns, block_size] (a decode step's mask).
        self.key_pos = torch.arange(self.table.shape[1] * block_size, device=device).view(-1, block_size)
        self.reserved = [0] * num_slots  # each slot's reservation, in blocks

    def blocks_for(self, positions: int) -> int:
        return blocks_for(positions, self.block_size)

    def reserve(self, slot: int, positions: int) -> bool:
        """Reserve the blocks of positions [0, positions) for the request entering `slot` (False: not enough
        unreserved blocks; nothing changes)."""
        count = self.blocks_for(positions)
        if not self.allocator.reserve(count):
            return False
        self.reserved[slot] = count
        return True

    def grow(self, lengths: list[tuple[int, int]]) -> list[int]:
        """Give each (slot, length) the blocks that hold positions [0, length); return each slot's positions held."""
        rows, cols, ids = [], [], []
        for slot, length in lengths:
            held = self.blocks[slot]
            need = self.blocks_for(length)
            if need > self.reserved[slot]:
                raise RuntimeError(f"slot {slot}: {length} positions exceed its reservation of "
                                   f"{self.reserved[slot]} blocks of {self.block_size}")
            while len(held) < need:
                rows.append(slot), cols.append(len(held))
                held.append(self.allocator.take())
                ids.append(held[-1])
        if ids:
            self.table[torch.tensor(rows), torch.tensor(cols)] = torch.tensor(ids, device=self.table.device)
        return [len(self.blocks[slot]) * self.block_size for slot, _ in lengths]

    def release(self, slots: list[int]) -> None:
        """Return the blocks and reservations of `slots` to the pool; their table rows point at the sink."""
        for slot in slots:
            self.allocator.give_back(self.blocks[slot], self.reserved[slot])
            self.blocks[slot], self.reserved[slot] = [], 0
        self.table[torch.tensor(slots, dtype=torch.long)] = 0

    def pack(self, src: list[int], dst: list[int]) -> None:
        """Move the requests of slots `src` into the released slots `dst`: their block table rows, no K/V copy."""
        src_t, dst_t = torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)
        self.table[dst_t] = self.table[src_t]
        self.table[src_t] = 0
        for s, d in zip(src, dst):
            self.blocks[d], self.reserved[d] = self.blocks[s], self.reserved[s]
            self.blocks[s], self.reserved[s] = [], 0

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy the first `length` positions of slots `src` into the blocks of slots `dst` (a shared prompt: the
        two hold the same number of blocks; entries past them are the sink on both sides)."""
        count = self.blocks_for(length)
        src_blocks, dst_blocks = self.table[src, :count].flatten(), self.table[dst, :count].flatten()
        for pool in (self.k, self.v) if self.latent is None else (self.latent,):
            pool[:, dst_blocks] = pool[:, src_blocks]

    def locate(self, slots: slice, positions: torch.Tensor, attn_len: int):
        """Per forward call: the block and offset each new token's K/V goes to ([B, T] each) and the blocks each
        row reads ([B, blocks of attn_len])."""
        table = self.table[slots]
        write_blocks = table.gather(1, torch.div(positions, self.block_size, rounding_mode="floor"))
        return write_blocks, positions % self.block_size, table[:, : self.blocks_for(attn_len)], attn_len

    def decode_mask(self, where, positions: torch.Tensor, window: int | None, tables: "ForwardTables") -> torch.Tensor:
        """A decode step's additive mask [B, blocks, 1, 1, block_size] over each row's blocks (0 or -inf): a row
        sees the positions <= its own (and, with a sliding window, > its own - window)."""
        read_blocks = where[2]
        key_pos, row = self.key_pos[: read_blocks.shape[1]], positions.view(-1, 1, 1)
        unseen = key_pos > row
        if window is not None:
            unseen |= key_pos <= row - window
        return torch.where(unseen, tables.neg_inf, tables.zero)[:, :, None, None]

    def write_and_blocks(self, layer: int, where, k_new: torch.Tensor, v_new: torch.Tensor):
        """A decode step's `write_and_gather`: each row's blocks as they are, K [B, blocks, kv_heads, head_dim,
        block_size] and V [B, blocks, kv_heads, block_size, head_dim] (one gather each, no reordering copy), for
        `_paged_decode_attention`."""
        write_blocks, offsets, read_blocks, _ = where
        k_pool, v_pool = self.k[layer], self.v[layer]
        k_pool[write_blocks, :, :, offsets] = k_new
        v_pool[write_blocks, :, offsets] = v_new
        flat = read_blocks.flatten()
        return (k_pool.index_select(0, flat).view(*read_blocks.shape, *k_pool.shape[1:]),
                v_pool.index_select(0, flat).view(*read_blocks.shape, *v_pool.shape[1:]))

    def write_latent(self, layer: int, where, entry: torch.Tensor) -> torch.Tensor:
        """`KVCache.write_latent` over the blocks: write the new tokens' entries [B, T, kv_lora_rank + rope dims] at
        their blocks and return each row's [B, attn_len, kv_lora_rank + rope dims], gathered from its blocks."""
        write_blocks, offsets, read_blocks, attn_len = where
        pool = self.latent[layer]
        pool[write_blocks, offsets] = entry
        bsz, count = read_blocks.shape
        return pool.index_select(0, read_blocks.flatten()).view(bsz, count * self.block_size, -1)[:, :attn_len]

    def write_and_gather(self, layer: int, where, k_new: torch.Tensor, v_new: torch.Tensor):
        """Write the new tokens' k_new, v_new [B, T, kv_heads, head_dim] at their blocks, and return each row's
        K [B, kv_heads, head_dim, attn_len] and V [B, kv_heads, attn_len, head_dim], gathered from its blocks."""
        write_blocks, offsets, read_blocks, attn_len = where
        k_pool, v_pool = self.k[layer], self.v[layer]
        k_pool[write_blocks, :, :, offsets] = k_new
        v_pool[write_blocks, :, offsets] = v_new
        bsz, count = read_blocks.shape
        _, heads, hd, size = k_pool.shape
        flat = read_blocks.flatten()
        k = k_pool.index_select(0, flat).view(bsz, count, heads, hd, size).permute(0, 2, 3, 1, 4)
        v = v_pool.index_select(0, flat).view(bsz, count, heads, size, hd).transpose(1, 2)
        return (k.reshape(bsz, heads, hd, count * size)[..., :attn_len],
                v.reshape(bsz, heads, count * size, hd)[:, :, :attn_len])


@dataclass(frozen=True)
class ForwardTables:
    """Per-engine constants of the forward, built once by `forward_tables`.

    Everything a decode step would otherwise rebuild per call or per layer (RoPE rotations, key
    positions, RMSNorm's eps and divisor as tensors: a Python scalar in an in-place op costs a
    tensor conversion per use on CPU).
    """

    rotation: torch.Tensor  # complex64 [max_seq_len, head_dim / 2]: cos + i*sin per (position, frequency)
    key_pos: torch.Tensor  # long [max_seq_len]: 0, 1, ...
    norm_eps: torch.Tensor  # fp32 scalar
    norm_dim: torch.Tensor  # fp32 scalar: hidden size (RMSNorm's mean divisor)
    neg_inf: torch.Tensor  # scalar -inf in the model's dtype (attention mask)
    zero: torch.Tensor  # scalar 0 in the model's dtype
    # Gemma 3: its local layers' rotations (as `rotation`), and sqrt(hidden_size) in the model's dtype
    local_rotation: torch.Tensor | None = None
    embed_scale: torch.Tensor | None = None


def forward_tables(spec: ModelSpec, max_seq_len: int, dtype: torch.dtype = torch.float32,
                   device="cpu") -> ForwardTables:
    """The forward's constants for sequences up to `max_seq_len`.

    RoPE cos and sin are computed exactly as transformers' RoPE (fp32; frequencies scaled as its rope init
    functions scale them, yarn's attention factor on cos and sin: megarl.models.convert).  HF rotates the pair
    (x[j], x[j + head_dim/2]) by the angle of frequency j; with the pair stored adjacently (q/k rows
    interleaved in `prepare_weights`) that rotation is one complex multiply.
    """
    inv_freq = convert.rope_inv_freq(spec.rope_theta, spec.rope_dim, spec.rope_scaling).to(device)
    freqs = torch.arange(max_seq_len, dtype=torch.float, device=device)[:, None] * inv_freq
    scale = convert.rope_attention_factor(spec.rope_scaling)  # yarn's: transformers scales cos and sin by it
    return ForwardTables(
        rotation=torch.complex(freqs.cos() * scale, freqs.sin() * scale),
        key_pos=torch.arange(max_seq_len, device=device),
        norm_eps=torch.tensor(spec.rms_norm_eps, dtype=torch.float, device=device),
        norm_dim=torch.tensor(spec.hidden_size, dtype=torch.float, device=device),
        neg_inf=torch.tensor(float("-inf"), dtype=dtype, device=device),
        zero=torch.tensor(0.0, dtype=dtype, device=device),
        local_rotation=_local_rotation(spec, max_seq_len, device) if spec.gemma else None,
        embed_scale=torch.tensor(spec.hidden_size ** 0.5, dtype=dtype, device=device) if spec.gemma else None,
    )


def _local_rotation(spec: ModelSpec, max_seq_len: int, device) -> torch.Tensor:
    """Gemma 3's local layers' RoPE rotations (unscaled, base local_rope_theta), as forward_tables' `rotation`."""
    inv_freq = convert.rope_inv_freq(spec.local_rope_theta, spec.head_dim, None).to(device)
    freqs = torch.arange(max_seq_len, dtype=torch.float, device=device)[:, None] * inv_freq
    return torch.complex(freqs.cos(), freqs.sin())


# Projection matrices up to this many elements are stored as contiguous [in, out] copies: at decode
# shapes MKL multiplies x @ W faster from that layout than from a transposed view of the HF [out, in]
# matrix (~25% on the embedded model).  Larger ones stay [out, in] and the forward passes their
# transposed view: a transposing copy runs at ~1 GB/s on CPU (several times a plain copy), which
# would dominate staging each version of a large model, and their matmuls are bound by reading the
# weights, not by the layout.
SMALL_MATRIX = 1 << 18


@dataclass
class LayerWeights:
    """One layer's tensors.  Each projection is held as the right operand of ``x @ W`` ([in, out]):
    a contiguous copy or a transposed view (see SMALL_MATRIX).  The RMSNorm weight in front of the
    stacked projections is folded into them (``(w * x_hat) @ W`` = ``x_hat @ (diag(w) W)``): one
    kernel less per norm, at no cost since stacking copies them anyway."""

    # [hidden, (heads + 2 * kv_heads) * head_dim]: q_proj, k_proj, v_proj stacked, input_layernorm folded
    # in, the columns of every q and k head permuted so RoPE pairs are adjacent (see `prepare_weights`).
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    # Dense: [hidden, 2 * intermediate]: gate_proj, up_proj stacked, post_attention_layernorm folded in.
    # MoE: [hidden, experts + experts * 2 * intermediate]: the router, then every expert's (w1, w3) pair,
    # post_attention_layernorm folded in (one matmul gives the router logits and every expert's gate/up).
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # MoE: [experts * intermediate, hidden], every expert's w2 stacked along its input
    down_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None = None  # Qwen3: [heads + kv_heads, head_dim] per-head RMSNorm weights (RoPE order)
    # OLMo 2 (spec.post_norms): qk_norm's rows are every head's own weights, normalised over all q / all k heads;
    # the RMSNorm weights on attention's and the MLP's outputs (nothing is folded into qkv or gate_up)
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # gpt-oss: [heads], each query head's sink logit
    expert_bias: torch.Tensor | None = None  # sigmoid-routed MoE: [experts], added to the scores that choose
    # Multi-latent attention (`_latent_attention`; qkv is then [hidden, q or q latent + kv latent + rope dims]):
    # q_b_proj as an x @ W operand (None: no q latent), the latent RMSNorm weights, and kv_b_proj split per head
    # into k_up [heads, qk_nope, kv_lora_rank] (absorbed into the query) and v_up [heads, kv_lora_rank, v_head_dim]
    # (applied to the attention's output in latent space)
    q_up: torch.Tensor | None = None
    q_latent_norm: torch.Tensor | None = None
    kv_latent_norm: torch.Tensor | None = None
    k_up: torch.Tensor | None = None
    v_up: torch.Tensor | None = None


@dataclass
class RuntimeWeights:
    """The forward's view of one weight version: views of the `WeightArena` that holds it.

    q/k/v and gate/up are stacked so a layer runs 4 matmuls instead of 7: on CPU at small batch the
    decode step is bound by the number of kernels, not by FLOPs.  Building a version writes every tensor
    into its arena once and transforms the arena in place (`WeightArena.finalize`), which is why the
    engine does it on the thread that stages the weights.
    """

    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor  # the final RMSNorm weight (not folded: the lm_head may be the embedding itself)
    lm_head: torch.Tensor  # [hidden, vocab]
    # The storage these tensors view; None once it is shared beyond its engine (a pinned engine), so it
    # is never written again for another version (megarl.sampler.engine recycles arenas).
    arena: "WeightArena | None" = field(default=None, repr=False, compare=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype


def _interleave_rope_pairs(t: torch.Tensor, heads: int, head_dim: int, rope_dim: int | None = None) -> torch.Tensor:
    """Reorder each head's rows [x_0 .. x_{d/2-1}, x_{d/2} .. x_{d-1}] to [x_0, x_{d/2}, x_1, x_{d/2+1}, ...], where d
    is `rope_dim` (default head_dim): with partial RoPE only the first d rows of a head rotate and move.

    HF's `rotate_half` RoPE rotates the pair (x_j, x_{j+d/2}); adjacent pairs are a complex number, so
    the rotation becomes one complex multiply (`_rotate`).  q and k get the same permutation, so
    every q.k dot product, and therefore attention, is unchanged.
    """
    d = head_dim if rope_dim is None else rope_dim
    per_head = t.unflatten(0, (heads, head_dim))
    rotated = per_head[:, :d].unflatten(1, (2, d // 2)).transpose(1, 2).flatten(1, 2)
    return torch.cat([rotated, per_head[:, d:]], dim=1).flatten(0, 1)


def _mm_operand(weight: torch.Tensor) -> torch.Tensor:
    """An HF [out, in] matrix as the right operand of x @ W: [in, out] (see SMALL_MATRIX)."""
    return weight.t().contiguous() if weight.numel() <= SMALL_MATRIX else weight.t()


@dataclass
class _LayerBuffers:
    """One layer's storage in a WeightArena ([out, in] HF orientation; see LayerWeights for the stacking)."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # dense: down_proj [hidden, intermediate]; MoE: the w2s as [experts * intermediate, hidden]
    down_bias: torch.Tensor | None
    input_norm: torch.Tensor | None  # (None: OLMo 2, whose norms sit after attention and the MLP)
    post_norm: torch.Tensor | None
    rope_rows: list[tuple[torch.Tensor, int]]  # (view, heads) of the q/k weights and biases whose rows RoPE pairs
    q_norm: torch.Tensor | None = None  # Qwen3: the per-head q/k RMSNorm weights [head_dim]; OLMo 2: [heads * head_dim]
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # OLMo 2's post_attention_layernorm / post_feedforward_layernorm
    mlp_out_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # gpt-oss's self_attn.sinks
    expert_bias: torch.Tensor | None = None  # a sigmoid-routed MoE layer's e_score_correction_bias
    moe: bool = False  # an MoE layer: `down` holds the stacked downs, already the x @ W operand
    # Multi-latent attention: q_b_proj (with a q latent), q_a_layernorm, kv_a_layernorm, kv_b_proj
    q_up: torch.Tensor | None = None
    q_latent_norm: torch.Tensor | None = None
    kv_latent_norm: torch.Tensor | None = None
    kv_up: torch.Tensor | None = None


class WeightArena:
    """The storage of one weight version in the forward's layout, written through HF-shaped views.

    `views[name]` is a writable view, of the HF tensor's shape, of where tensor `name` lives: the q/k/v of
    a layer are row ranges of one [q_out + 2 * kv_out, hidden] buffer, its gate/up (an MoE layer's router
    and the experts' w1/w3) row ranges of another, an MoE layer's w2s column blocks of its stacked down
    matrix (a transposed view); every other tensor has a buffer of its own.  Once every view holds its
    HF tensor (`write`, or a weight receiver writing straight into them), `finalize()` turns the buffers
    into the forward's layout in place (q/k rows RoPE-interleaved, the RMSNorm weights folded into the
    stacked matrices) and returns the RuntimeWeights that view them.  A version thus costs one copy of the
    weights and nothing more (only matrices under SMALL_MATRIX get a second, transposed copy), and an
    engine can reuse a replaced version's arena for the next one.  After `finalize` the views hold the
    forward's layout, not the HF tensors: the next version must write every view again.
    """

    def __init__(self, spec: ModelSpec, dtypes: dict[str, torch.dtype], device="cpu"):
        shapes = spec.weight_shapes()
        self.spec, self.views = spec, {}

        def stack(names: list[str]) -> torch.Tensor:
            """One buffer holding the tensors `names` as consecutive row ranges (dtype of the first)."""
            rows = [shapes[n][0] for n in names]
            buffer = torch.empty((sum(rows), *shapes[names[0]][1:]), dtype=dtypes[names[0]], device=device)
            for name, start, count in zip(names, [sum(rows[:i]) for i in range(len(rows))], rows):
                self.views[name] = buffer[start:start + count]
            return buffer

        def own(name: str) -> torch.Tensor | None:
            if name not in shapes:
                return None
            self.views[name] = torch.empty(shapes[name], dtype=dtypes[name], device=device)
            return self.views[name]

        self.layers: list[_LayerBuffers] = []
        for layer in range(spec.num_layers):
            p = f"model.layers.{layer}."
            attn, mlp = p + "self_attn.", p + "mlp."
            qkv = [attn + f"{x}_proj.weight" for x in "qkv"]
            qkv_bias = [attn + f"{x}_proj.bias" for x in "qkv"] if spec.qkv_bias else []
            if spec.latent:  # the projections from the hidden state: q (or its latent), then the kv latent and rope
                qkv = [attn + ("q_proj.weight" if spec.q_lora_rank is None else "q_a_proj.weight"),
                       attn + "kv_a_proj_with_mqa.weight"]
                qkv_buffer = stack(qkv)  # (its RoPE dims are interleaved pairs already: rope_rows stays empty)
            elif spec.fused_projections:  # (Phi-3: no biases) one HF tensor is the whole stacked buffer
                qkv_buffer = own(attn + "qkv_proj.weight")
                q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
                q_view, k_view = qkv_buffer[:q_rows], qkv_buffer[q_rows:q_rows + kv_rows]
            else:
                qkv_buffer = stack(qkv)
                q_view, k_view = self.views[qkv[0]], self.views[qkv[1]]
            gate_up_bias = down_bias = None
            if spec.gpt_oss:  # its fused experts (moe.GPT_OSS_EXPERTS) are views of the stacked buffers
                gate_up, gate_up_bias, down = self._gpt_oss_experts(mlp, dtypes, device)
                down_bias = own(mlp + "experts.down_proj_bias")
            elif spec.is_moe_layer(layer):  # the expert names of models/moe.py
                experts = [moe.hf_expert_names(spec._hf_config, layer, e) for e in range(spec.num_experts)]
                # (sigmoid-routed: the shared expert's gate and up rows after the router's, its down first)
                shared = [mlp + f"{moe.SHARED_EXPERT}.{x}_proj.weight" for x in ("gate", "up", "down")
                          ] if spec.sigmoid_router else []
                gate_up = stack([moe.hf_router_name(spec._hf_config, layer)] + shared[:2]
                                + [name for gate, up, _ in experts for name in (gate, up)])
                i, s = spec.intermediate_size, spec.shared_ffn_size
                down = torch.empty((s + spec.num_experts * i, spec.hidden_size), dtype=dtypes[experts[0][2]],
                                   device=device)
                if shared:
                    self.views[shared[2]] = down[:s].t()
                for e, (_, _, down_name) in enumerate(experts):
                    # down_e [hidden, i] is rows s+e*i.. of the stacked [s + E * i, hidden], transposed
                    self.views[down_name] = down[s + e * i:s + (e + 1) * i].t()
            else:
                gate_up = own(mlp + "gate_up_proj.weight") if spec.fused_projections else stack(
                    [mlp + "gate_proj.weight", mlp + "up_proj.weight"])
                down = own(mlp + "down_proj.weight")
                if spec.mlp_bias:
                    gate_up_bias = stack([mlp + "gate_proj.bias", mlp + "up_proj.bias"])
                down_bias = own(mlp + "down_proj.bias")
            self.layers.append(_LayerBuffers(
                qkv=qkv_buffer, qkv_bias=stack(qkv_bias) if qkv_bias else None,
                o_proj=own(attn + "o_proj.weight"), o_bias=own(attn + "o_proj.bias"),
                gate_up=gate_up, gate_up_bias=gate_up_bias, down=down, down_bias=down_bias,
                input_norm=None if spec.post_norms else own(p + "input_layernorm.weight"),
                # (Gemma 3: the norm in front of the MLP is pre_feedforward_layernorm)
                post_norm=None if spec.post_norms else own(p + ("pre_feedforward_layernorm.weight" if spec.gemma
                                                                else "post_attention_layernorm.weight")),
                attn_out_norm=own(p + "post_attention_layernorm.weight") if spec.post_norms or spec.gemma else None,
                mlp_out_norm=own(p + "post_feedforward_layernorm.weight") if spec.post_norms or spec.gemma else None,
                rope_rows=[] if spec.latent else list(zip([q_view, k_view, *(self.views[n] for n in qkv_bias[:2])],
                                                          [spec.num_heads, spec.num_kv_heads] * 2)),
                q_up=own(attn + "q_b_proj.weight"), q_latent_norm=own(attn + "q_a_layernorm.weight"),
                kv_latent_norm=own(attn + "kv_a_layernorm.weight"), kv_up=own(attn + "kv_b_proj.weight"),
                q_norm=own(attn + "q_norm.weight") if spec.qk_norm else None,
                k_norm=own(attn + "k_norm.weight") if spec.qk_norm else None,
                sinks=own(attn + "sinks"), expert_bias=own(mlp + moe.EXPERT_BIAS[0]),
                moe=spec.is_moe_layer(layer)))
        for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            own(name)
        missing = set(shapes) - set(self.views)
        if missing:  # a tensor of the spec this layout does not place: a model type added without its arena
            raise ValueError(f"WeightArena: no place for {sorted(missing)[:3]} ({spec.model_type})")

    def _gpt_oss_experts(self, mlp: str, dtypes: dict[str, torch.dtype], device):
        """One gpt-oss layer's router and experts in the layout the other MoE families have: (the stacked
        [E + E * 2I, hidden] router and gate/up rows, [out, in] as HF's linears; its bias [E + E * 2I]; the stacked
        downs [E * I, hidden]). The fused HF tensors, x @ W oriented, are views of them: gate_up_proj [E, H, 2I] is
        the transposed [E, 2I, H] rows (gate and up stay interleaved: the forward reads them so), down_proj [E, I, H]
        the downs as they are."""
        spec = self.spec
        e, i, h = spec.num_experts, spec.intermediate_size, spec.hidden_size
        rows = torch.empty((e + e * 2 * i, h), dtype=dtypes[mlp + "experts.gate_up_proj"], device=device)
        bias = torch.empty(e + e * 2 * i, dtype=dtypes[mlp + "experts.gate_up_proj_bias"], device=device)
        down = torch.empty((e * i, h), dtype=dtypes[mlp + "experts.down_proj"], device=device)
        self.views.update({
            mlp + "router.weight": rows[:e], mlp + "experts.gate_up_proj": rows[e:].view(e, 2 * i, h).transpose(1, 2),
            mlp + "router.bias": bias[:e], mlp + "experts.gate_up_proj_bias": bias[e:].view(e, 2 * i),
            mlp + "experts.down_proj": down.view(e, i, h)})
        return rows, bias, down

    def write(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy an HF-named state dict (every tensor of the spec, any device; cast to the arena's dtypes)
        into the views."""
        for name, tensor in weights.items():
            self.views[name].copy_(tensor)

    def _qk_norm(self, q_norm: torch.Tensor, k_norm: torch.Tensor) -> torch.Tensor:
        """[heads + kv_heads, head_dim]: q_norm's weight for every query head, k_norm's for every key head, in
        the RoPE-interleaved order of their rows (an RMSNorm's mean is unchanged by the permutation); small,
        so a tensor of its own rather than a view."""
        spec, hd = self.spec, self.spec.head_dim
        if spec.post_norms:  # OLMo 2: a weight per head and dim already ([heads * head_dim])
            return torch.cat([_interleave_rope_pairs(q_norm, spec.num_heads, hd).view(spec.num_heads, hd),
                              _interleave_rope_pairs(k_norm, spec.num_kv_heads, hd).view(spec.num_kv_heads, hd)])
        q, k = (_interleave_rope_pairs(n, 1, hd, spec.rope_dim) for n in (q_norm, k_norm))
        if spec.gemma:  # (1 + weight) in fp32, as transformers' Gemma3RMSNorm
            q, k = 1 + q.float(), 1 + k.float()
        return torch.cat([q.expand(spec.num_heads, hd), k.expand(spec.num_kv_heads, hd)])

    def _latent_weights(self, b: _LayerBuffers) -> dict:
        """A multi-latent attention layer's LayerWeights fields (views of its buffers; v_up a contiguous copy when
        small, as SMALL_MATRIX's matrices: the attention's output multiplies it from the left)."""
        spec = self.spec
        per_head = b.kv_up.view(spec.num_heads, spec.qk_nope_dim + spec.v_head_dim, spec.kv_lora_rank)
        v_up = per_head[:, spec.qk_nope_dim:].transpose(1, 2)
        return dict(q_up=None if b.q_up is None else _mm_operand(b.q_up), q_latent_norm=b.q_latent_norm,
                    kv_latent_norm=b.kv_latent_norm, k_up=per_head[:, :spec.qk_nope_dim],
                    v_up=v_up.contiguous() if v_up.numel() <= SMALL_MATRIX else v_up)

    def finalize(self) -> RuntimeWeights:
        """The forward's RuntimeWeights, made in place from the HF tensors the views hold (see the class)."""
        spec, hd = self.spec, self.spec.head_dim
        layers = []
        for b in self.layers:
            for view, heads in b.rope_rows:
                view.copy_(_interleave_rope_pairs(view.clone(), heads, hd, spec.rope_dim))  # a permutation: from a copy
            if spec.gemma:  # its norms are (1 + weight), taken in fp32; the ones after the blocks stay fp32
                b.qkv.mul_(1 + b.input_norm.float())
                b.gate_up.mul_(1 + b.post_norm.float())
            elif not spec.post_norms:  # (OLMo 2 has no norm in front of the projections)
                b.qkv.mul_(b.input_norm)  # (w * x_hat) @ W = x_hat @ (diag(w) W): the norm's weight rides in W
                b.gate_up.mul_(b.post_norm)
            layers.append(LayerWeights(
                qkv=_mm_operand(b.qkv), qkv_bias=b.qkv_bias, o_proj=_mm_operand(b.o_proj), o_bias=b.o_bias,
                gate_up=_mm_operand(b.gate_up), gate_up_bias=b.gate_up_bias,
                down=b.down if b.moe else _mm_operand(b.down), down_bias=b.down_bias,
                qk_norm=None if b.q_norm is None else self._qk_norm(b.q_norm, b.k_norm),
                attn_out_norm=_gemma_weight(b.attn_out_norm) if spec.gemma else b.attn_out_norm,
                mlp_out_norm=_gemma_weight(b.mlp_out_norm) if spec.gemma else b.mlp_out_norm, sinks=b.sinks,
                expert_bias=b.expert_bias, **(self._latent_weights(b) if spec.latent else {})))
        embed, norm = self.views["model.embed_tokens.weight"], self.views["model.norm.weight"]
        return RuntimeWeights(embed=embed, layers=layers, norm=_gemma_weight(norm) if spec.gemma else norm,
                              lm_head=_mm_operand(embed if spec.tie_word_embeddings else self.views["lm_head.weight"]),
                              arena=self)


def _gemma_weight(weight: torch.Tensor) -> torch.Tensor:
    """What a Gemma 3 RMSNorm multiplies by: 1 + weight, in fp32 (a small tensor of its own)."""
    return 1 + weight.float()


def prepare_weights(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> RuntimeWeights:
    """Check an HF-named state dict against the spec and build the forward's RuntimeWeights (a copy, in a
    new WeightArena on the tensors' device)."""
    spec.check_weights(weights)
    arena = WeightArena(spec, {name: t.dtype for name, t in weights.items()},
                        weights["model.embed_tokens.weight"].device)
    arena.write(weights)
    return arena.finalize()


def _rotate(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """RoPE: rotate x [N, heads, head_dim] (pairs interleaved) by complex rot [N, 1, rope_dim / 2], in fp32; with
    partial RoPE (rope_dim < head_dim) the dims past rope_dim pass unrotated."""
    rope_dim = 2 * rot.shape[-1]
    if rope_dim < x.shape[-1]:
        return torch.cat([_rotate(x[..., :rope_dim], rot), x[..., rope_dim:]], dim=-1)
    fp32 = x.dtype == torch.float32
    pairs = torch.view_as_complex((x if fp32 else x.float()).unflatten(-1, (-1, 2)))
    out = torch.view_as_real(pairs * rot).flatten(-2)
    return out if fp32 else out.to(x.dtype)


def _rms_norm(x: torch.Tensor, tables: ForwardTables) -> torch.Tensor:
    """HF's RMSNorm without its weight (folded into the next matmul, or applied by the caller):
    x * rsqrt(mean(x^2) + eps) in fp32.  Written out because on CPU F.rms_norm runs ~10 small kernels (dtype round trips
    included); this is 5 for fp32 input."""
    fp32 = x.dtype == torch.float32
    h = x if fp32 else x.float()
    mean_sq = torch.addcdiv(tables.norm_eps, (h * h).sum(-1, keepdim=True), tables.norm_dim)  # eps + sum / dim
    out = h * mean_sq.rsqrt_()
    return out if fp32 else out.to(x.dtype)


def _head_rms_norm(x: torch.Tensor, weight: torch.Tensor, tables: ForwardTables) -> torch.Tensor:
    """Qwen3's per-head q/k RMSNorm of x [N, heads, head_dim] as transformers computes it: normalised in fp32,
    cast back, times the weight [heads, head_dim]."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + tables.norm_eps)
    return weight * h.to(x.dtype)


def _projection_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """OLMo 2's q or k norm of x [N, heads, head_dim] as transformers computes it on the [N, heads * head_dim]
    projection: normalised over every head at once in fp32, times the weight [heads, head_dim], cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean((-2, -1), keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def _gemma_norm(x: torch.Tensor, weight: torch.Tensor, tables: ForwardTables) -> torch.Tensor:
    """transformers' Gemma3RMSNorm of x [..., dim]: normalised in fp32, times the fp32 (1 + weight), cast back."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + tables.norm_eps) * weight).to(x.dtype)


def _linear(h: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(h, weight_t) if bias is None else torch.addmm(bias, h, weight_t)


def _add_linear(x: torch.Tensor, h: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x + linear(h): the residual add rides in the matmul's accumulate (one kernel)."""
    out = torch.addmm(x, h, weight_t)
    return out if bias is None else out.add_(bias)


def _add_row_parallel(x: torch.Tensor, h: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None,
                      tp_group) -> torch.Tensor:
    """x + linear(h) for a row-parallel layer: each rank multiplies its slice of the input features,
    the partial products are summed over `tp_group`, then the bias (whole on every rank) and the
    residual are added once.  The all-reduce leaves the same bits on every rank, so the replicated
    rest of the forward stays identical across ranks.  It waits as long as the group's own timeout."""
    out = torch.mm(h, weight_t)
    dist.all_reduce(out, group=tp_group)
    out = out.add_(x)
    return out if bias is None else out.add_(bias)


def _embed(ids: torch.Tensor, embed: torch.Tensor, spec: ModelSpec, tp_group) -> torch.Tensor:
    """Embedding rows of `ids`; vocab-parallel with a tp_group: each rank looks up the ids in its
    range, zeros the others, and the sum over the group is every id's row (exactly: one non-zero term)."""
    if tp_group is None:
        return F.embedding(ids, embed)
    local = ids - tp_group.rank() * spec.shard_vocab
    outside = (local < 0) | (local >= spec.shard_vocab)
    x = F.embedding(local.clamp(0, spec.shard_vocab - 1), embed).masked_fill_(outside[:, None], 0.0)
    dist.all_reduce(x, group=tp_group)
    return x


def _lm_head(h: torch.Tensor, lm_head: torch.Tensor, tp_group) -> torch.Tensor:
    """Logits of h over the whole vocabulary; vocab-parallel with a tp_group: each rank computes its
    vocab slice and the slices are gathered in rank order, so every rank gets the same logits."""
    logits = torch.mm(h, lm_head)
    if tp_group is None:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp_group.size())]
    dist.all_gather(parts, logits, group=tp_group)
    return torch.cat(parts, dim=-1)


def forward(
    spec: ModelSpec,
    weights: RuntimeWeights,
    tables: ForwardTables,
    cache: KVCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    *,
    slot_start: int = 0,
    attn_len: int | None = None,
    logit_index: torch.Tensor | None = None,
    tp_group=None,
    routes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run B rows of T tokens through the decoder, writing their K/V into the cache.

    input_ids, positions: long [B, T]; row b lives in cache slot ``slot_start + b`` and its tokens sit
    at ``positions[b]`` (contiguous and increasing; right padding may repeat or run past the sequence,
    its K/V land beyond the sequence's end and are overwritten before they are ever attended to).
    Each query attends to cache positions ``<= its position`` of its own slot, so all earlier
    positions of that slot must already be in the cache.
    tables: `forward_tables(spec, >= max(positions) + 1)`.
    attn_len: how many cache positions to look at (>= max(positions) + 1); default max_seq_len.
    logit_index: long [B]; if given, return logits [B, V] of token ``logit_index[b]`` of each row only
    (prefill needs just the last one), else logits [B, T, V].  An index outside [0, T) (a chunk of a prefill that
    a row ends before or after) takes the nearest token's logits, which the caller does not use.  Logits are in
    the weights' dtype.
    tp_group: for a `ModelSpec.shard` spec, the process group of the spec's tp_size ranks (each with
    its own slices, cache and the same inputs); every rank of it must call forward with the same
    inputs, and every rank gets the same logits.
    routes: for an MoE spec, an integer tensor [B, T, num_layers, top_k] (a view is fine) that receives
    each token's chosen experts per layer, in the router's top-k order; ignored for a dense spec.

    The residual stream is kept as [B*T, hidden] so every projection is a plain 2-D matmul.
    """
    if (1 if tp_group is None else tp_group.size()) != spec.tp_size:
        raise ValueError(f"forward: a spec of tp_size={spec.tp_size} needs a tensor-parallel group of that size, "
                         f"got {'none' if tp_group is None else tp_group.size()}")
    bsz, seq = input_ids.shape
    nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    if spec.latent:  # (the masks': every query head attends to the one latent each position caches)
        nkv = 1
    group, tokens = nh // nkv, bsz * seq
    attn_len = cache.max_seq_len if attn_len is None else attn_len
    slots = slice(slot_start, slot_start + bsz)

    x = _embed(input_ids.reshape(tokens), weights.embed, spec, tp_group)
    if spec.gemma:
        x = x * tables.embed_scale
    rot = tables.rotation[positions.reshape(tokens)][:, None]  # [B*T, 1, hd/2], broadcast over heads
    local_rot = None if tables.local_rotation is None else tables.local_rotation[positions.reshape(tokens)][:, None]
    paged = isinstance(cache, PagedKVCache)
    where = cache.locate(slots, positions, attn_len)
    if not paged:
        # Scatter indices along the position dim of a layer's K [B, kv_heads, hd, S] and V [B, kv_heads, S, hd].
        k_idx = positions.view(bsz, 1, 1, seq).expand(bsz, nkv, hd, seq)
        v_idx = positions.view(bsz, 1, seq, 1).expand(bsz, nkv, seq, hd)
    key_pos = tables.key_pos[:attn_len]

    def attention_mask(window: int | None) -> torch.Tensor:
        if seq == 1 and paged and not spec.latent:  # (a latent decode reads its blocks gathered, as below)
            return cache.decode_mask(where, positions, window, tables)
        if seq == 1:
            # Decode: an additive mask [B*kv_heads, 1, L] (0 or -inf), read by baddbmm.
            row_pos = positions.expand(bsz, nkv).reshape(bsz * nkv, 1, 1)
            unseen = key_pos > row_pos
            if window is not None:  # (the cache keeps every position; the window only hides the old ones)
                unseen |= key_pos <= row_pos - window
            return torch.where(unseen, tables.neg_inf, tables.zero)
        # Prefill: boolean SDPA mask, True = attend: causal per row, over that row's own cache slot.
        allowed = (key_pos[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [B, 1, T, attn_len]
        if window is not None:
            allowed &= (key_pos[None, None, :] > positions[:, :, None] - window).unsqueeze(1)
        return allowed.repeat(1, 1, group, 1) if group > 1 else allowed

    # (Gemma 3: its global layers attend to every position, its local ones to the window)
    mask = attention_mask(None if spec.gemma else spec.sliding_window)
    local_mask = attention_mask(spec.sliding_window) if spec.gemma and any(spec.local_layers) else None
    # (gpt-oss: one mask per distinct window of its layers, each layer its own)
    window_masks = None if spec.layer_windows is None else {
        w: mask if w is None else attention_mask(w) for w in set(spec.layer_windows)}

    for layer, lw in enumerate(weights.layers):
        h = x if spec.post_norms else _rms_norm(x, tables)
        if spec.latent:
            attn = _latent_attention(spec, lw, _linear(h, lw.qkv, None), rot,
                                     lambda entry: cache.write_latent(layer, where, entry), positions, mask, tables)
        else:
            qkv = _linear(h, lw.qkv, lw.qkv_bias).view(tokens, nh + 2 * nkv, hd)
            qk = qkv[:, : nh + nkv]
            if spec.post_norms:  # (OLMo 2: q over all its heads, k over all its heads)
                qk = torch.cat([_projection_rms_norm(qk[:, :nh], lw.qk_norm[:nh], tables.norm_eps),
                                _projection_rms_norm(qk[:, nh:], lw.qk_norm[nh:], tables.norm_eps)], dim=1)
            elif spec.gemma:
                qk = _gemma_norm(qk, lw.qk_norm, tables)
            elif lw.qk_norm is not None:
                qk = _head_rms_norm(qk, lw.qk_norm, tables)
            local = spec.gemma and spec.local_layers[layer]
            if local:
                qk = _rotate(qk, local_rot)
            elif spec.rope_layers is None or spec.rope_layers[layer]:  # (a layer without RoPE attends unrotated)
                qk = _rotate(qk, rot)
            k_new, v_new = qk[:, nh:].view(bsz, seq, nkv, hd), qkv[:, nh + nkv:].view(bsz, seq, nkv, hd)
            layer_mask = window_masks[spec.layer_windows[layer]] if window_masks else local_mask if local else mask
            if paged and seq == 1:
                k_blocks, v_blocks = cache.write_and_blocks(layer, where, k_new, v_new)
                attn = _paged_decode_attention(qk[:, :nh].view(bsz, nkv, group, hd), k_blocks, v_blocks, layer_mask,
                                               spec.attn_scale, lw.sinks)
            else:
                if paged:
                    k_span, v_span = cache.write_and_gather(layer, where, k_new, v_new)
                else:
                    k_cache, v_cache = cache.k[layer, slots], cache.v[layer, slots]  # views: writes land in the cache
                    k_cache.scatter_(3, k_idx, k_new.permute(0, 2, 3, 1))
                    v_cache.scatter_(2, v_idx, v_new.transpose(1, 2))
                    k_span, v_span = k_cache[..., :attn_len], v_cache[:, :, :attn_len]
                attn = _attention(qk[:, :nh].view(bsz, seq, nh, hd), k_span, v_span, layer_mask, group, spec.attn_scale,
                                  lw.sinks)
        if spec.gemma:  # the norm between o_proj (summed over TP) and the residual add
            out = _linear(attn, lw.o_proj, lw.o_bias)
            if tp_group is not None:
                dist.all_reduce(out, group=tp_group)
            x = x + _gemma_norm(out, lw.attn_out_norm, tables)
        elif spec.post_norms:  # OLMo 2 (at sampler.tp = 1): the norm between o_proj and the residual add
            x = x + _rms_norm(_linear(attn, lw.o_proj, lw.o_bias), tables) * lw.attn_out_norm
        elif tp_group is None:
            x = _add_linear(x, attn, lw.o_proj, lw.o_bias)
        else:
            x = _add_row_parallel(x, attn, lw.o_proj, lw.o_bias, tp_group)

        h = x if spec.post_norms else _rms_norm(x, tables)
        if spec.is_moe_layer(layer):
            share = None
            if spec.gpt_oss:
                chosen, act, share = _gpt_oss_experts(spec, _linear(h, lw.gate_up, lw.gate_up_bias))
            elif spec.sigmoid_router:
                chosen, act = _sigmoid_routed_experts(spec, _linear(h, lw.gate_up, None), lw.expert_bias)
            else:
                chosen, act = _moe_experts(spec, _linear(h, lw.gate_up, None))
            if routes is not None:  # (route index: the layer's index among the MoE layers)
                routes[:, :, layer - spec.dense_layers] = chosen.view(bsz, seq, spec.top_k)
            # Under TP each rank holds 1/t of every expert's width and the whole router (the same routes on
            # every rank): its stacked downs give a partial sum of the layer's output, summed once as the dense MLP's.
            if tp_group is None:
                x = _add_linear(x, act, lw.down, None)
            else:
                x = _add_row_parallel(x, act, lw.down, None, tp_group)
            if share is not None:  # (gpt-oss, at sampler.tp = 1) each chosen expert's down bias, times its share
                x = x.addmm_(share, lw.down_bias)
            continue
        gate, up = _linear(h, lw.gate_up, lw.gate_up_bias).chunk(2, dim=-1)
        if spec.gemma:  # GeGLU, then the norm between down_proj (summed over TP) and the residual add
            out = _linear(F.gelu(gate, approximate="tanh") * up, lw.down, lw.down_bias)
            if tp_group is not None:
                dist.all_reduce(out, group=tp_group)
            x = x + _gemma_norm(out, lw.mlp_out_norm, tables)
        elif spec.post_norms:
            x = x + _rms_norm(_linear(F.silu(gate) * up, lw.down, lw.down_bias), tables) * lw.mlp_out_norm
        elif tp_group is None:
            x = _add_linear(x, F.silu(gate) * up, lw.down, lw.down_bias)
        else:
            x = _add_row_parallel(x, F.silu(gate) * up, lw.down, lw.down_bias, tp_group)

    if logit_index is not None:
        x = x.view(bsz, seq, -1)[torch.arange(bsz, device=x.device), logit_index.clamp(0, seq - 1)]
    final = _gemma_norm(x, weights.norm, tables) if spec.gemma else _rms_norm(x, tables) * weights.norm
    logits = _lm_head(final, weights.lm_head, tp_group)
    return logits if logit_index is not None else logits.view(bsz, seq, -1)


def _moe_experts(spec: ModelSpec, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing over one layer's fused projection [N, E + E * 2 * i] (router logits, then each
    expert's gate and up).  Returns (the chosen experts [N, k] in top-k order, the weighted expert
    activations [N, E * i], the input of the stacked downs).

    As transformers' MixtralTopKRouter / Qwen3MoeTopKRouter: softmax over the logits in fp32, top-k of the
    probabilities, renormalised over the k (Mixtral; Qwen3-MoE with norm_topk_prob); an expert's SwiGLU
    activation is scaled by its share (zero off the k)."""
    experts, tokens = spec.num_experts, projected.shape[0]
    probs = torch.softmax(projected[:, :experts].float(), dim=-1)
    top_probs, chosen = torch.topk(probs, spec.top_k, dim=-1)
    if spec.norm_topk:
        top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
    share = torch.zeros_like(probs).scatter_(1, chosen, top_probs)
    gate_up = projected[:, experts:].view(tokens, experts, 2, spec.intermediate_size)
    act = F.silu(gate_up[:, :, 0]) * gate_up[:, :, 1] * share.to(projected.dtype)[:, :, None]
    return chosen, act.view(tokens, experts * spec.intermediate_size)


def _sigmoid_routed_experts(spec: ModelSpec, projected: torch.Tensor,
                            expert_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sigmoid-routed MoE layer's routing over its fused projection [N, E + 2 * S + E * 2 * I] (router logits, the
    shared expert's gate and up, then each expert's gate and up). Returns (the chosen experts [N, k], in descending
    order of their biased scores; the activations [N, S + E * I] of the shared expert and of every expert weighted by
    its share, the input of the stacked downs).

    As transformers' Glm4MoeTopkRouter / DeepseekV3TopkRouter: sigmoid of the fp32 logits; the choice is made on
    the scores plus e_score_correction_bias, among the experts of the `topk_group` groups (of `n_group`) whose best
    two biased scores sum highest; the chosen experts are weighted by their unbiased scores, renormalised to sum to 1
    (norm_topk, + 1e-20 as transformers) and times routed_scaling_factor. (transformers' top-k is unsorted, so its
    order is no contract: the routes are a set per layer, as megarl.algo.metrics.route_matches reads them.)"""
    experts, tokens, s = spec.num_experts, projected.shape[0], spec.shared_ffn_size
    scores = projected[:, :experts].float().sigmoid()
    choice = scores + expert_bias.float()
    if spec.topk_group < spec.n_group:
        group_scores = choice.view(tokens, spec.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
            1, group_scores.topk(spec.topk_group, dim=-1)[1], True)
        choice = choice.masked_fill(~kept.repeat_interleave(experts // spec.n_group, dim=1), float("-inf"))
    chosen = choice.topk(spec.top_k, dim=-1)[1]
    weights = scores.gather(1, chosen)
    if spec.norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    share = torch.zeros_like(scores).scatter_(1, chosen, weights * spec.routed_scaling)
    shared_gate, shared_up = projected[:, experts:experts + 2 * s].chunk(2, dim=-1)
    gate_up = projected[:, experts + 2 * s:].view(tokens, experts, 2, spec.intermediate_size)
    act = F.silu(gate_up[:, :, 0]) * gate_up[:, :, 1] * share.to(projected.dtype)[:, :, None]
    return chosen, torch.cat([F.silu(shared_gate) * shared_up, act.view(tokens, -1)], dim=1)


def _gpt_oss_experts(spec: ModelSpec, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gpt-oss's routing over one layer's fused, biased projection [N, E + E * 2I] (router logits, then each
    expert's gate/up columns interleaved: gate even, up odd). Returns (the chosen experts [N, k] in top-k order, the
    weighted expert activations [N, E * I], each expert's share [N, E], which weighs its down bias).

    As transformers' GptOssTopKRouter and GptOssExperts: top-k of the biased logits, softmax over those k; gate
    clamped above at swiglu_limit, up to +-swiglu_limit, (up + 1) * gate * sigmoid(alpha * gate), the expert's
    output (and its down bias) scaled by its share (zero off the k)."""
    experts, tokens, limit = spec.num_experts, projected.shape[0], spec.swiglu_limit
    logits = projected[:, :experts]
    top, chosen = torch.topk(logits, spec.top_k, dim=-1)
    share = torch.zeros_like(logits).scatter_(1, chosen, torch.softmax(top.float(), dim=-1).to(logits.dtype))
    gate_up = projected[:, experts:].view(tokens, experts, spec.intermediate_size, 2)
    gate, up = gate_up[..., 0].clamp(max=limit), gate_up[..., 1].clamp(-limit, limit)
    act = (up + 1) * (gate * torch.sigmoid(gate * spec.swiglu_alpha)) * share[:, :, None]
    return chosen, act.view(tokens, experts * spec.intermediate_size), share


def _latent_attention(spec: ModelSpec, lw: LayerWeights, down: torch.Tensor, rot: torch.Tensor, store,
                      positions: torch.Tensor, mask: torch.Tensor, tables: ForwardTables) -> torch.Tensor:
    """Multi-latent attention of B rows of T tokens, absorbed: the cache holds per position the kv latent c (after
    kv_a_layernorm) and the shared key's RoPE dims k_rot, never per-head K or V.

    down [B*T, q (or q latent) + kv_lora_rank + rope]: the layer's first projection of the normed hidden state (input
    norm folded in); store(entries [B, T, kv_lora_rank + rope]) writes the new positions' entries into the cache and
    returns the rows' [B, attn_len, kv_lora_rank + rope] (the layer's `write_latent`, either layout).
    Head h's score of position p is q_nope_h . (W_UK_h c_p) + q_rot_h . k_rot_p = [q_nope_h W_UK_h | q_rot_h] .
    [c_p | k_rot_p]: the query taken into latent space attends to the cached latent directly, one "KV head" shared
    by every head (mask: nkv 1, group heads); its output in latent space, sum_p prob_p c_p, times W_UV_h is head h's
    value sum. Scale: transformers' (spec.attn_scale, yarn_apply_mscale). RoPE: DeepSeek-V3's interleaved pairs are
    the complex pairs `_rotate` rotates, in place (the same permutation of q and k as transformers' de-interleaving,
    so the same dot products). Returns [B*T, heads * v_head_dim]."""
    bsz, seq = positions.shape
    tokens, nh, r, dr, dn = bsz * seq, spec.num_heads, spec.kv_lora_rank, spec.head_dim, spec.qk_nope_dim
    q_width = down.shape[1] - r - dr
    q = down[:, :q_width]
    if lw.q_up is not None:
        q = torch.mm(_head_rms_norm(q, lw.q_latent_norm, tables), lw.q_up)
    q = q.view(tokens, nh, dn + dr)
    # (the RoPE dims copied out of their rows: a complex view needs an even offset and strides, whatever the widths)
    entry = torch.cat([_head_rms_norm(down[:, q_width:q_width + r], lw.kv_latent_norm, tables),
                       _rotate(down[:, None, q_width + r:].contiguous(), rot)[:, 0]], dim=-1)
    span = store(entry.view(bsz, seq, r + dr))
    q_latent = torch.bmm(q[:, :, :dn].transpose(0, 1), lw.k_up).transpose(0, 1)  # [B*T, heads, r]
    query = torch.cat([q_latent, _rotate(q[:, :, dn:].contiguous(), rot)], dim=-1)  # [B*T, heads, r + rope]
    if seq == 1:  # decode: [B, heads, r + rope] against [B, attn_len, r + rope], the additive mask [B, 1, L]
        scores = torch.baddbmm(mask, query.view(bsz, nh, r + dr), span.transpose(1, 2), alpha=spec.attn_scale)
        out = torch.bmm(torch.softmax(scores, dim=-1), span[:, :, :r])  # [B, heads, r]
    else:  # prefill: rows (head, position) of one "KV head", the boolean mask [B, 1, heads * T, L]
        query = query.view(bsz, seq, nh, r + dr).transpose(1, 2).reshape(bsz, 1, nh * seq, r + dr)
        out = F.scaled_dot_product_attention(query, span[:, None], span[:, None, :, :r], attn_mask=mask,
                                             scale=spec.attn_scale)
        out = out.view(bsz, nh, seq, r).transpose(1, 2)
    values = torch.bmm(out.reshape(tokens, nh, r).transpose(0, 1), lw.v_up)  # [heads, B*T, v_head_dim]
    return values.transpose(0, 1).reshape(tokens, nh * spec.v_head_dim)


def _with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of `scores` with one more logit per row, its head's sink ([..., 1], broadcast over
    the rest), which takes its share of the probability mass and adds no value (transformers' gpt-oss eager
    attention: the sink's column dropped after the softmax)."""
    combined = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(combined, dim=-1)[..., :-1]


def _paged_decode_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                            mask: torch.Tensor, scale: float | None = None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's attention over each row's KV blocks as the pool holds them: q [B, kv_heads, group, hd]
    against k_blocks [B, blocks, kv_heads, hd, block_size] and v_blocks [B, blocks, kv_heads, block_size, hd], with
    the additive mask [B, blocks, 1, 1, block_size].  Returns [B, heads*hd].

    Scores per block (one batched matmul, q broadcast over the blocks), one softmax over all of a row's blocks
    (only the small score tensor is reordered), p @ V per block, summed over the blocks: no copy of K or V beyond
    the gather of the blocks, which is what made gathering them into `_attention`'s contiguous operand slower.
    The sum over blocks is another summation order than `_attention`'s one matmul: equal within fp32 rounding.
    scale: the scores' scale (default head_dim ** -0.5; a family with its own attention scale passes it).
    sinks: gpt-oss's sink logit per query head [heads] (`_with_sinks`), or None."""
    bsz, count, nkv, hd, size = k_blocks.shape
    group = q.shape[2]
    scale = hd ** -0.5 if scale is None else scale
    scores = torch.matmul(q[:, None], k_blocks).mul_(scale).add_(mask)  # [B, blocks, kv_heads, group, size]
    scores = scores.permute(0, 2, 3, 1, 4).reshape(bsz, nkv, group, count * size)
    probs = torch.softmax(scores, dim=-1) if sinks is None else _with_sinks(scores, sinks.view(nkv, group, 1))
    probs = probs.reshape(bsz, nkv, group, count, size).permute(0, 3, 1, 2, 4)
    return torch.matmul(probs, v_blocks).sum(1).view(bsz, nkv * group * hd)


def _attention(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, group: int,
               scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, T, heads, hd] against the cache's k_t [B, kv_heads, hd, L] and v [B, kv_heads, L, hd].

    Returns [B*T, heads*hd].  GQA without repeating K/V: the `group` query heads that share a KV head
    are folded into the query-length dim ([B, kv_heads, group*T, hd]).  Decode (T = 1) uses two
    batched matmuls around a softmax, the additive mask riding in the first (baddbmm); at one query
    row per head SDPA's CPU kernel costs several times that.  Prefill uses SDPA with the boolean mask
    [B, 1, group*T, L]. `scale`: of q.k (None: head_dim^-0.5).
    sinks: gpt-oss's sink logit per query head [heads] (`_with_sinks`; a prefill then computes its scores itself, as
    SDPA has no extra logit), or None.
    """
    bsz, seq, nh, hd = q.shape
    nkv, span = k_t.shape[1], k_t.shape[3]
    alpha = hd ** -0.5 if scale is None else scale
    if seq == 1:
        q = q.reshape(bsz * nkv, group, hd)
        scores = torch.baddbmm(mask, q, k_t.reshape(bsz * nkv, hd, span), alpha=alpha)
        probs = torch.softmax(scores, dim=-1) if sinks is None else _with_sinks(
            scores.view(bsz, nkv, group, span), sinks.view(nkv, group, 1)).reshape(bsz * nkv, group, span)
        return torch.bmm(probs, v.reshape(bsz * nkv, span, hd)).view(bsz, nh * hd)
    q = q.transpose(1, 2).reshape(bsz, nkv, group * seq, hd)
    if sinks is None:
        out = F.scaled_dot_product_attention(q, k_t.transpose(2, 3), v, attn_mask=mask, scale=scale)
    else:  # rows of q are (query head in its group, position): each row's sink is its head's
        scores = torch.matmul(q, k_t).mul_(alpha).masked_fill_(~mask, float("-inf"))
        row_sinks = sinks.view(nkv, group, 1).repeat_interleave(seq, dim=1)  # [kv_heads, group * T, 1]
        out = torch.matmul(_with_sinks(scores, row_sinks), v)
    return out.view(bsz, nh, seq, hd).transpose(1, 2).reshape(bsz * seq, nh * hd)
