"""Context parallelism (``learner.cp``): each packed row's positions split over the ranks of a CP group.

Why: a row's activations (and its attention mask) grow with its length; at long rollouts one row no longer fits one
TP group. With cp = N every rank of a CP group holds W / N of each row's W positions for the whole model; the
attention is the only place positions meet, and there each rank's queries attend to every rank's keys and values,
all-gathered inside the CP group (`gather_sequence`, whose backward reduce-scatters dK and dV back to the ranks
that hold them). Each rank's mask is [its W / N queries x all W keys], never W x W.

Load balancing: megatron's 2N-chunk zig-zag (`local_columns`). A causal query at position p attends to p + 1 keys,
so a contiguous split would hand the last rank ~(2N - 1) times the first one's attention work and leave the others
waiting on it in every layer's all-gather. Cutting the width into 2N chunks and giving rank r chunks r and
2N - 1 - r pairs a cheap chunk with an expensive one: every rank does the same causal work on a full row (a packed
row's short rows attend less, so there the balance is close, not exact).

Megatron-core's own context parallelism needs Transformer Engine's attention, which CPU runs never have; megarl's
attention (megarl.learner.sdpa_attention) carries it instead, and the learner (megarl.learner.megatron) reads the
per-token log-probs and per-position entropies back into the rows' own layout (`positions_to_rows`): every rank
computes the whole micro-batch's loss on them, so every normaliser and statistic is the cp = 1 one. The gradient
of rank r's parameters is then its own positions' share of that loss's gradient: megatron's DDP sums the shares
over the data-parallel x context-parallel group, as it does for data parallelism (LoRA adapters included: they
are parameters of that model). Everything else that meets positions is per position: an MoE layer's routers and
experts see the rank's positions (under r3 the recorded routes of its columns, cut like the tokens; expert-parallel
ranks may span the CP group, their alltoall trading each rank's tokens). The critic and the distillation teacher,
replicated transformers models that need whole rows, split each micro-batch's rows over the CP ranks instead
(`row_share`) and gather their per-token values back (`rows_from_shares`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def local_columns(width: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The columns of a row of `width` positions (a multiple of 2 * cp) that CP rank `cp_rank` holds, in the order
    it holds them: chunk cp_rank, then chunk 2 * cp - 1 - cp_rank (megatron's zig-zag)."""
    if width % (2 * cp):
        raise ValueError(f"context parallelism needs the width ({width}) to be a multiple of 2 * cp = {2 * cp}")
    chunk = width // (2 * cp)
    first, second = cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def key_columns(width: int, cp: int) -> torch.Tensor:
    """The columns of the all-gathered keys, in the order `gather_sequence` lays them out: rank 0's local
    columns, then rank 1's, ..."""
    return torch.cat([local_columns(width, cp, r) for r in range(cp)])


def slots(columns: torch.Tensor, width: int) -> torch.Tensor:
    """[width] each column's index in `columns` (-1: not among them)."""
    slot = torch.full((width,), -1, dtype=torch.long)
    slot[columns] = torch.arange(len(columns))
    return slot


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over a group; the backward sums every rank's gradient of each chunk (a
    reduce-scatter) and keeps this rank's."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        chunk = grad.shape[0] // size
        if grad.is_cuda and "nccl" in str(dist.get_backend(group)):
            out = torch.empty((chunk, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        # (gloo, CPU or CUDA tensors, has no reduce-scatter: the sum of the whole gradient, then this rank's chunk)
        dist.all_reduce(grad, group=group)
        return grad.narrow(0, rank * chunk, chunk).clone(), None


def gather_sequence(local: torch.Tensor, group) -> torch.Tensor:
    """[N * S_local, ...] every CP rank's `local` [S_local, ...] (the keys or values of its positions), rank order."""
    return _GatherSequence.apply(local, group)


class _SumReplicated(torch.autograd.Function):
    """Sum over a group of per-rank parts of one value that every rank then uses whole (the replicated loss): the
    backward hands each rank's part the gradient unchanged (megatron's reduce_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, group) -> torch.Tensor:
        total = part.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_parts(part: torch.Tensor, group) -> torch.Tensor:
    """The sum over the CP group of each rank's `part` (zeros where it holds nothing), with gradient."""
    return _SumReplicated.apply(part, group)


def positions_to_rows(values: torch.Tensor, columns: torch.Tensor, width: int, group) -> torch.Tensor:
    """[R, width] per-position values of whole rows from each CP rank's [R, W_local] values at its `columns`."""
    full = values.new_zeros((values.shape[0], width, *values.shape[2:]))
    full[:, columns.to(values.device)] = values
    return sum_parts(full, group)


def predicting_local(mb: dict[str, torch.Tensor], columns: torch.Tensor, width: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(mine [B, S - 1] bool, index [N]): which row tokens t >= 1 of the micro-batch this CP rank predicts (the
    position of the token before t is among its `columns`), and where in its flattened [R * W_local] output each
    of those is. `width`: the padded width of what the model ran on."""
    ids = mb["input_ids"]
    b, s = ids.shape
    if "unpack_index" in mb:
        packed = mb["packed_ids"].shape[1]
        index = mb["unpack_index"][:, :-1]
        row, column = index // packed, index % packed
    else:
        row = torch.arange(b)[:, None].expand(b, s - 1)
        column = torch.arange(s - 1)[None, :].expand(b, s - 1)
    slot = slots(columns, width)[column]
    mine = slot >= 0
    return mine.to(device), (row * len(columns) + slot)[mine].to(device)


def row_share(rows: int, size: int, rank: int) -> slice:
    """The rows of a micro-batch of `rows` that rank `rank` of a group of `size` computes where the group's ranks hold
    the same rows and split whole rows among them (contiguous shares, sizes differing by at most one row)."""
    base, extra = divmod(rows, size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def rows_from_shares(local: torch.Tensor, share: slice, rows: int, group) -> torch.Tensor:
    """[rows, ...] every rank's `local` [its share's rows, ...] of a row-split group (`row_share`) put back
    together on every rank: zeros elsewhere, summed over the group (exact). No gradient."""
    whole = local.new_zeros((rows, *local.shape[1:]))
    whole[share] = local
    dist.all_reduce(whole, group=group)
    return whole


def rows_in_shares(compute, input_ids: torch.Tensor, split: tuple[int, int], group, device) -> torch.Tensor:
    """[B, S] per-token values of every row of `input_ids` [B, S] by `compute` (ids [b, S] on `device` -> [b, S]):
    rank `split[1]` of a row-split group of `split[0]` ranks computes its share (`row_share`; zeros, fp32, when it
    has no row) and the group's shares are put back together (`rows_from_shares`); group None: all rows here."""
    share = row_share(input_ids.shape[0], *split)
    ids = input_ids[share].to(device)
    local = compute(ids) if len(ids) else torch.zeros(ids.shape, dtype=torch.float32, device=device)
    return local if group is None else rows_from_shares(local, share, input_ids.shape[0], group)
