"""megarl.learner.plain_linear: the megatron learner's linears compute what megatron's own linear Functions compute,
through plain torch ops where a call communicates nothing, and through megatron's Functions where it does."""
import pytest
import torch

from megarl.algo.config import LossConfig
from tests.helpers import save_tiny_qwen2


@pytest.fixture(scope="module")
def learner(tmp_path_factory, world):
    from megarl.config.schema import LearnerConfig
    from megarl.learner.megatron import MegatronLearner

    model_dir = save_tiny_qwen2(tmp_path_factory.mktemp("plain_linear") / "qwen2", tie_word_embeddings=True)
    return MegatronLearner(str(model_dir), LearnerConfig(micro_batch_size=4, lr=1e-2), LossConfig())


def _linears(learner):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return {name: m for name, m in learner.gpt.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}


def _run(impl, x, weight, bias, **kwargs):
    """Output and the gradients of input, weight and bias under one random output gradient."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, weight, bias) if t is not None]
    out = impl(input=leaves[0], weight=leaves[1], bias=leaves[2] if bias is not None else None,
               gradient_accumulation_fusion=False, sequence_parallel=False, grad_output_buffer=None,
               wgrad_deferral_limit=None, tp_group=None, **kwargs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return out.detach(), [t.grad for t in leaves], out


def test_every_linear_is_routed_and_column_linears_skip_the_identity_region_at_tp1(learner):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from megarl.learner.plain_linear import plain_linear

    linears = _linears(learner)
    # 2 layers x (qkv, proj, fc1, fc2) + the output layer (tied: it multiplies by the embedding it is handed)
    assert len(linears) == 9 and "output_layer" in linears
    for name, module in linears.items():
        assert module._forward_impl.func is plain_linear, name
        assert getattr(module, "disable_grad_reduce", False) == isinstance(module, ColumnParallelLinear), name


@pytest.mark.parametrize("which", ["decoder.layers.0.self_attention.linear_qkv", "decoder.layers.1.mlp.linear_fc2"])
@pytest.mark.parametrize("frozen", [False, True])
def test_a_plain_linear_equals_megatrons_function(learner, which, frozen):
    from megatron.core.tensor_parallel.layers import (linear_with_frozen_weight,
                                                      linear_with_grad_accumulation_and_async_allreduce)

    module = _linears(learner)[which]
    gen = torch.Generator().manual_seed(0)
    # [positions, rows, in] like megatron's [S, B, H], non-contiguous (a transposed view) as attention's outputs are
    x = torch.randn(5, 7, module.input_size, generator=gen).transpose(0, 1).requires_grad_()
    weight = module.weight.detach().clone().requires_grad_(not frozen)
    bias = module.bias.detach().clone().requires_grad_(not frozen) if module.bias is not None else None
    assert (bias is not None) == which.endswith("linear_qkv")  # Qwen2: q/k/v biases, none elsewhere
    megatron = linear_with_frozen_weight if frozen else linear_with_grad_accumulation_and_async_allreduce
    ours, expected = _run(module._forward_impl, x, weight, bias, allreduce_dgrad=False), \
        _run(megatron, x, weight, bias, allreduce_dgrad=False)
    assert type(ours[2].grad_fn).__name__ == "ViewBackward0"  # torch's autograd, not megatron's Function
    torch.testing.assert_close(ours[0], expected[0], atol=1e-6, rtol=1e-6)
    for got, want in zip(ours[1], expected[1]):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_a_call_that_communicates_is_megatrons(learner):
    # allreduce_dgrad (the input gradient all-reduced over the TP group: here a real gloo group of one) is left to
    # megatron's Function, whose node the output carries.
    module = _linears(learner)["decoder.layers.0.mlp.linear_fc1"]
    x = torch.randn(3, 2, module.input_size)
    out = _run(module._forward_impl, x.requires_grad_(), module.weight, None, allreduce_dgrad=True)[2]
    assert type(out.grad_fn).__name__ == "LinearWithGradAccumulationAndAsyncCommunicationBackward"
