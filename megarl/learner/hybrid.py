"""Qwen3.5 text's hybrid decoder in megatron-core (megarl.models.families' ``linear_attention``), as transformers'
Qwen3_5ForCausalLM computes it.

A block spec of this pipeline stage's layers, one spec per layer from config.json's `layer_types`
(families.linear_attention_layers):
  * a "linear_attention" layer's token mixer is megatron-core's own GatedDeltaNet (megarl.learner.gated_delta_net's
    spec: local linears, its gated norm a plain RMSNorm over each value head); on CPU its torch path runs under
    megarl.learner.cpu_shims.apply_gated_delta_net_shims;
  * a "full_attention" layer is megatron's self-attention with its output gate (TransformerConfig's
    attention_output_gate, set by megarl.models.convert) and per-head q/k norms; RoPE on a quarter of each head is
    rotary_percent;
  * every other norm (input, pre-MLP, q/k, the final one) is transformers' Qwen3_5RMSNorm, x / rms(x) * (1 + w) in
    fp32 cast back: megarl.learner.gemma3.GemmaRMSNorm computes exactly that.

megatron's GatedDeltaNet refuses packed_seq_params, and a recurrence over a packed row would carry one sequence's
state into the next, so the learner feeds this family one sequence per row (megarl.learner.megatron:
`recurrent`); a row's right padding follows its tokens and never reaches them (the recurrence and the causal conv
look back only). Under TP each rank holds its key heads (and their value heads) of every gated-DeltaNet tensor
(megarl.models.gated_delta_net.tp_slice); the gated norm's weight is whole on every rank and its gradient is summed
over TP (`summing_gated_norm_grads`).
"""
from __future__ import annotations

import dataclasses

from megarl.learner.gemma3 import GemmaRMSNorm


def hybrid_block(spec, linear_layers: tuple[bool, ...], stage_layers):
    """TransformerBlockSubmodules of a pipeline stage's layers (global indices `stage_layers`) built from megatron's
    local layer `spec` (SDPA core attention, q/k norms): zero-centred norms everywhere, megatron's GatedDeltaNet as
    the token mixer where `linear_layers` says so, and a zero-centred final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megarl.learner.gated_delta_net import module_spec

    layer = spec.submodules
    attention = layer.self_attention
    qk = dataclasses.replace(attention.submodules, q_layernorm=GemmaRMSNorm, k_layernorm=GemmaRMSNorm)
    full = dataclasses.replace(spec, submodules=dataclasses.replace(
        layer, input_layernorm=GemmaRMSNorm, pre_mlp_layernorm=GemmaRMSNorm,
        self_attention=dataclasses.replace(attention, submodules=qk)))
    linear = dataclasses.replace(full, submodules=dataclasses.replace(full.submodules, self_attention=module_spec()))
    return TransformerBlockSubmodules(layer_specs=[linear if linear_layers[i] else full for i in stage_layers],
                                      layer_norm=GemmaRMSNorm)


GATED_NORM = "self_attention.out_norm.weight"


def summing_gated_norm_grads(finalize_model_grads, tp_group):
    """megatron's `finalize_model_grads` followed by the sum over the TP group of every gated-DeltaNet layer's
    gated-norm weight gradient. Why: the weight is whole on every TP rank but each rank normalises only its own value
    heads, so its gradient there is its heads' share; megatron sums a replicated weight's gradient over TP only for
    q/k layernorms and sequence-parallel norms, and would otherwise step each rank's copy apart."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    def finalize(model, *args, **kwargs):
        out = finalize_model_grads(model, *args, **kwargs)
        if dist.get_world_size(tp_group) == 1:
            return out
        grads = []
        for chunk in model:
            for name, param in chunk.named_parameters():
                grad = getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad
                if name.endswith(GATED_NORM) and param.requires_grad and grad is not None:
                    grads.append(grad.data)
        if grads:
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=tp_group)
            for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(summed)
        return out

    return finalize
