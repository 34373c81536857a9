"""The megatron layer spec the megatron learner builds its GPTModel from.

megatron-core's local spec (``get_gpt_layer_local_spec``: no Transformer Engine, which CPU runs never have) with
megarl's replacements, each for a reason its module gives: the core attention computed by torch's fused SDPA
(megarl.learner.sdpa_attention), OLMo 2's norms (megarl.learner.post_norms) and, under sequence parallelism, the
norms that carry its gradient mark (megarl.learner.sequence_parallel).
"""
from __future__ import annotations

import dataclasses


def layer_spec(hf_config: dict, config, sequence_parallel: bool):
    """The ModuleSpec of one transformer layer (or, under sequence parallelism, the stage's block spec)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megarl.learner.sdpa_attention import SDPAttention
    from megarl.models import convert, families

    spec = replace_modules(get_gpt_layer_local_spec(**convert.layer_spec_kwargs(hf_config)),
                           {DotProductAttention: SDPAttention})
    if families.family_of(hf_config).post_norms:  # OLMo 2
        from megarl.learner.post_norms import post_norm_spec

        spec = post_norm_spec(spec, hf_config["hidden_size"], hf_config["rms_norm_eps"])
    return _sequence_parallel_block(spec, config) if sequence_parallel else spec


def _sequence_parallel_block(spec, config):
    """megatron TransformerBlockSubmodules of this pipeline stage: `spec` for each of its layers with every torch
    norm replaced by megarl.learner.sequence_parallel.RMSNorm, which is also the final norm."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from megarl.learner.sequence_parallel import RMSNorm

    if config.normalization != "RMSNorm":
        raise ValueError(f"sequence parallelism here replaces RMSNorm only, not {config.normalization}")
    layer = replace_modules(spec, {WrappedTorchNorm: RMSNorm})
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=RMSNorm)


def replace_modules(spec, replacements: dict):
    """`spec` (megatron's ModuleSpec and submodule dataclasses, nested) with each module class that is a key of
    `replacements` swapped for its value, wherever it occurs."""
    if isinstance(spec, type):
        return replacements.get(spec, spec)
    if not dataclasses.is_dataclass(spec):
        return spec
    return dataclasses.replace(spec, **{f.name: replace_modules(getattr(spec, f.name), replacements)
                                        for f in dataclasses.fields(spec) if f.init})
