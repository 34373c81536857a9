"""The megatron learner's core attention: megatron-core's ``DotProductAttention`` computed by torch's fused
``scaled_dot_product_attention`` (SDPA).

Why: without Transformer Engine (every CPU run, and GPU installs without it) megatron-core 0.16.1's local layer
spec attends with ``DotProductAttention``, which materialises the [B, heads, S, S] scores and runs
baddbmm -> masked_fill -> softmax -> bmm as separate kernels, each keeping its output for the backward, and copies
the keys and values once more per query head under grouped-query attention. SDPA does the same arithmetic in one
fused kernel (CPU: its flash kernel; GPU: flash or memory-efficient) that keeps no score matrix: on the demo's
packed batches (45 rows x 54 positions, 4 heads, 2 KV groups) one layer's attention forward + backward takes
3.3 ms instead of 5.2 on one core.

Same contract as megatron's: query/key/value [S, B, heads, head_dim], the context [S, B, heads * head_dim] out
(multi-latent attention's q/k heads are wider than its v heads: megatron passes ``k_channels`` / ``v_channels``,
SDPA takes the tensors as they come, the context is [S, B, heads * v dims]). What SDPA would not compute the same
way is refused when the layer is built, naming the setting: attention dropout (megarl's converted configs set it to
0), the fixed "off-by-one" softmax offset, megatron's `window_size` (a sliding window, Mistral's, is part of the
masks megarl builds: megarl.learner.packing counts it in position ids, which megatron's column-based window would
not). megatron's own unfused path is never taken.

What is attended: megarl's learner passes an *attention layout* as ``attention_mask`` (int64 [R, 3, K],
megarl.learner.packing.attention_layout: each key position's column, the end of its prefix-tree subtree and its
depth; R = 1 for causal rows, else the packed rows), O(S) numbers from which `layout_attention` builds each query
block's [R, 1, queries, keys] boolean mask (packing.layout_mask, exactly packing.attention_mask's / causal_mask's)
and calls SDPA on it. Up to BLOCK_ELEMENTS mask elements (the demo's 45 x 54 x 54, one row of 2048) that is one
call with the whole mask; longer rows go in query blocks over only the keys each block can see, each block
recomputed in the backward, so no S x S mask or score exists and attention memory grows with S. A ready boolean
mask (True = masked; one, or a stack [windows, B, 1, Q, K] of which each layer takes its own: `use_layer_masks`)
is attended in one call as it is.

Attention sinks (``softmax_type='learnable'``, gpt-oss): a learned logit per query head that joins every softmax
denominator and adds nothing to the context (``softmax_offset``, HF's ``self_attn.sinks``). SDPA takes no such
term, so it gets one more key whose score is that logit and whose value is 0 (`with_sinks`): q and k are widened
by one dim per query head of a KV group, q's a one-hot of the head's place in its group, every key's 0 but the sink
key's, which holds the group's sink logits / softmax scale. The scores of the real keys are unchanged, the sink
key's is the head's own logit, so one fused SDPA call computes exactly the softmax with sinks (no [S, S] scores,
the mask widened by one attended column), and the sinks get their gradient through it.

Layers with their own windows (Gemma 3's and gpt-oss's sliding and full layers, families.layer_windows): each
layer's core attention holds its window and builds its masks with it (`use_layer_windows`).

Under context parallelism (``learner.cp``, megarl.learner.context_parallel) the queries are this rank's positions
and the keys and values every CP rank's, all-gathered here (after the rotary embedding: each rank rotated its own
positions at their global position ids); the layout describes all the keys in the gathered order, the rank's
queries are its own slice of them, and the keys are put in column order once so each block's visible keys are a
slice.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.utils.checkpoint
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megarl.learner.context_parallel import gather_sequence
from megarl.learner.packing import COLUMN, END, layout_mask

# The most mask elements (rows x queries x keys) one SDPA call of `layout_attention` takes (4 Mi: a 4 MiB boolean
# mask, which SDPA's CPU kernel widens to a 16 MiB additive one): at most 2048 positions of one row attend in one
# call, as a dense mask would have them.
BLOCK_ELEMENTS = 2**22


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
        self.window: int | None = None  # this layer's sliding window under an attention layout (use_layer_windows)
        self.block_elements = BLOCK_ELEMENTS
        unsupported = {"attention_dropout": self.attention_dropout.p != 0,
                       "softmax_type": config.softmax_type not in ("vanilla", "learnable"),
                       "window_size": config.window_size is not None}
        if any(unsupported.values()):
            raise ValueError(f"megarl's fused attention (megarl/learner/sdpa_attention.py) does not take "
                             f"TransformerConfig.{', '.join(k for k, v in unsupported.items() if v)} of this model")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None or attention_mask is None:
            raise ValueError("megarl's fused attention takes a boolean attention mask or an attention layout and no "
                             "bias or packed-sequence parameters (megarl packs rows through them: "
                             "megarl/learner/packing.py)")
        cp = parallel_state.get_context_parallel_world_size()
        if cp > 1:
            group = parallel_state.get_context_parallel_group()
            key, value = gather_sequence(key, group), gather_sequence(value, group)
        # [S, B, heads, d] -> [B, heads, S, d] (views; SDPA takes strided inputs)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if attention_mask.dtype == torch.bool:
            if attention_mask.dim() == 5:  # one mask per window (use_layer_masks)
                attention_mask = attention_mask[self.mask_index]
            context = self._attend(q, k, v, ~attention_mask)
        else:  # an attention layout of the keys; this rank's queries are its own slice of them (gather order)
            rank = parallel_state.get_context_parallel_rank() if cp > 1 else 0
            own = attention_mask[:, :, rank * q.shape[2]:(rank + 1) * q.shape[2]]
            context = layout_attention(q, k, v, own, attention_mask, self.window, self._attend, self.block_elements)
        return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _attend(self, q, k, v, allowed):
        """The context [B, heads, Q, v dims] of one fused SDPA call, `allowed` [.., Q, K] bool (True = attended)."""
        width = v.shape[-1]
        if self.softmax_offset is not None:
            q, k, v, allowed = with_sinks(q, k, v, allowed, self.softmax_offset, self.softmax_scale)
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=self.softmax_scale,
            enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition)
        return context[..., :width]  # (with sinks: the value's zero padding dropped)


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
    mask `mask_index[i]` of a stacked dense mask (None: one mask for every layer)."""
    if mask_index is None:
        return
    for layer in gpt.decoder.layers:  # (megatron numbers layers from 1, across pipeline stages)
        layer.self_attention.core_attention.mask_index = mask_index[layer.layer_number - 1]


