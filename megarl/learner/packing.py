"""Sequence packing: a micro-batch's rows laid end to end in fewer rows, so the model computes almost no
padding, and what it computes read back in the rows' own layout.

A learner step's rows are long-tailed (a few long completions, many short ones). Cutting them into
micro-batches of similar length (megarl.learner.step.micro_batch_rows) still leaves a fifth to a third of the
computed positions padding on the demo. Packing puts several rows into one *packed row* of at most `capacity`
positions (first-fit decreasing), and an attention mask keeps each row to its own positions, causally. The
model runs on the packed rows and the per-token log-probs (and entropies) are computed there, on the packed
positions only; they and the routers' own choices are gathered back into the micro-batch's [rows, width] layout
(`next_token_values`, `unpack`), so everything after them (the loss, metrics, router agreement) is the same code
on the same layout as without packing.

The capacity is the micro-batch's longest row, so a packed row is never wider than an unpacked one: activation
memory per micro-batch stays within its unpacked bound, and a row placed at an offset sees rotary angles of
positions the model also sees unpacked. RoPE attention depends only on the distance between two positions,
so a row's scores do not change with its offset (up to float rounding: docs/learner.md, "Sequence packing").
Learned absolute position embeddings would need per-row position ids; megarl's megatron models are rotary.

A packed micro-batch carries, besides its own fields, the keys of PACK_KEYS:
``packed_ids`` [R, W] the packed tokens (0 where nothing is placed), ``packed_segments`` [R, W] which row of
the micro-batch each position holds (-1: nothing), ``packed_positions`` [R, W] each position's index within its
own row (the position ids of models that take them: HF's), ``unpack_index`` [B, S] where each row position's output
lies in the flattened packed [R * W] (positions past a row's end point at the row's first position: they
are never trained), and ``packed_routes`` [R, W, L, k] under MoE routing replay.
"""
from __future__ import annotations

import torch

PACK_KEYS = ("packed_ids", "packed_segments", "packed_positions", "unpack_index", "packed_routes")


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Row indices per packed row: longest first, each row into the first packed row it fits (capacity
    positions), a new packed row when none has room. A row longer than `capacity` is refused."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] > capacity:
            raise ValueError(f"row {i} of {lengths[i]} positions does not fit a packed row of {capacity}")
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def pack(mb: dict[str, torch.Tensor], lengths: torch.Tensor, bins: list[list[int]] | None = None) -> dict:
    """`mb` with the PACK_KEYS added: its rows (row i's first lengths[i] positions) placed by `bins` (row
    indices per packed row; default first-fit decreasing into packed rows as wide as the longest row).
    The packed width is the fullest packed row's."""
    ids = mb["input_ids"]
    n, w = ids.shape
    lengths = lengths.long()
    if bins is None:
        bins = first_fit_decreasing(lengths.tolist(), int(lengths.max()))
    placed = sorted(i for b in bins for i in b)
    if placed != list(range(n)):
        raise ValueError(f"a packing must place each of the {n} rows exactly once, got rows {placed}")
    # Each row's packed row and offset there, in plain Python (a few tensor ops per packed row cost more).
    row_length = lengths.tolist()
    packed_row, offset, fill = [0] * n, [0] * n, []
    for r, rows in enumerate(bins):
        at = 0
        for i in rows:
            packed_row[i], offset[i] = r, at
            at += row_length[i]
        fill.append(at)
    width = max(fill)
    positions = torch.arange(w).expand(n, w)
    real = positions < lengths[:, None]
    start = torch.tensor(packed_row) * width + torch.tensor(offset)
    flat = start[:, None] + positions  # [n, w] where each position lands
    unpack_index = torch.where(real, flat, flat[:, :1])
    dest = flat[real]
    packed_ids = torch.zeros(len(bins) * width, dtype=ids.dtype)
    packed_ids[dest] = ids[real]
    segments = torch.full((len(bins) * width,), -1, dtype=torch.long)
    segments[dest] = torch.arange(n)[:, None].expand(n, w)[real]
    row_positions = torch.zeros(len(bins) * width, dtype=torch.long)
    row_positions[dest] = positions[real]
    out = {**mb, "packed_ids": packed_ids.view(len(bins), width),
           "packed_segments": segments.view(len(bins), width),
           "packed_positions": row_positions.view(len(bins), width), "unpack_index": unpack_index}
    if "routes" in mb:  # [n, w, L, k]: unplaced positions get experts 0..k-1, as the batch's own padding
        routes = mb["routes"]
        layers, k = routes.shape[2:]
        packed = torch.arange(k, dtype=routes.dtype).repeat(len(bins) * width, layers, 1)
        packed[dest] = routes[real]
        out["packed_routes"] = packed.view(len(bins), width, layers, k)
    return out


def unpacked(mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`mb` without its PACK_KEYS (the rows alone)."""
    return {k: v for k, v in mb.items() if k not in PACK_KEYS}


def model_input_ids(mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the model runs on: the packed rows of a packed micro-batch, else its rows."""
    return mb.get("packed_ids", mb["input_ids"])


def model_routes(mb: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The recorded routes laid out as `model_input_ids` (None: the micro-batch carries none)."""
    return mb.get("packed_routes" if "unpack_index" in mb else "routes")


def rows_layout(values: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, S, ...] per-position values (the routers' own choices) of what the model ran on, in the rows' layout."""
    return unpack(values, mb["unpack_index"].to(values.device)) if "unpack_index" in mb else values


def next_token_values(values: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, S] per-token values of the micro-batch's rows (log-probs, entropies: position t's from the model's
    output at t-1; column 0 is 0) from those computed on what the model ran on (`model_input_ids`). Packed,
    a row's first position read the end of the row before it: it is set to 0 like an unpacked row's."""
    if "unpack_index" not in mb:
        return values
    rows = rows_layout(values, mb)
    return torch.cat([torch.zeros_like(rows[:, :1]), rows[:, 1:]], dim=1)


def unpack(packed: torch.Tensor, unpack_index: torch.Tensor) -> torch.Tensor:
    """[R, W, ...] outputs of the packed rows -> [B, S, ...] in the micro-batch's own layout (a gather: its
    backward adds each row position's gradient to the packed position it came from)."""
    flat = packed.reshape(-1, *packed.shape[2:])
    return flat[unpack_index.reshape(-1)].reshape(*unpack_index.shape, *packed.shape[2:])


def attention_mask(segments: torch.Tensor) -> torch.Tensor:
    """[R, 1, W, W] bool, True = masked: a position attends to earlier-or-same positions of its own row only.
    Unplaced positions (segment -1) attend among themselves, so no softmax row is empty."""
    width = segments.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=segments.device).triu(1)
    other_row = segments[:, :, None] != segments[:, None, :]
    return (other_row | causal).unsqueeze(1)


def additive_attention_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`attention_mask` as HF transformers takes a ready 4D mask: 0 where attended, the dtype's lowest where
    not (added to the scores by its eager attention, passed on by its SDPA one)."""
    masked = attention_mask(segments)
    return torch.zeros(masked.shape, dtype=dtype, device=segments.device).masked_fill(masked, torch.finfo(dtype).min)
