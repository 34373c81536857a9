"""OLMo 2's norms in megatron-core (megarl.models.families' ``post_norms``), as transformers' Olmo2DecoderLayer has
them: no norm before attention or the MLP, an RMSNorm on each block's output before its residual add, and q_norm /
k_norm over the whole q / k projection rather than per head.

megatron-core 0.16.1's TransformerLayer has only pre-norms; its bias-dropout-add (``self_attn_bda`` / ``mlp_bda``)
is the one module that sees a block's output before the residual add, so ``PostNormAdd`` is that add with the norm
in it (its weight: ``decoder.layers.N.self_attn_bda.norm.weight``, megarl.models.convert.POST_NORMS). Its q/k
norms (``q_layernorm`` / ``k_layernorm``) get the local heads [s, b, heads / tp, head_dim]; ``ProjectionRMSNorm``
normalises over all of them, the sum of squares summed over the TP group when heads are split (its gradient too:
every rank's normalisation depends on every rank's squares), with this rank's heads' slice of the weight.
"""
from __future__ import annotations

import dataclasses

import torch


class _SumOverGroup(torch.autograd.Function):
    """all_reduce (sum) over `group` whose backward is the all_reduce of the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class PostNormAdd(torch.nn.Module):
    """``residual + RMSNorm(block output)``, called as megatron calls a bias-dropout-add: ``bda(training, fused)``
    gives the function of (output, bias), residual and dropout probability. (megarl trains without dropout and
    OLMo 2 has no biases; a bias is added before the norm, where megatron's linear leaves it out.)"""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden_size, eps=eps)

    def forward(self, training: bool, fused: bool):
        def add(output_with_bias, residual, prob):
            output, bias = output_with_bias
            return residual + self.norm(output if bias is None else output + bias)

        return add


class ProjectionRMSNorm(torch.nn.Module):
    """RMSNorm over every head of a q or k projection ([s, b, local heads, head_dim] in, same out); `heads`:
    the TransformerConfig field counting them (num_attention_heads for q, num_query_groups for k)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, heads: str = "num_attention_heads", **_unused):
        super().__init__()
        self.tp = config.tensor_model_parallel_size
        total = getattr(config, heads)
        if total % self.tp:
            raise ValueError(f"tensor parallel size {self.tp} does not divide {heads}={total}")
        self.weight = torch.nn.Parameter(torch.ones(total // self.tp * hidden_size))
        self.eps, self.width = eps, total * hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(*x.shape[:-2], -1).float()
        squares = flat.pow(2).sum(-1, keepdim=True)
        if self.tp > 1:
            from megatron.core import parallel_state

            squares = _SumOverGroup.apply(squares, parallel_state.get_tensor_model_parallel_group())
        normed = flat * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight * normed).to(x.dtype).reshape(x.shape)


def post_norm_spec(spec, hidden_size: int, eps: float):
    """megatron's local layer `spec` with OLMo 2's norms: identity pre-norms, PostNormAdd bias-dropout-adds and
    ProjectionRMSNorm q/k norms."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    layer = spec.submodules
    attention = layer.self_attention
    qk = dataclasses.replace(
        attention.submodules,
        q_layernorm=ModuleSpec(module=ProjectionRMSNorm, params={"heads": "num_attention_heads"}),
        k_layernorm=ModuleSpec(module=ProjectionRMSNorm, params={"heads": "num_query_groups"}))
    add = ModuleSpec(module=PostNormAdd, params={"hidden_size": hidden_size, "eps": eps})
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        layer, input_layernorm=IdentityOp, pre_mlp_layernorm=IdentityOp, self_attn_bda=add, mlp_bda=add,
        self_attention=dataclasses.replace(attention, submodules=qk)))
