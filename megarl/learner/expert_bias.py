"""Experts whose linears carry biases (gpt-oss) trainable in megatron-core 0.16.1 without expert parallelism.

Why: an expert's MLP adds its ``linear_fc2`` bias, scaled by the token's routing probability, into the linear's
output in place (``output += output_bias * per_token_scale``, megatron/core/transformer/mlp.py). Without expert
or tensor parallelism that output is what ``reduce_from_tensor_model_parallel_region`` (an autograd Function, the
identity over a group of one) returned as it was, and autograd refuses an in-place change of such a view while
gradients are recorded ("Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace"). Under
expert parallelism the expert linears skip that Function and nothing needs doing. `copy_expert_outputs(gpt)` gives
each affected expert's ``linear_fc2`` a fresh output tensor (one copy of the expert's output rows per call).
"""
from __future__ import annotations


def copy_expert_outputs(gpt) -> None:
    """Make every biased expert ``linear_fc2`` of `gpt` that passes its output through the identity region return a
    copy of it (no-op for models without such experts)."""
    for name, module in gpt.named_modules():
        if (".experts.local_experts." in name and name.endswith("linear_fc2") and getattr(module, "bias", None)
                is not None and not getattr(module, "explicit_expert_comm", False)):
            module.register_forward_hook(_copied)


def _copied(module, args, output):
    out, bias = output
    return out.clone(), bias
