"""Sequence packing: a micro-batch's rows laid end to end in fewer rows, so the model computes almost no
padding, and what it computes read back in the rows' own layout; rows that begin alike share those positions.

A learner step's rows are long-tailed (a few long completions, many short ones). Cutting them into
micro-batches of similar length (megarl.learner.step.micro_batch_rows) still leaves a fifth to a third of the
computed positions padding on the demo. Packing puts several rows into one *packed row* of at most `capacity`
positions, and an attention mask keeps each row to its own positions, causally.

Prefix sharing (`share_prefixes`, the default): a group's samples all begin with the same prompt, and often with
the same first completion tokens. The model's output at a position depends only on the tokens up to it and their
position ids, so two rows that agree on their first k tokens need those k positions computed once. Rows are laid
out in lexicographic order; each one reuses the positions of its common prefix with the row before it in its
packed row and appends only the rest, whose tokens attend to the shared prefix and to their own earlier tokens
(each packed position attends exactly to its path from the row's start: the mask), at their own row's position
ids. A packed row is a prefix tree of the rows it holds. Rows whose first tokens differ share nothing and pack as
plain first-fit packing would. Not under routing replay (each row replays its own recorded routes, which two rows
need not agree on).

The model runs on the packed rows; per-token log-probs are computed on the packed positions and each row token's
is read from the position that predicts it (the packed position of the row's previous token: `token_logprobs`),
as are entropies (`next_token_values`) and the routers' choices (`rows_layout`). Everything after them (the loss,
metrics, router agreement) is the same code on the same [rows, width] layout as without packing.

The capacity is the micro-batch's longest row, so a packed row is never wider than an unpacked one: activation
memory per micro-batch stays within its unpacked bound. Every position gets its own row's position id
(`packed_positions`: megatron's rotary embedding reads them through megarl.learner.rotary_positions, HF models
take them as position_ids), so a shared or offset row sees exactly the rotary angles it sees unpacked.

A packed micro-batch carries, besides its own fields, the keys of PACK_KEYS:
``packed_ids`` [R, W] the packed tokens (0 where nothing is placed), ``packed_owner`` [R, W] which row of the
micro-batch placed each position (-1: nothing; the position attends to that row's positions up to it: the mask,
built per forward by `attention_mask`), ``packed_positions`` [R, W] each position's index within its rows (the
position ids), ``unpack_index`` [B, S] where each row position lies in the flattened packed [R * W] (positions past
a row's end point at the row's first position: they are never trained), and ``packed_routes`` [R, W, L, k] under
MoE routing replay.
"""
from __future__ import annotations

import torch

PACK_KEYS = ("packed_ids", "packed_owner", "packed_positions", "unpack_index", "packed_routes")


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


