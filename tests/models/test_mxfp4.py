"""MXFP4 checkpoints (megarl.models.mxfp4): the packed tensors dequantize to the values transformers' own
dequantization gives, and a gpt-oss directory written in MXFP4 loads as the float checkpoint transformers makes of it
(the learner's and the engine's log-probs on it: tests/learner/test_moe_learner.py, tests/sampler/test_engine_moe.py)."""
from __future__ import annotations

import json

import pytest
import torch

from megarl.models import mxfp4
from megarl.models.convert import load_pretrained
from megarl.models.support import check_supported
from tests.helpers import save_tiny_gpt_oss_mxfp4


def test_dequantize_is_transformers_and_quantize_is_its_inverse_on_the_values_mxfp4_holds():
    """Weights over five decades of magnitude (some groups all zero): our dequantization of their packing is
    transformers' (integrations/mxfp4.convert_moe_packed_tensors) bit for bit, [experts, in, out] as the float
    checkpoint holds them; packing those values again gives them back exactly; each group's largest magnitude is kept
    to within FP4's rounding (a quarter of its value)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weight = torch.randn(3, 64, 40, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 40)
    weight[1, :32, 5] = 0.0
    blocks, scales = mxfp4.quantize(weight)
    assert blocks.shape == (3, 40, 2, 16) and scales.shape == (3, 40, 2) and blocks.dtype == scales.dtype == torch.uint8
    values = mxfp4.dequantize(blocks, scales, torch.float32)
    assert values.shape == weight.shape
    assert torch.equal(values, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.bfloat16).float(), values)  # (exact in bf16 too)
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(values), torch.float32), values)
    group_max = weight.transpose(1, 2).unflatten(-1, (-1, 32)).abs().amax(-1)
    kept = values.transpose(1, 2).unflatten(-1, (-1, 32)).abs().amax(-1)
    assert ((kept - group_max).abs() <= 0.25 * group_max).all() and (values[1, :32, 5] == 0).all()
    with pytest.raises(ValueError, match="do not pair"):
        mxfp4.dequantize(blocks, scales[:, :, :1], torch.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(weight[:, :40])


def test_an_mxfp4_gpt_oss_directory_loads_as_the_float_checkpoint_transformers_makes_of_it(tmp_path):
    """A tiny gpt-oss written as the hub's are (experts as `_blocks` / `_scales`, quantization_config mxfp4) passes
    the config check and loads (megarl.models.convert.load_pretrained: the learner's and the engine's loader) to
    exactly the tensors, names and values, of transformers' dequantized model; another quantization method is still
    refused by name, and a packed tensor without its pair is named."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    path = save_tiny_gpt_oss_mxfp4(tmp_path / "gpt_oss_mxfp4")
    on_disk = load_file(path / "model.safetensors")
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in on_disk
    assert "model.layers.0.mlp.experts.gate_up_proj" not in on_disk
    cfg, weights = load_pretrained(str(path))
    check_supported(cfg)
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict()
    assert set(weights) == set(reference)
    assert all(torch.equal(weights[name], tensor) for name, tensor in reference.items())
    with pytest.raises(ValueError, match="quantization_config='bitsandbytes'"):
        check_supported(dict(cfg, quantization_config={"quant_method": "bitsandbytes"}))
    del on_disk["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(on_disk, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj_blocks has no model.layers.1.mlp.experts.down_proj_scales"):
        load_pretrained(str(path))
    assert json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
