"""MXFP4 checkpoints (``quantization_config: {quant_method: mxfp4}``, gpt-oss's on the hub): their packed tensors
dequantized to the float tensors every megarl loader takes, and the packing itself (pure functions).

Such a checkpoint holds a weight ``X`` of the MXFP4 modules (gpt-oss: each layer's ``mlp.experts.gate_up_proj`` and
``mlp.experts.down_proj``) as two tensors: ``X_blocks`` uint8 [experts, out, in / 32, 16], two FP4 (e2m1) codes per
byte (the even element in the low nibble), and ``X_scales`` uint8 [experts, out, in / 32], one shared power of two per
32 elements (e8m0: 2 ** (scale - 127)). The float weight is code value times its group's scale, laid out [experts,
in, out] as the unquantized checkpoint holds it (transformers' integrations/mxfp4.py `convert_moe_packed_tensors`
computes the same values). Every such value is exact in bf16 and fp32, so dequantizing loses nothing: megarl loads
an MXFP4 checkpoint as the float checkpoint of those values (`dequantize_state`, in the dtype of its other float
tensors) and trains, publishes and exports float weights from there; it writes no MXFP4 back.

`quantize` packs float weights (each group's scale the smallest power of two that brings its largest magnitude
within FP4's 6, values rounded to the nearest code): how tests write an MXFP4 checkpoint of a tiny model.

torch is imported where the tensors are: `is_mxfp4` is part of the config check `megarl train` runs without torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

QUANT_METHOD = "mxfp4"
# The 16 FP4 (e2m1) values, by code: sign bit 3, then exponent and mantissa (transformers' FP4_VALUES, OCP MX spec)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # elements per shared scale
SCALE_BIAS = 127  # e8m0: the scale byte s stands for 2 ** (s - 127)
BLOCKS, SCALES = "_blocks", "_scales"


def is_mxfp4(cfg: dict) -> bool:
    """Whether a config.json dict describes an MXFP4 checkpoint."""
    return (cfg.get("quantization_config") or {}).get("quant_method") == QUANT_METHOD


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float weight [experts, in, out] of `blocks` uint8 [experts, out, groups, 16] and `scales` uint8
    [experts, out, groups] (in = groups * 32); ValueError naming the shapes when they do not pair."""
    import torch

    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         f"(blocks [experts, out, groups, {GROUP // 2}], scales [experts, out, groups])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [E, out, groups, 32]
    values = torch.ldexp(lut[codes], (scales.to(torch.int32) - SCALE_BIAS)[..., None].float())
    return values.flatten(-2).transpose(1, 2).to(dtype).contiguous()


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of a float weight [experts, in, out] (in a multiple of 32), `dequantize`'s inverse on the values
    MXFP4 holds: per group of 32 along `in`, the scale is the smallest power of two that brings the group's largest
    magnitude within 6, each element the nearest FP4 value of it over the scale."""
    import torch

    if weight.dim() != 3 or weight.shape[1] % GROUP:
        raise ValueError(f"MXFP4 packs [experts, in, out] weights with in a multiple of {GROUP}, got "
                         f"{tuple(weight.shape)}")
    groups = weight.transpose(1, 2).float().unflatten(-1, (-1, GROUP))  # [E, out, groups, 32]
    amax = groups.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(
        -SCALE_BIAS, 255 - SCALE_BIAS)
    scaled = groups / torch.ldexp(torch.ones_like(exponent), exponent)[..., None]
    lut = torch.tensor(FP4_VALUES[:8])
    magnitude = (scaled.abs()[..., None] - lut).abs().argmin(-1)  # nearest of the 8 magnitudes
    codes = (magnitude | (scaled < 0).long() << 3).to(torch.uint8)
    blocks = codes[..., 0::2] | codes[..., 1::2] << 4
    return blocks.contiguous(), (exponent + SCALE_BIAS).to(torch.uint8)


def dequantize_state(cfg: dict, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An MXFP4 checkpoint's tensors with every ``X_blocks`` / ``X_scales`` pair replaced by the float ``X``, in the
    dtype of the checkpoint's other floating-point tensors (fp32 where it has none); the state itself for any other
    checkpoint. ValueError naming a tensor whose pair is missing."""
    import torch

    if not is_mxfp4(cfg):
        return weights
    floats = [t.dtype for t in weights.values() if t.is_floating_point()]
    dtype = floats[0] if floats else torch.float32
    out = {}
    for name, tensor in weights.items():
        if name.endswith(SCALES):
            if name[:-len(SCALES)] + BLOCKS not in weights:
                raise ValueError(f"MXFP4 checkpoint: {name} has no {name[:-len(SCALES)] + BLOCKS}")
            continue
        if name.endswith(BLOCKS):
            base = name[:-len(BLOCKS)]
            if base + SCALES not in weights:
                raise ValueError(f"MXFP4 checkpoint: {name} has no {base + SCALES}")
            out[base] = dequantize(tensor, weights[base + SCALES], dtype)
        else:
            out[name] = tensor
    return out