def prefix_sharing_bins(rows: list[list[int]], capacity: int) -> list[list[int]]:
    """Row indices per packed row when rows share prefixes. In lexicographic order rows with a common prefix are
    neighbours: each run of neighbours sharing one (each adding only its positions past its common prefix with
    the row before it) becomes one item while it fits `capacity`; the items go first-fit decreasing into packed
    rows, so rows that share nothing pack as plain first-fit packing would. A row longer than `capacity` is
    refused."""
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    items: list[list[int]] = []
    sizes: list[int] = []
    for i in order:
        if len(rows[i]) > capacity:
            raise ValueError(f"row {i} of {len(rows[i])} positions does not fit a packed row of {capacity}")
        shared = common_prefix(rows[items[-1][-1]], rows[i]) if items else 0
        if shared and sizes[-1] + len(rows[i]) - shared <= capacity:
            items[-1].append(i)
            sizes[-1] += len(rows[i]) - shared
        else:
            items.append([i])
            sizes.append(len(rows[i]))
    return [[i for item in packed_row for i in items[item]] for packed_row in first_fit_decreasing(sizes, capacity)]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens `a` and `b` have in common."""
    n = min(len(a), len(b))
    for t in range(n):
        if a[t] != b[t]:
            return t
    return n


def shares_prefixes(mb: dict[str, torch.Tensor], share_prefixes: bool) -> bool:
    """Whether `mb`'s rows are laid out sharing prefixes: asked for, and no routes to replay (each row replays its
    own recorded routes, which two rows need not agree on at a shared position)."""
    return share_prefixes and "routes" not in mb


def plan_bins(ids: torch.Tensor, lengths: list[int], capacity: int, share: bool) -> list[list[int]]:
    """Row indices per packed row for rows ids[i, :lengths[i]]: `prefix_sharing_bins` when sharing, else
    first-fit decreasing."""
    if not share:
        return first_fit_decreasing(lengths, capacity)
    return prefix_sharing_bins([row[:n] for row, n in zip(ids.tolist(), lengths)], capacity)


def pack(mb: dict[str, torch.Tensor], lengths: torch.Tensor, bins: list[list[int]] | None = None,
         share_prefixes: bool = False) -> dict:
    """`mb` with the PACK_KEYS added: its rows (row i's first lengths[i] positions) placed by `bins` (row
    indices per packed row, laid out in that order; default: `prefix_sharing_bins` when sharing, else
    first-fit decreasing, into packed rows as wide as the longest row). With `share_prefixes` (ignored when
    `mb` carries routes) a row reuses the positions of its common prefix with the row before it in its packed
    row. The packed width is the fullest packed row's."""
    ids = mb["input_ids"]
    n, w = ids.shape
    row_length = lengths.long().tolist()
    share = shares_prefixes(mb, share_prefixes)
    rows = [r[:length] for r, length in zip(ids.tolist(), row_length)] if share else None
    if bins is None:
        bins = plan_bins(ids, row_length, max(row_length), share)
    placed = sorted(i for b in bins for i in b)
    if placed != list(range(n)):
        raise ValueError(f"a packing must place each of the {n} rows exactly once, got rows {placed}")
    # Each row position's column in its packed row, in plain Python (tensor ops per row cost more): a shared
    # prefix's columns are the row before's, the rest appended. `owners`: (row, depth) of each new position.
    columns: list[list[int]] = [[] for _ in range(n)]
    packed_row, fill, owners = [0] * n, [], []
    for r, members in enumerate(bins):
        at, before = 0, None
        for i in members:
            shared = common_prefix(rows[before], rows[i]) if share and before is not None else 0
            new = row_length[i] - shared
            columns[i] = columns[before][:shared] + list(range(at, at + new)) if shared else list(range(at, at + new))
            owners.extend((i, shared + j) for j in range(new))
            packed_row[i], at, before = r, at + new, i
        fill.append(at)
    width, count = max(fill), len(bins)
    # Positions past a row's end point at its first position (never trained).
    cols = torch.tensor([c + [c[0]] * (w - len(c)) for c in columns])
    unpack_index = torch.tensor(packed_row)[:, None] * width + cols
    real = torch.arange(w).expand(n, w) < lengths.long()[:, None]
    dest = unpack_index[real]
    packed_ids = torch.zeros(count * width, dtype=ids.dtype)
    packed_ids[dest] = ids[real]
    packed_positions = torch.zeros(count * width, dtype=torch.long)
    packed_positions[dest] = torch.arange(w).expand(n, w)[real]
    # Which row placed each position (its path is that row's, up to the position's depth: `attention_mask`).
    owner, depth = torch.tensor(owners).T
    packed_owner = torch.full((count * width,), -1, dtype=torch.long)
    packed_owner[unpack_index[owner, depth]] = owner
    out = {**mb, "packed_ids": packed_ids.view(count, width), "packed_owner": packed_owner.view(count, width),
           "packed_positions": packed_positions.view(count, width), "unpack_index": unpack_index}
    if "routes" in mb:  # [n, w, L, k]: unplaced positions get experts 0..k-1, as the batch's own padding
        routes = mb["routes"]
        layers, k = routes.shape[2:]
        packed = torch.arange(k, dtype=routes.dtype).repeat(count * width, layers, 1)
        packed[dest] = routes[real]
        out["packed_routes"] = packed.view(count, width, layers, k)
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


