"""Megatron sequence parallelism, which the megatron learner runs for mixture-of-experts models at learner.tp > 1.

Why: megatron-core 0.16.1's ``MoELayer.forward`` refuses to train under tensor parallelism without sequence
parallelism (transformer/moe/moe_layer.py: "During training, performance may degrade if MoE and tensor
parallelism are enabled without also enabling sequence parallelism"), and without it the result would not even
be exact: every TP rank would send the same tokens through the experts, so each expert's weight gradient would
count every token tp times. With ``TransformerConfig.sequence_parallel`` the embedding output is split along the
sequence: each TP rank holds [S/tp, B, H] between the attention and MLP blocks (the column-parallel linears
all-gather it, the row-parallel ones reduce-scatter back), so each rank's routers route only its own S/tp
positions. The experts are not TP-split (``expert_tensor_parallel_size=1``: each TP rank runs whole experts on its
own tokens, whose gradients megatron sums over the expert-data-parallel group, the TP ranks included), which keeps
each expert's HF tensors whole on a rank and avoids the token dispatcher's uneven all-gather over TP.

Owns what megarl adds around megatron for it:
  * ``RMSNorm``: the local layer spec's norm (``WrappedTorchNorm``) asserts "sequence parallel not supported by
    torch LayerNorm"; it only lacks the ``sequence_parallel`` mark on its weight, by which megatron's
    ``finalize_model_grads`` sums a replicated weight's gradient over the TP ranks' token slices
    (``_allreduce_non_tensor_model_parallel_grads``; megatron's router weight carries the same mark).
    megarl.learner.layer_spec puts it in place of every norm (input, pre-MLP, q/k, the final one).
  * ``mark_whole_experts``, for the two places megatron would miscount whole experts on TP ranks:
    at learner.ep == 1 megatron-core 0.16.1 takes the experts for dense parameters (their ``allreduce`` attribute
    is ``not expert_parallel``, and ``expert_parallel`` is ``expert_model_parallel_size > 1``:
    tensor_parallel/layers.py, transformer/moe/experts.py), so DDP reduces their gradients over the data-parallel
    group only, which leaves out the TP ranks holding the same whole experts for other positions: they get the
    norms' mark, so finalize_model_grads sums them over TP too (and the grad norm counts them on TP rank 0, as
    the norms). At ep > 1 they are expert-parallel parameters, reduced over megatron's expert-data-parallel group,
    which holds those TP ranks; but the EP group is then made of TP ranks (megatron orders expert ranks
    tp-ep-dp-pp with an expert TP size of 1), so TP peers hold different experts, and megatron's grad norm
    (optimizer.get_main_grads_for_grad_norm) counts a parameter without ``tensor_model_parallel`` on TP rank 0
    only. megatron sets that attribute on every linear it initialises itself; megarl loads the weights
    (``perform_initialization=False``), so it is set here: every rank counts its own experts.
  * ``pad_micro_batch``: the sequence split needs S % tp == 0; megarl trims each micro-batch to its longest row,
    so its width is padded to a multiple of tp. The padded positions come after every real one, so under causal
    attention they change no real position's output; the learner cuts the logits back to the real width before
    any loss, log-prob or entropy sees them.
  * ``local_positions``: the positions [start, end) of the padded width one TP rank's routers see.
"""
from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm (what megatron's WrappedTorchNorm builds) whose weight says whether it sees only this TP
    rank's positions (``sequence_parallel``): then megatron sums its gradient over the TP group."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def mark_whole_experts(gpt, expert_parallel: int) -> None:
    """Mark every expert weight of `gpt` `sequence_parallel` (expert_parallel == 1: its gradient is summed over
    TP) or `tensor_model_parallel` (expert_parallel > 1: not a TP peer's duplicate); see the module docstring."""
    for name, param in gpt.named_parameters():
        if ".mlp.experts." in name:
            if expert_parallel == 1:
                param.sequence_parallel = True
                # (megatron marks a column-parallel linear's bias tensor_model_parallel whatever its group's size,
                # gpt-oss's experts' linear_fc1.bias: whole here, the grad norm counts it once)
                param.tensor_model_parallel = False
            else:
                param.tensor_model_parallel = True
                # (megatron marks a row-parallel linear's bias sequence_parallel, gpt-oss's experts' linear_fc2.bias:
                # summed over TP it would add other experts' gradients to it)
                param.sequence_parallel = False


def pad_micro_batch(input_ids: torch.Tensor, routes: torch.Tensor | None,
                    multiple: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """input_ids [B, S] (and routes [B, S, L, k]) with S padded to a multiple of `multiple`: token 0, and the
    experts 0..k-1 (k distinct experts per layer, as the batch's own padding: megarl.rollout.routes)."""
    pad = -input_ids.shape[1] % multiple
    if pad == 0:
        return input_ids, routes
    input_ids = torch.nn.functional.pad(input_ids, (0, pad))
    if routes is not None:
        b, _, layers, k = routes.shape
        filler = torch.arange(k, dtype=routes.dtype).expand(b, pad, layers, k)
        routes = torch.cat([routes, filler], dim=1)
    return input_ids, routes


def local_positions(width: int, tp: int, tp_rank: int) -> slice:
    """The positions of a padded micro-batch (width % tp == 0) one TP rank holds: megatron's split of the
    [S, B, H] embedding output along S (tensor_parallel.scatter_to_sequence_parallel_region)."""
    if width % tp:
        raise ValueError(f"sequence parallelism needs the micro-batch width ({width}) to be a multiple of tp={tp}")
    share = width // tp
    return slice(tp_rank * share, (tp_rank + 1) * share)
