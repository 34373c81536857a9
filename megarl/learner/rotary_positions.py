"""Rotary angles by position id: megatron-core's GPT model rotates every row by the column index (its rotary
embedding takes a sequence length, not position ids), which a packed row whose rows share prefixes cannot use: a
row's own tokens sit after other rows' (megarl.learner.packing). `use_position_ids(gpt)` makes the model's
rotary embedding return, for the position ids of the call (what megarl passes as GPTModel's `position_ids`:
each packed position's index within its own row), the angles of those positions, [S, B, 1, dim] instead of
[S, 1, 1, dim]; megatron's rotary application broadcasts either over the heads. Position ids 0..S-1 on every row
give exactly megatron's own angles (the same table, gathered).

`use_frequencies(gpt, inv_freq)` sets the frequencies that table is built from to the HF model's
(megarl.models.convert.inv_freq: RoPE scaled as transformers scales it, llama3 with any constants and yarn
included, which megatron's rotary embedding does not compute). `skip_layers(gpt, rope)` keeps the layers whose
`rope` flag is False (SmolLM3's `no_rope_layers`, megarl.models.families.rope_layers) from rotating q and k.

Multi-latent attention (DeepSeek-V3) has no model-level rotary embedding: each layer's attention calls its own
(megatron's YaRN one, which returns the angles and the attention factor on cos / sin). `use_latent_frequencies(gpt,
inv_freq, attention_factor)` makes each return transformers' angles by the call's position ids and transformers'
factor instead.
"""
from __future__ import annotations

import torch


def use_frequencies(gpt, inv_freq: torch.Tensor) -> None:
    """Build `gpt`'s rotary angles from `inv_freq` [dim / 2] (no-op without a rotary embedding). Before the first
    forward: megatron caches the angles it computes."""
    rotary = getattr(gpt, "rotary_pos_emb", None)
    if rotary is None:
        return
    if rotary.inv_freq.shape != inv_freq.shape:
        raise ValueError(f"rotary frequencies of shape {tuple(inv_freq.shape)} for a rotary embedding of "
                         f"{tuple(rotary.inv_freq.shape)}")
    rotary.inv_freq = inv_freq.to(device=rotary.inv_freq.device, dtype=rotary.inv_freq.dtype)


def skip_layers(gpt, rope: tuple[bool, ...] | None) -> None:
    """Give the self-attention of every layer of `gpt` (this pipeline stage's) whose global index i has rope[i]
    False no rotary angles, so it attends with unrotated q and k (None: every layer rotates)."""
    if rope is None:
        return

    def no_rotation(module, args, kwargs):
        return args, {**kwargs, "rotary_pos_emb": None}

    for layer in gpt.decoder.layers:
        if not rope[layer.layer_number - 1]:  # (megatron numbers layers from 1, across pipeline stages)
            layer.self_attention.register_forward_pre_hook(no_rotation, with_kwargs=True)


def use_position_ids(gpt) -> None:
    """Route `gpt`'s rotary embedding through the position ids of each forward call (no-op without one)."""
    rotary = getattr(gpt, "rotary_pos_emb", None)
    if rotary is None:
        return
    table = rotary.forward  # megatron's: the angles of positions 0..n-1, [n, 1, 1, dim]
    call = {"position_ids": None}

    def remember(module, args, kwargs):
        call["position_ids"] = kwargs["position_ids"] if "position_ids" in kwargs else args[1]

    def by_position_ids(max_seq_len: int, *args, **kwargs) -> torch.Tensor:
        positions = call["position_ids"]
        if positions is None:
            return table(max_seq_len, *args, **kwargs)
        # (packed_seq: the whole table, not megatron's context-parallel slice of it; the position ids pick each
        # local position's angles, megarl.learner.context_parallel)
        angles = table(max(max_seq_len, int(positions.max()) + 1), *args, **{**kwargs, "packed_seq": True})
        return angles[:, 0, 0][positions.t()].unsqueeze(2)  # [S, B, 1, dim]

    gpt.register_forward_pre_hook(remember, with_kwargs=True)
    rotary.forward = by_position_ids


def use_latent_frequencies(gpt, inv_freq: torch.Tensor, attention_factor: float) -> None:
    """Make the rotary embedding of every multi-latent attention layer of `gpt` return (the angles of the forward
    call's position ids from `inv_freq` [dim / 2], [S, B, 1, dim]; `attention_factor`), what megatron's MLA applies
    as cos(angle) * factor, sin(angle) * factor (no-op for other attention)."""
    rotaries = [layer.self_attention.rotary_pos_emb for layer in gpt.decoder.layers
                if getattr(layer.self_attention.config, "multi_latent_attention", False)]
    if not rotaries:
        return
    call = {"position_ids": None}

    def remember(module, args, kwargs):
        call["position_ids"] = kwargs["position_ids"] if "position_ids" in kwargs else args[1]

    def angles(max_seq_len: int, *args, **kwargs):
        positions = call["position_ids"]
        if positions is None:  # (every row at 0..S-1)
            positions = torch.arange(max_seq_len, device=inv_freq.device)[None]
        freqs = positions.t()[..., None].float() * inv_freq.to(positions.device)  # [S, B, dim / 2], as transformers
        return torch.cat((freqs, freqs), dim=-1).unsqueeze(2), attention_factor

    gpt.register_forward_pre_hook(remember, with_kwargs=True)
    for rotary in rotaries:
        rotary.forward = angles