def predicting_positions(mb: dict[str, torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """[B, S - 1] where in the flattened packed rows each row token t >= 1 is predicted: its previous token's
    position (shared by the rows whose prefixes agree)."""
    return mb["unpack_index"][:, :-1].to(device)


def next_token_values(values: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, S] per-token values of the micro-batch's rows (entropies: token t's from the model's output at the
    position that predicts it; column 0 is 0) from per-position values [B', S'] of what the model ran on
    (`model_input_ids`)."""
    if "unpack_index" not in mb:
        return torch.nn.functional.pad(values[:, :-1], (1, 0))
    return torch.nn.functional.pad(values.reshape(-1)[predicting_positions(mb, values.device)], (1, 0))


def token_logprobs(logits: torch.Tensor, mb: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """[B, S] log-probs of a packed micro-batch's row tokens from the packed rows' logits [R, W, V] / T: token t's
    from the log-softmax at the position that predicts it; column 0 is 0. The log-softmax runs once per packed
    position (fewer than the rows' positions), then one value per row token is gathered."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    logp = torch.log_softmax(flat if temperature == 1.0 else flat / temperature, dim=-1)
    target = mb["input_ids"][:, 1:].to(logits.device)
    return torch.nn.functional.pad(logp[predicting_positions(mb, logits.device), target], (1, 0))


def unpack(packed: torch.Tensor, unpack_index: torch.Tensor) -> torch.Tensor:
    """[R, W, ...] outputs of the packed rows -> [B, S, ...] in the micro-batch's own layout (a gather: its
    backward adds each row position's gradient to the packed position it came from; `...` may hold no element:
    a pipeline stage without MoE layers unpacks its [R, W, 0, k] router choices)."""
    flat = packed.flatten(0, 1)
    return flat[unpack_index.reshape(-1)].reshape(*unpack_index.shape, *packed.shape[2:])


# Query positions x keys whose int32 path depths `attention_mask` compares at a time (4 MiB).
MASK_SLICE_ELEMENTS = 2**20


def attention_mask(mb: dict[str, torch.Tensor], width: int | None = None,
                   device: torch.device | str | None = None, window: int | None = None,
                   queries: torch.Tensor | None = None, keys: torch.Tensor | None = None) -> torch.Tensor:
    """[R, 1, Q, K] bool on `device`, True = masked: each packed position attends to its own path (the columns of
    the row that placed it, up to its depth), built there from the packed micro-batch's compact fields (the mask is
    R x Q x K: it is never kept); the packed rows widened to `width` positions (sequence and context parallelism
    pad them). `queries` / `keys`: the columns of the mask's rows / columns, in that order (default: all `width`;
    context parallelism: a rank's own columns against every rank's, megarl.learner.context_parallel), so a rank
    builds only its queries' rows. Unplaced and added positions attend to themselves alone, so no softmax row is
    empty. `window` (megarl.models.families.sliding_window): only the path's last `window` positions, the
    position's own included, by depth (its row's position ids), not by packed column."""
    owner = mb["packed_owner"].to(device)
    count, packed = owner.shape
    width = width or packed
    dev = owner.device
    queries = torch.arange(width, device=dev) if queries is None else queries.to(dev)
    keys = torch.arange(width, device=dev) if keys is None else keys.to(dev)
    nq, nk = len(queries), len(keys)
    query_slot = torch.full((width,), -1, dtype=torch.long, device=dev)
    query_slot[queries] = torch.arange(nq, device=dev)
    key_slot = torch.full((width,), -1, dtype=torch.long, device=dev)
    key_slot[keys] = torch.arange(nk, device=dev)
    depth = mb["packed_positions"].to(device).reshape(-1)
    columns = mb["unpack_index"].to(device) % packed  # [B, S] each row position's column in its packed row
    rows, length = columns.shape
    # at[r, c]: the depth at which row r's path passes column c (`never` where it does not): a key is on a query's
    # path when the query's row passes it at a depth up to the query's own. (Positions past a row's end point at its
    # first column: the minimum keeps that column's depth 0.)
    never = torch.iinfo(torch.int32).max
    at = torch.full((rows, width), never, dtype=torch.int32, device=dev)
    at.scatter_reduce_(1, columns, torch.arange(length, dtype=torch.int32, device=dev).expand(rows, length), "amin")
    at = at[:, keys]  # [B, K] in the keys' order
    flat_owner = owner.reshape(-1)
    placed = torch.nonzero((flat_owner >= 0) & (query_slot[:packed].repeat(count) >= 0))[:, 0]
    allowed = torch.zeros(count, nq, nk, dtype=torch.bool, device=dev)
    # In slices of queries: each slice's [queries, K] int32 depths are 4 times its mask's bytes.
    for part in placed.split(max(1, MASK_SLICE_ELEMENTS // max(1, nk))):
        passed = at[flat_owner[part]]  # [n, K]
        query_depth = depth[part][:, None].to(torch.int32)
        on_path = passed <= query_depth
        if window is not None:
            on_path &= passed > query_depth - window
        allowed[part // packed, query_slot[part % packed]] = on_path
    allowed[:, torch.arange(nq, device=dev), key_slot[queries]] = True  # (each query's own position)
    return ~allowed.unsqueeze(1)


def causal_mask(length: int, device: torch.device | str | None = None, window: int | None = None,
                queries: torch.Tensor | None = None, keys: torch.Tensor | None = None) -> torch.Tensor:
    """[1, 1, Q, K] bool, True = masked: each position attends to itself and the positions before it, only the last
    `window` of them (its own included) under a sliding window. `queries` / `keys`: the positions of the mask's
    rows / columns (default: 0..length-1; context parallelism: a rank's own against every rank's)."""
    queries = torch.arange(length, device=device) if queries is None else queries.to(device)
    keys = torch.arange(length, device=device) if keys is None else keys.to(device)
    masked = keys[None, :] > queries[:, None]  # (compared as they broadcast: no [Q, K] int64 of differences)
    if window is not None:
        masked |= keys[None, :] <= queries[:, None] - window
    return masked.view(1, 1, len(queries), len(keys))


def additive_attention_mask(mb: dict[str, torch.Tensor], dtype: torch.dtype,
                            device: torch.device | str | None = None, window: int | None = None) -> torch.Tensor:
    """`attention_mask` as HF transformers takes a ready 4D mask: 0 where attended, the dtype's lowest where
    not (added to the scores by its eager attention, passed on by its SDPA one). transformers uses a ready mask
    as it is, so a sliding-window model's `window` has to be in it."""
    masked = attention_mask(mb, device=device, window=window)
    return torch.zeros(masked.shape, dtype=dtype, device=masked.device).masked_fill(masked, torch.finfo(dtype).min)


# An attention layout: [R, 3, K] int64, per key position (rows: column, subtree end, depth) — `attention_layout`.
COLUMN, END, DEPTH = 0, 1, 2


def attention_layout(mb: dict[str, torch.Tensor] | None, width: int, device: torch.device | str | None = None,
                     keys: torch.Tensor | None = None) -> torch.Tensor:
    """[R, 3, K] int64 on `device`: what `attention_mask` (packed micro-batch `mb`) or `causal_mask` (`mb` None; R =
    1) says, in O(R * K) numbers instead of R x Q x K bits. Per position: its column, the last column of its subtree
    and its depth (its row's position id). `pack` lays each packed row out as a prefix tree in preorder (a row
    appends its new positions after everything placed so far, below a position of the row before it, whose path
    is the only one still growing), so the positions below a column c are exactly the columns c..end[c]: a query at
    column q attends a key at column k when k <= q <= end[k] (k is on q's path; under a `window`, only where the
    key's depth is above the query's minus the window: `layout_mask`). Causal rows are one path: end = the last
    column. Unplaced and added positions (columns past the packed width) end at themselves, so they attend to
    themselves alone. `keys`: the columns described, in that order (default: all `width`; context parallelism:
    every rank's, megarl.learner.context_parallel.key_columns)."""
    column = torch.arange(width, device=device)
    if mb is None:
        layout = torch.stack([column, torch.full_like(column, width - 1), column])[None]
    else:
        owner = mb["packed_owner"].to(device)
        count, packed = owner.shape
        flat = mb["unpack_index"].to(device)  # [B, S] each row position's flat packed index (path order)
        # Each position's subtree ends at the furthest last column of the rows that pass it (their paths' columns
        # increase; positions past a row's end point at its first column, which the row passes too).
        end = torch.arange(count * packed, device=flat.device)
        end.scatter_reduce_(0, flat.reshape(-1), flat.max(dim=1).values[:, None].expand_as(flat).reshape(-1),
                            "amax")
        end = torch.nn.functional.pad((end % packed).view(count, packed), (0, width - packed), value=0)
        end = torch.where(column < packed, end, column)
        depth = torch.nn.functional.pad(mb["packed_positions"].to(device), (0, width - packed))
        layout = torch.stack([column.expand(count, width), end, depth], dim=1)
    return layout if keys is None else layout[:, :, keys.to(layout.device)]


def layout_mask(queries: torch.Tensor, keys: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[R, 1, Q, K] bool, True = masked, of attention layouts `queries` [R, 3, Q] and `keys` [R, 3, K]
    (`attention_layout`): a query attends a key on its path (k <= q <= end[k]) within `window` depths, and
    itself. Pure."""
    q_column, q_depth = queries[:, COLUMN, :, None], queries[:, DEPTH, :, None]
    k_column, k_end, k_depth = (keys[:, field, None, :] for field in (COLUMN, END, DEPTH))
    allowed = (k_column <= q_column) & (q_column <= k_end)
    if window is not None:
        allowed &= k_depth > q_depth - window
    allowed |= k_column == q_column
    return ~allowed.unsqueeze(1)