def use_layer_windows(gpt, windows: tuple[int | None, ...], mask_index: tuple[int, ...] | None) -> None:
    """Have the core attention of every layer of `gpt` (this pipeline stage's) whose global index is i build its
    masks from an attention layout with window windows[mask_index[i]] (mask_index None: windows[0] for every layer;
    megarl.models.families.mask_windows)."""
    if mask_index is None and windows[0] is None:
        return
    for layer in gpt.decoder.layers:
        index = 0 if mask_index is None else mask_index[layer.layer_number - 1]
        layer.self_attention.core_attention.window = windows[index]


def layout_attention(q, k, v, queries, keys, window: int | None, attend, block_elements: int = BLOCK_ELEMENTS):
    """The context [B, heads, Q, v dims] of q [B, H, Q, d] against k / v [B, G, K, d] under the attention layouts
    (megarl.learner.packing.attention_layout) `queries` [R, 3, Q] and `keys` [R, 3, K] (R = B, or 1 for every row)
    and a sliding `window`, by `attend(q, k, v, allowed)` (one fused SDPA call). Where R x Q x K fits
    `block_elements`, one call with the whole mask (as a dense mask would be passed). Else in blocks of queries:
    each builds only its own [R, 1, queries, keys] mask from the layouts, over the keys it can see (columns up to
    its last query's; none whose subtree ends before its first query), and is recomputed in the backward
    (torch.utils.checkpoint), so nothing Q x K is kept: memory grows with Q + K, and causal rows compute about half
    the scores."""
    rows, nq, nk = keys.shape[0], q.shape[2], keys.shape[2]
    size = max(1, block_elements // (rows * nk))
    if size >= nq:
        return attend(q, k, v, ~layout_mask(queries, keys, window))
    order = keys[0, COLUMN].argsort()  # (every row's keys have the same columns)
    if not torch.equal(order, torch.arange(nk, device=order.device)):  # context parallelism's zig-zag gather
        k, v, keys = k[:, :, order], v[:, :, order], keys[:, :, order]
    columns = keys[0, COLUMN]
    blocks = []
    for start in range(0, nq, size):
        part = queries[:, :, start:start + size]
        first, last = part[:, COLUMN].min(), part[:, COLUMN].max()
        stop = int(torch.searchsorted(columns, last, right=True))
        begin = int(((keys[:, END] >= first).any(0) & (columns <= last)).int().argmax())
        blocks.append(torch.utils.checkpoint.checkpoint(
            _block, q[:, :, start:start + size], k, v, part, keys, begin, stop, window, attend, use_reentrant=False))
    return torch.cat(blocks, dim=2)


def _block(q, k, v, queries, keys, begin: int, stop: int, window: int | None, attend):
    """One query block of `layout_attention`: its queries against keys begin..stop-1."""
    keys = keys[:, :, begin:stop]
    return attend(q, k[:, :, begin:stop], v[:, :, begin:stop], ~layout_mask(queries, keys, window))
