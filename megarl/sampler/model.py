"""Pure-torch forward pass of a Qwen2/Llama-family decoder, for the built-in sampler engine.

This module owns the model math and the KV-cache layout; it owns no scheduling (that is
`megarl.sampler.engine`).  Weights arrive as a plain dict whose keys are exactly the HF names that
``Qwen2ForCausalLM.save_pretrained`` / ``LlamaForCausalLM`` write to ``model.safetensors`` (tied
embeddings -> no ``lm_head.weight``).  `prepare_weights` turns that dict into the forward's
`RuntimeWeights` (q/k/v and gate/up stacked); the forward is a function over it, so swapping weights
is replacing one reference: no nn.Module, no parameter copying on the decode thread.

KV cache: preallocated ``[layers, slots, kv_heads, max_seq_len, head_dim]`` tensors.  A forward call
works on a contiguous range of slots ``[slot_start, slot_start + B)`` (the engine keeps its running
sequences packed at the front), writes the new tokens' K/V at their positions and attends to cache
positions ``<= position`` of each query.  Every sequence thus has its own length inside one call, and
the same function serves prefill (T tokens per row, right-padded) and batched decode (T = 1).

Numerics follow transformers' implementation (RoPE tables in fp32 cast to the activation dtype,
non-interleaved ``rotate_half``, RMSNorm computed in fp32), so fp32 log-probs agree with HF to ~1e-6.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


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

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelSpec":
        """Parse an HF config dict; raise ValueError naming the field of anything we cannot run."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg['hidden_act']!r} is not supported (only 'silu')")
        if cfg.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported (full attention only)")
        layer_types = cfg.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"layer_types={layer_types!r} is not supported (full_attention only)")
        # Old configs put rope_theta / rope_scaling at the top level; transformers>=5 writes rope_parameters.
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type", "default")) != "default":
            raise ValueError(f"rope_scaling={rope_scaling!r} is not supported (default RoPE only)")
        rope_params = cfg.get("rope_parameters") or {}
        if rope_params.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.rope_type={rope_params['rope_type']!r} is not supported (default only)")
        partial = rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor={partial} is not supported (full rotary only)")
        rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))

        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        # Qwen2 always has q/k/v biases and none on o_proj; Llama's attention_bias covers q/k/v/o.
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every tensor the forward reads, in save_pretrained naming."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q_out, kv_out = self.num_heads * d, self.num_kv_heads * d
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            for name, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
                shapes[p + f"self_attn.{name}.weight"] = (out, h)
                if self.qkv_bias:
                    shapes[p + f"self_attn.{name}.bias"] = (out,)
            shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                shapes[p + f"mlp.{name}.weight"] = shape
                if self.mlp_bias:
                    shapes[p + f"mlp.{name}.bias"] = (shape[0],)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

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


