"""megarl.portable.lora_merge: the one LoRA merge (the built-in engine's AdapterStager, megarl's vLLM worker and
the learner's merged publish to SGLang all run it); checked against the formula and, for whole models, against
peft in tests/learner/test_lora.py."""
from __future__ import annotations

import pytest
import torch

from megarl.portable import lora_merge

Q_A, Q_B = "model.layers.0.self_attn.q_proj.lora_A.weight", "model.layers.0.self_attn.q_proj.lora_B.weight"


def _base():
    g = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(10, 6, generator=g),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 6, generator=g),
            "model.layers.0.self_attn.q_proj.bias": torch.randn(8, generator=g),
            "model.layers.0.mlp.down_proj.weight": torch.randn(6, 4, generator=g).to(torch.bfloat16)}


def _adapter(rank=2):
    g = torch.Generator().manual_seed(1)
    return {Q_A: torch.randn(rank, 6, generator=g), Q_B: torch.randn(8, rank, generator=g),
            "model.layers.0.mlp.down_proj.lora_A.weight": torch.randn(rank, 4, generator=g),
            "model.layers.0.mlp.down_proj.lora_B.weight": torch.randn(6, rank, generator=g)}


def test_merged_weights_are_w_plus_scaled_b_a_in_the_base_order_and_dtype():
    base, adapter = _base(), _adapter()
    lora_merge.check(base, adapter)
    merged = list(lora_merge.merged_weights(base, adapter, 0.5))
    assert [n for n, _ in merged] == list(base)
    out = dict(merged)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.allclose(out[q], base[q] + 0.5 * adapter[Q_B] @ adapter[Q_A], atol=1e-6)
    down = "model.layers.0.mlp.down_proj.weight"
    assert out[down].dtype == torch.bfloat16  # the weight's dtype, computed in fp32
    expect = (base[down].float() + 0.5 * adapter[down[:-len("weight")] + "lora_B.weight"]
              @ adapter[down[:-len("weight")] + "lora_A.weight"]).to(torch.bfloat16)
    assert torch.equal(out[down], expect)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias"):
        assert out[name] is base[name]  # untouched weights are the base's own tensors, not copies


@pytest.mark.parametrize("change, message", [
    (lambda a: a.pop(Q_B), "comes without 'model.layers.0.self_attn.q_proj.lora_B.weight'"),
    (lambda a: a.update({"model.layers.0.self_attn.q_proj.lora_C.weight": torch.zeros(1)}), "is neither a LoRA A"),
    (lambda a: a.update({Q_B: torch.zeros(9, 2)}), r"A \(2, 6\) and B \(9, 2\) do not make a B @ A of the weight's "
                                                   r"shape \(8, 6\)"),
    (lambda a: a.update({"model.layers.1.self_attn.q_proj.lora_A.weight": torch.zeros(2, 6),
                         "model.layers.1.self_attn.q_proj.lora_B.weight": torch.zeros(8, 2)}),
     "adapts 'model.layers.1.self_attn.q_proj.weight', which the base model does not have"),
], ids=["no-B", "not-lora", "shape", "no-such-weight"])
def test_an_adapter_that_cannot_merge_is_refused_naming_the_tensor(change, message):
    adapter = _adapter()
    change(adapter)
    with pytest.raises(ValueError, match=message):
        lora_merge.check(_base(), adapter)


def test_merged_spec_names_each_adapted_weight_with_its_shape_in_the_adapters_order():
    """What a merged publish (SGLang) carries: one weight per A/B pair, [B's rows, A's columns], A order."""
    adapter = _adapter(rank=3)
    spec = [(name, tuple(t.shape), t.dtype) for name, t in reversed(adapter.items())]  # B before A too
    assert lora_merge.merged_spec(spec) == [("model.layers.0.mlp.down_proj.weight", (6, 4), torch.float32),
                                            ("model.layers.0.self_attn.q_proj.weight", (8, 6), torch.float32)]
