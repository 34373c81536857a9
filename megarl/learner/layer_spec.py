"""The megatron layer spec the megatron learner builds its GPTModel from.

megatron-core's local spec (``get_gpt_layer_local_spec``: no Transformer Engine, which CPU runs never have) with
megarl's replacements, each for a reason its module gives: the core attention computed by torch's fused SDPA
(megarl.learner.sdpa_attention) and, under sequence parallelism, the norms that carry its gradient mark
(megarl.learner.sequence_parallel).
"""
from __future__ import annotations

import dataclasses


def layer_spec(hf_config: dict, config, sequence_parallel: bool):
    """The ModuleSpec of one transformer layer (or, under sequence parallelism, the stage's block spec)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megarl.learner import sequence_parallel as sp
    from megarl.learner.sdpa_attention import SDPAttention
    from megarl.models import convert

    spec = replace_modules(get_gpt_layer_local_spec(**convert.layer_spec_kwargs(hf_config)),
                           {DotProductAttention: SDPAttention})
    return sp.block_spec(spec, config) if sequence_parallel else spec


def replace_modules(spec, replacements: dict):
    """`spec` (megatron's ModuleSpec and submodule dataclasses, nested) with each module class that is a key of
    `replacements` swapped for its value, wherever it occurs."""
    if isinstance(spec, type):
        return replacements.get(spec, spec)
    if not dataclasses.is_dataclass(spec):
        return spec
    return dataclasses.replace(spec, **{f.name: replace_modules(getattr(spec, f.name), replacements)
                                        for f in dataclasses.fields(spec) if f.init})