def load_pretrained(model_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, HF-named weights) from an HF model directory (single or sharded safetensors)."""
    from safetensors.torch import load_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return cfg, load_file(single)
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(os.path.join(model_dir, shard)))
    return cfg, weights


class KVCache:
    """Preallocated K/V tensors [layers, slots, kv_heads, max_seq_len, head_dim]."""

    def __init__(self, spec: ModelSpec, num_slots: int, max_seq_len: int, dtype: torch.dtype, device="cpu"):
        shape = (spec.num_layers, num_slots, spec.num_kv_heads, max_seq_len, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_seq_len = max_seq_len

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy the first `length` positions of slots `src` into slots `dst` (used to keep slots packed)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


def rope_tables(spec: ModelSpec, max_seq_len: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, signed_sin) [max_seq_len, head_dim] for `_apply_rope`.

    cos/sin are computed exactly as transformers' default RoPE.  HF's ``x*cos + rotate_half(x)*sin``
    with ``rotate_half([x1, x2]) = [-x2, x1]`` equals ``x*cos + [x2, x1] * [-sin1, sin2]`` bit for bit
    (negation is exact), so the sign is folded into the table and the swap of halves is one flip.
    """
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
    freqs = torch.arange(max_seq_len, dtype=torch.float, device=device)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    sin[:, : dim // 2] *= -1
    return emb.cos(), sin


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [..., head_dim]; cos/signed_sin broadcastable to x (see rope_tables)."""
    half = x.shape[-1] // 2
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)
    return x * cos + swapped * signed_sin


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]: q_proj, k_proj, v_proj stacked
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate_proj, up_proj stacked
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


@dataclass
class RuntimeWeights:
    """The forward's view of one weight version, built from an HF-named state dict by `prepare_weights`.

    q/k/v and gate/up are stacked so a layer runs 3 matmuls instead of 7: on CPU at small batch the
    decode step is bound by the number of kernels, not by FLOPs.  Building it copies those tensors
    once per version, which is why the engine does it on the thread that stages the weights.
    """

    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor  # the embedding matrix itself when embeddings are tied

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype


def prepare_weights(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> RuntimeWeights:
    """Check an HF-named state dict against the spec and build the forward's RuntimeWeights."""
    spec.check_weights(weights)
    w = weights

    def stacked(prefix: str, names: tuple[str, ...], kind: str) -> torch.Tensor | None:
        keys = [f"{prefix}{name}.{kind}" for name in names]
        return torch.cat([w[k] for k in keys]) if keys[0] in w else None

    layers = []
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        gate_up = ("mlp.gate_proj", "mlp.up_proj")
        layers.append(LayerWeights(
            input_norm=w[p + "input_layernorm.weight"],
            qkv=stacked(p, qkv, "weight"),
            qkv_bias=stacked(p, qkv, "bias"),
            o_proj=w[p + "self_attn.o_proj.weight"],
            o_bias=w.get(p + "self_attn.o_proj.bias"),
            post_norm=w[p + "post_attention_layernorm.weight"],
            gate_up=stacked(p, gate_up, "weight"),
            gate_up_bias=stacked(p, gate_up, "bias"),
            down=w[p + "mlp.down_proj.weight"],
            down_bias=w.get(p + "mlp.down_proj.bias"),
        ))
    embed = w["model.embed_tokens.weight"]
    return RuntimeWeights(
        embed=embed,
        layers=layers,
        norm=w["model.norm.weight"],
        lm_head=embed if spec.tie_word_embeddings else w["lm_head.weight"],
    )


def forward(
    spec: ModelSpec,
    weights: RuntimeWeights,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: KVCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    *,
    slot_start: int = 0,
    attn_len: int | None = None,
    logit_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run B rows of T tokens through the decoder, writing their K/V into the cache.

    input_ids, positions: long [B, T]; row b lives in cache slot ``slot_start + b`` and its tokens sit
    at ``positions[b]`` (contiguous and increasing; right padding may repeat or run past the sequence,
    its K/V land beyond the sequence's end and are overwritten before they are ever attended to).
    Each query attends to cache positions ``<= its position`` of its own slot, so all earlier
    positions of that slot must already be in the cache.
    attn_len: how many cache positions to look at (>= max(positions) + 1); default max_seq_len.
    logit_index: long [B]; if given, return logits [B, V] of token ``logit_index[b]`` of each row only
    (prefill needs just the last one), else logits [B, T, V].  Logits are in the weights' dtype.
    """
    bsz, seq = input_ids.shape
    nh, nkv, hd, eps = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps
    group = nh // nkv
    attn_len = cache.max_seq_len if attn_len is None else attn_len
    slots = slice(slot_start, slot_start + bsz)

    x = F.embedding(input_ids, weights.embed)
    cos = rope[0][positions].to(x.dtype).unsqueeze(2)  # [B, T, 1, hd], broadcast over heads
    sin = rope[1][positions].to(x.dtype).unsqueeze(2)
    # Write index for scatter_ into [B, kv_heads, max_seq_len, hd] along the position dim.
    write_idx = positions[:, None, :, None].expand(bsz, nkv, seq, hd)
    # Boolean SDPA mask, True = attend: causal per row, over that row's own cache slot.
    key_pos = torch.arange(attn_len, device=positions.device)
    mask = (key_pos[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [B, 1, T, attn_len]
    # GQA without repeating K/V: the query heads sharing a KV head are folded into the query-length
    # dim ([B, kv_heads, group * T, hd]), about twice as fast on CPU as SDPA's enable_gqa.
    if group > 1 and seq > 1:
        mask = mask.repeat(1, 1, group, 1)

    for layer, lw in enumerate(weights.layers):
        h = F.rms_norm(x, (x.shape[-1],), lw.input_norm, eps)
        qkv = F.linear(h, lw.qkv, lw.qkv_bias).view(bsz, seq, nh + 2 * nkv, hd)
        qk = _apply_rope(qkv[:, :, : nh + nkv], cos, sin)  # one RoPE pass for q and k heads together
        q = qk[:, :, :nh].transpose(1, 2)
        k = qk[:, :, nh:].transpose(1, 2)
        v = qkv[:, :, nh + nkv :].transpose(1, 2)

        k_cache = cache.k[layer, slots]  # views: the writes land in the cache itself
        v_cache = cache.v[layer, slots]
        k_cache.scatter_(2, write_idx, k)
        v_cache.scatter_(2, write_idx, v)
        attn = F.scaled_dot_product_attention(
            q.reshape(bsz, nkv, group * seq, hd), k_cache[:, :, :attn_len], v_cache[:, :, :attn_len],
            attn_mask=mask,
        )
        attn = attn.view(bsz, nh, seq, hd).transpose(1, 2).reshape(bsz, seq, nh * hd)
        x = x + F.linear(attn, lw.o_proj, lw.o_bias)

        h = F.rms_norm(x, (x.shape[-1],), lw.post_norm, eps)
        gate, up = F.linear(h, lw.gate_up, lw.gate_up_bias).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, lw.down, lw.down_bias)

    if logit_index is not None:
        x = x[torch.arange(bsz, device=x.device), logit_index]
    return F.linear(F.rms_norm(x, (x.shape[-1],), weights.norm, eps), weights.lm_head)
