"""Gemma 3's decoder in megatron-core (megarl.models.families' ``gemma``), as transformers' Gemma3ForCausalLM computes
it: embeddings scaled by sqrt(hidden_size), RMSNorms of (1 + weight), four norms per layer, and local
(sliding-window) and global layers that differ in their attention mask and their RoPE.

megatron-core 0.16.1's GPTModel has none of these, so:
  * ``GemmaRMSNorm`` is every norm (input, pre-MLP, per-head q/k, the final one), computed in fp32 and cast back as
    transformers' Gemma3RMSNorm; the norms after attention and the MLP sit in the bias-dropout-adds
    (``GemmaPostNormAdd``, OLMo 2's megarl.learner.post_norms.PostNormAdd with this norm). Weights are HF's as they
    are (megarl.models.convert.GEMMA_NORMS).
  * ``scale_embeddings`` multiplies the embedding's output by sqrt(hidden_size) cast to the output's dtype (what
    transformers does: in bf16 sqrt(3072) = 55.43 is 55.5).
  * ``use_layer_rope``: the rotary embedding returns both kinds' angles stacked (the model's frequencies are the
    global layers', megarl.models.convert.inv_freq; the local ones' are local_inv_freq) and each layer's
    self-attention gets its kind's. Each kind's sliding window is set as every family's with windows per layer
    is (families.layer_windows, megarl.learner.sdpa_attention.use_layer_windows).
"""
from __future__ import annotations

import dataclasses
import torch

from megarl.learner.post_norms import PostNormAdd
from megarl.models.families import SLIDING


class GemmaRMSNorm(torch.nn.Module):
    """transformers' Gemma3RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight), in fp32, cast to x's dtype; built as
    megatron builds a norm (config, hidden_size, eps)."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_unused):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class GemmaPostNormAdd(PostNormAdd):
    """``residual + GemmaRMSNorm(block output)`` (post_attention_layernorm / post_feedforward_layernorm)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__(hidden_size, eps)
        self.norm = GemmaRMSNorm(hidden_size=hidden_size, eps=eps)


def gemma_spec(spec, hidden_size: int, eps: float):
    """megatron's local layer `spec` with Gemma 3's norms."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    layer = spec.submodules
    attention = layer.self_attention
    qk = dataclasses.replace(attention.submodules, q_layernorm=GemmaRMSNorm, k_layernorm=GemmaRMSNorm)
    add = ModuleSpec(module=GemmaPostNormAdd, params={"hidden_size": hidden_size, "eps": eps})
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        layer, input_layernorm=GemmaRMSNorm, pre_mlp_layernorm=GemmaRMSNorm, self_attn_bda=add, mlp_bda=add,
        self_attention=dataclasses.replace(attention, submodules=qk)))


def gemma_block(layers: list):
    """TransformerBlockSubmodules of a pipeline stage's `layers` whose final norm is a GemmaRMSNorm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=GemmaRMSNorm)


def scale_embeddings(gpt, hidden_size: int) -> None:
    """Multiply `gpt`'s embedding output by sqrt(hidden_size) in its dtype (no-op on stages without one)."""
    embedding = getattr(gpt, "embedding", None)
    if embedding is None:
        return
    scale = hidden_size ** 0.5

    def scaled(module, args, output):
        return output * torch.tensor(scale, dtype=output.dtype, device=output.device)

    embedding.register_forward_hook(scaled)


def use_layer_rope(gpt, kinds: tuple[str, ...], local_inv_freq: torch.Tensor) -> None:
    """Give each layer of `gpt` (this pipeline stage's) its kind's rotary angles. After
    megarl.learner.rotary_positions.use_position_ids: the rotary embedding then returns both kinds' angles of the
    call's position ids, [S, B, 2, dim] (global, local), which megatron hands every layer as it hands it the mask,
    so a layer recomputed in the backward (activation recompute, pipeline schedules) gets its own micro-batch's."""
    rotary = gpt.rotary_pos_emb
    global_angles = rotary.forward  # (use_position_ids': [S, B, 1, dim] at the call's position ids)
    call: dict = {}

    def remember(module, args, kwargs):
        call["positions"] = kwargs["position_ids"] if "position_ids" in kwargs else args[1]

    def both_kinds(*args, **kwargs) -> torch.Tensor:
        angles = global_angles(*args, **kwargs)
        positions = call["positions"]
        freqs = positions.t().to(torch.float32)[..., None] * local_inv_freq.to(positions.device)
        local = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)
        return torch.cat([angles, local.to(angles.dtype)], dim=2)

    def one_kind(kind: int):
        def hook(module, args, kwargs):
            return args, {**kwargs, "rotary_pos_emb": kwargs["rotary_pos_emb"][:, :, kind:kind + 1]}

        return hook

    gpt.register_forward_pre_hook(remember, with_kwargs=True)
    rotary.forward = both_kinds
    for layer in gpt.decoder.layers:
        local = kinds[layer.layer_number - 1] == SLIDING  # (megatron numbers layers from 1, across stages)
        layer.self_attention.register_forward_pre_hook(one_kind(int(local)), with_kwargs=True)
