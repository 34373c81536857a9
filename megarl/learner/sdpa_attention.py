"""The megatron learner's core attention: megatron-core's ``DotProductAttention`` computed by torch's fused
``scaled_dot_product_attention`` (SDPA).

Why: without Transformer Engine (every CPU run, and GPU installs without it) megatron-core 0.16.1's local layer
spec attends with ``DotProductAttention``, which materialises the [B, heads, S, S] scores and runs
baddbmm -> masked_fill -> softmax -> bmm as separate kernels, each keeping its output for the backward, and copies
the keys and values once more per query head under grouped-query attention. SDPA does the same arithmetic in one
fused kernel (CPU: its flash kernel; GPU: flash or memory-efficient) that keeps no score matrix: on the demo's
packed batches (45 rows x 54 positions, 4 heads, 2 KV groups) one layer's attention forward + backward takes
3.3 ms instead of 5.2 on one core.

Same contract as megatron's: query/key/value [S, B, heads, head_dim], ``attention_mask`` bool with True = masked
(megarl always passes one: causal, or the packed rows' block-diagonal causal mask, which never masks a whole
row), the context [S, B, heads * head_dim] out (multi-latent attention's q/k heads are wider than its v heads:
megatron passes ``k_channels`` / ``v_channels``, SDPA takes the tensors as they come, the context is [S, B, heads *
v dims]). What SDPA would not compute the same way is refused when the layer is built, naming the setting:
attention dropout (megarl's converted configs set it to 0), the fixed "off-by-one" softmax offset, megatron's
`window_size` (a sliding window, Mistral's, is part of the mask megarl builds: megarl.learner.packing counts it in
position ids, which megatron's column-based window would not). megatron's own unfused path is never taken.

Attention sinks (``softmax_type='learnable'``, gpt-oss): a learned logit per query head that joins every softmax
denominator and adds nothing to the context (``softmax_offset``, HF's ``self_attn.sinks``). SDPA takes no such
term, so it gets one more key whose score is that logit and whose value is 0 (`with_sinks`): q and k are widened
by one dim per query head of a KV group, q's a one-hot of the head's place in its group, every key's 0 but the sink
key's, which holds the group's sink logits / softmax scale. The scores of the real keys are unchanged, the sink
key's is the head's own logit, so one fused SDPA call computes exactly the softmax with sinks (no [S, S] scores,
the mask widened by one attended column), and the sinks get their gradient through it.

Layers with their own windows (Gemma 3's and gpt-oss's sliding and full layers, families.layer_windows): the mask
is then a stack, [windows, B, 1, Q, K], one mask per distinct window, and each layer takes its own
(`use_layer_masks`).

Under context parallelism (``learner.cp``, megarl.learner.context_parallel) the queries are this rank's positions
and the keys and values every CP rank's, all-gathered here (after the rotary embedding: each rank rotated its own
positions at their global position ids); the mask is then [local queries x all keys].
"""
from __future__ import annotations

import dataclasses

import torch
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megarl.learner.context_parallel import gather_sequence


class SDPAttention(DotProductAttention):
    def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
        # (k_channels / v_channels: MLA's head dims, which the tensors carry; megatron's class takes neither)
        learnable = config.softmax_type == "learnable"
        # (megatron allocates the sinks on the current CUDA device; built here on the config's initialisation device)
        super().__init__(dataclasses.replace(config, softmax_type="vanilla") if learnable else config, *args, **kwargs)
        self.config = config
        if learnable:
            self.softmax_offset = torch.nn.Parameter(torch.zeros(
                self.num_attention_heads_per_partition, dtype=config.params_dtype,
                device="cpu" if config.use_cpu_initialization else torch.cuda.current_device()))
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
        self.mask_index = 0  # which mask of a stacked [windows, B, 1, Q, K] one this layer attends with
        unsupported = {"attention_dropout": self.attention_dropout.p != 0,
                       "softmax_type": config.softmax_type not in ("vanilla", "learnable"),
                       "window_size": config.window_size is not None}
        if any(unsupported.values()):
            raise ValueError(f"megarl's fused attention (megarl/learner/sdpa_attention.py) does not take "
                             f"TransformerConfig.{', '.join(k for k, v in unsupported.items() if v)} of this model")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None or attention_mask is None:
            raise ValueError("megarl's fused attention takes a boolean attention mask and no bias or packed-sequence "
                             "parameters (megarl packs rows through the mask: megarl/learner/packing.py)")
        if attention_mask.dim() == 5:  # one mask per window (use_layer_masks)
            attention_mask = attention_mask[self.mask_index]
        if parallel_state.get_context_parallel_world_size() > 1:
            group = parallel_state.get_context_parallel_group()
            key, value = gather_sequence(key, group), gather_sequence(value, group)
        # [S, B, heads, d] -> [B, heads, S, d] (views; SDPA takes strided inputs)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        allowed = ~attention_mask
        if self.softmax_offset is not None:
            q, k, v, allowed = with_sinks(q, k, v, allowed, self.softmax_offset, self.softmax_scale)
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=self.softmax_scale,
            enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition)
        context = context[..., :value.shape[-1]]  # (with sinks: the value's zero padding dropped)
        return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def with_sinks(q, k, v, allowed, sinks, scale: float):
    """(q, k, v, allowed) with one sink key appended that every query attends, whose score under
    `scale` is its head's `sinks` logit and whose value is 0 (the module docstring); q [B, H, Q, d], k / v
    [B, G, K, d] (H a multiple of G, heads grouped as SDPA's enable_gqa groups them), allowed bool [.., Q, K]
    (True = attended), sinks [H]. Pure. q, k and v come out equally wide, a multiple of 8 dims (the extra ones 0
    wherever they carry no sink): SDPA's fused kernels take only such (CPU flash: one width for q, k and v;
    CUDA: widths aligned to 8), else it computes the [Q, K] scores unfused; the context's first d dims are the
    attention's."""
    b, heads, nq, d = q.shape
    groups = k.shape[1]
    per_group = heads // groups
    width = d + per_group + (-(d + per_group)) % 8
    place = torch.zeros(heads, width - d, dtype=q.dtype, device=q.device)
    place[torch.arange(heads), torch.arange(heads) % per_group] = 1.0  # each head's place in its group
    q = torch.cat([q, place[None, :, None, :].expand(b, heads, nq, width - d)], dim=-1)
    sink_key = k.new_zeros(groups, width)
    sink_key[:, d:d + per_group] = (sinks / scale).to(k.dtype).view(groups, per_group)
    k = torch.cat([torch.nn.functional.pad(k, (0, width - d)), sink_key[None, :, None, :].expand(b, -1, -1, -1)], 2)
    v = torch.nn.functional.pad(v, (0, width - d, 0, 1))
    return q, k, v, torch.nn.functional.pad(allowed, (0, 1), value=True)


def use_layer_masks(gpt, mask_index: tuple[int, ...] | None) -> None:
    """Have the core attention of every layer of `gpt` (this pipeline stage's) whose global index is i attend with
    mask `mask_index[i]` of the stacked masks the learner passes (None: one mask for every layer)."""
    if mask_index is None:
        return
    for layer in gpt.decoder.layers:  # (megatron numbers layers from 1, across pipeline stages)
        layer.self_attention.core_attention.mask_index = mask_index[layer.layer_number - 1]
