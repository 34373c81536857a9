"""The megatron learner's linears computed by plain torch ops wherever they communicate nothing.

Why: megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` compute through
``LinearWithGradAccumulationAndAsyncCommunication``, a Python autograd Function whose backward is Python (saved
tensors, the optional all-gather of sequence parallelism, wgrad deferral, reshapes, two matmuls), and a column-
parallel linear also passes its input through ``copy_to_tensor_model_parallel_region``, another Python autograd
Function that is the identity over a tensor-parallel group of one. When a call has no all-reduce of the input
gradient, no sequence parallelism, no gradient-accumulation fusion and no deferred weight gradient, that Function
computes ``x @ W.T + b``, which torch's own autograd differentiates in C++ (the same matmuls). A tiny model pays
the difference on every call: on the demo's learner step (9 linears per micro-batch, one core) it was ~4-8% of the
step (docs/learner.md, "Plain linears").

`use_plain_linears(model)` points each megatron linear's ``_forward_impl`` (the one place megatron routes the
matmul through, trainable and frozen weights alike) at `plain_linear`, which checks every call's arguments and
hands any call that does communicate or fuse to megatron's own function. At tensor-parallel size 1 a column-parallel
linear is also marked ``disable_grad_reduce`` (there is no other rank's gradient to reduce), so its input skips the
identity region. Over TP > 1 the regions and the communicating calls stay megatron's.
"""
from __future__ import annotations

import functools

import torch


def plain_linear(megatron_impl, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                 sequence_parallel=False, grad_output_buffer=None, **kwargs):
    """`megatron_impl`'s result for these arguments; when the call communicates and fuses nothing, the same product
    as one 2D matrix product over every position. (Always that one product: ``F.linear`` and ``torch.matmul`` fold
    the positions into one product or not depending on the input's layout and on autograd, so a frozen copy in eval
    mode would round differently from the training model, and a KL to it must be exactly 0 at step 0.)"""
    if allreduce_dgrad or sequence_parallel or grad_output_buffer is not None or (
            gradient_accumulation_fusion and hasattr(weight, "main_grad")):
        return megatron_impl(input, weight, bias=bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
                             allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                             grad_output_buffer=grad_output_buffer, **kwargs)
    flat = input.reshape(-1, input.shape[-1])
    out = torch.mm(flat, weight.t()) if bias is None else torch.addmm(bias, flat, weight.t())
    return out.view(*input.shape[:-1], weight.shape[0])


def use_plain_linears(model, tp_size: int) -> None:
    """Route every megatron linear of `model` through `plain_linear`."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module._forward_impl = functools.partial(plain_linear, module._forward_impl)
            if tp_size == 1 and isinstance(module, ColumnParallelLinear):
                module.disable_grad_reduce = True
