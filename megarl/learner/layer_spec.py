"""The megatron layer spec the megatron learner builds its GPTModel from.

megatron-core's local spec (``get_gpt_layer_local_spec``: no Transformer Engine, which CPU runs never have) with
megarl's replacements, each for a reason its module gives: the core attention computed by torch's fused SDPA
(megarl.learner.sdpa_attention), OLMo 2's norms (megarl.learner.post_norms), Gemma 3's (megarl.learner.gemma3: a block
spec, for its final norm), Qwen3.5's hybrid layers (megarl.learner.hybrid: a block spec, gated DeltaNet where
`layer_types` says) and, under sequence parallelism, the
norms that carry its gradient mark (megarl.learner.sequence_parallel). A model whose first layers are dense and
the rest MoE (GLM-4.5: megarl.models.moe.first_dense_layers) gets a block spec of this pipeline stage's layers, each
with its own MLP. Multi-latent attention (DeepSeek-V3) is the local spec's MLASelfAttention with its latent
down-projections whole on every TP rank (`_whole_latent_projections`).
"""
from __future__ import annotations

import dataclasses


def layer_spec(hf_config: dict, config, sequence_parallel: bool):
    """The ModuleSpec of one transformer layer (or, under sequence parallelism, the stage's block spec)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megarl.learner.sdpa_attention import SDPAttention
    from megarl.models import convert, families, moe

    def one(kwargs):
        spec = replace_modules(get_gpt_layer_local_spec(**kwargs), {DotProductAttention: SDPAttention})
        if kwargs.get("multi_latent_attention"):
            spec = _whole_latent_projections(spec)
        if families.family_of(hf_config).post_norms:  # OLMo 2
            from megarl.learner.post_norms import post_norm_spec

            spec = post_norm_spec(spec, hf_config["hidden_size"], hf_config["rms_norm_eps"])
        if families.family_of(hf_config).gemma:
            from megarl.learner.gemma3 import gemma_spec

            spec = gemma_spec(spec, hf_config["hidden_size"], hf_config["rms_norm_eps"])
        return spec

    kwargs = convert.layer_spec_kwargs(hf_config)
    if kwargs.get("multi_latent_attention"):
        _mla_without_transformer_engine()
    spec = one(kwargs)
    if families.family_of(hf_config).gemma:  # (dense: never sequence-parallel)
        from megarl.learner.gemma3 import gemma_block

        return gemma_block([spec for _ in _stage_layers(config)])
    if families.family_of(hf_config).linear_attention:  # (dense: never sequence-parallel)
        from megarl.learner.hybrid import hybrid_block

        return hybrid_block(spec, families.linear_attention_layers(hf_config), _stage_layers(config))
    if not moe.first_dense_layers(hf_config) and not sequence_parallel:
        return spec
    dense = one({k: v for k, v in kwargs.items() if k not in ("num_experts", "moe_grouped_gemm")})
    layers = [spec if moe.is_moe_layer(hf_config, i) else dense for i in _stage_layers(config)]
    return _block(layers, config, sequence_parallel)


def _mla_without_transformer_engine() -> None:
    """megatron-core 0.16.1's multi_latent_attention imports megatron's Transformer Engine extension, which without
    Transformer Engine binds its classes to MagicMocks and still succeeds: MLA then takes HAVE_TE to be True and its
    `isinstance(linear_proj, TELinear)` raises TypeError. Without Transformer Engine, tell it so."""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


def _whole_latent_projections(spec):
    """The MLA layer spec with linear_q_down_proj / linear_kv_down_proj whole on every TP rank (megatron's plain
    `Linear`, as its Transformer Engine spec duplicates them), not the local spec's column-parallel split. Why: with
    the split, megatron gathers the k RoPE part over TP, and the backward of that gather hands each rank only its
    slice of the gradient, which holds only its own heads' share of the k RoPE part's (shared by every head): the
    k RoPE rows of the weight get a partial gradient (TP2's grad norm 0.2% off one rank's). Whole, the projection
    runs on this rank's sequence-parallel positions, and megatron gathers the k RoPE part over the sequence, whose
    backward sums every rank's heads; the weight is marked sequence_parallel, so its gradient is summed over TP."""
    from megatron.core.post_training.modelopt.layers import Linear

    attention = spec.submodules.self_attention
    latent = dataclasses.replace(attention.submodules, linear_q_down_proj=Linear, linear_kv_down_proj=Linear)
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, self_attention=dataclasses.replace(attention, submodules=latent)))


def _stage_layers(config) -> range:
    """The global indices of this pipeline stage's decoder layers."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config)
    return range(offset, offset + get_num_layers_to_build(config))


def _block(layers: list, config, sequence_parallel: bool):
    """megatron TransformerBlockSubmodules of this pipeline stage's `layers`; under sequence parallelism with every
    torch norm replaced by megarl.learner.sequence_parallel.RMSNorm, which is also the final norm."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    if not sequence_parallel:
        return TransformerBlockSubmodules(layer_specs=layers, layer_norm=LayerNormImpl)
    from megarl.learner.sequence_parallel import RMSNorm

    if config.normalization != "RMSNorm":
        raise ValueError(f"sequence parallelism here replaces RMSNorm only, not {config.normalization}")
    return TransformerBlockSubmodules(layer_specs=[replace_modules(s, {WrappedTorchNorm: RMSNorm}) for s in layers],
                                      layer_norm=RMSNorm)


def replace_modules(spec, replacements: dict):
    """`spec` (megatron's ModuleSpec and submodule dataclasses, nested) with each module class that is a key of
    `replacements` swapped for its value, wherever it occurs."""
    if isinstance(spec, type):
        return replacements.get(spec, spec)
    if not dataclasses.is_dataclass(spec):
        return spec
    return dataclasses.replace(spec, **{f.name: replace_modules(getattr(spec, f.name), replacements)
                                        for f in dataclasses.fields(spec) if f.init})
