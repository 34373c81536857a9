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
attention dropout (megarl's converted configs set it to 0), a softmax offset, megatron's `window_size` (a sliding
window, Mistral's, is part of the mask megarl builds: megarl.learner.packing counts it in position ids, which
megatron's column-based window would not). megatron's own unfused path is never taken.

Under context parallelism (``learner.cp``, megarl.learner.context_parallel) the queries are this rank's positions
and the keys and values every CP rank's, all-gathered here (after the rotary embedding: each rank rotated its own
positions at their global position ids); the mask is then [local queries x all keys].
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megarl.learner.context_parallel import gather_sequence


class SDPAttention(DotProductAttention):
    def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
        # (k_channels / v_channels: MLA's head dims, which the tensors carry; megatron's class takes neither)
        super().__init__(config, *args, **kwargs)
        unsupported = {"attention_dropout": self.attention_dropout.p != 0, "softmax_type": self.softmax_offset is not None,
                       "window_size": config.window_size is not None}
        if any(unsupported.values()):
            raise ValueError(f"megarl's fused attention (megarl/learner/sdpa_attention.py) does not take "
                             f"TransformerConfig.{', '.join(k for k, v in unsupported.items() if v)} of this model")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None or attention_mask is None:
            raise ValueError("megarl's fused attention takes a boolean attention mask and no bias or packed-sequence "
                             "parameters (megarl packs rows through the mask: megarl/learner/packing.py)")
        if parallel_state.get_context_parallel_world_size() > 1:
            group = parallel_state.get_context_parallel_group()
            key, value = gather_sequence(key, group), gather_sequence(value, group)
        # [S, B, heads, d] -> [B, heads, S, d] (views; SDPA takes strided inputs)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale,
            enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition)
        return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
