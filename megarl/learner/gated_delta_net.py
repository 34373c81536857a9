"""megatron-core's own gated-DeltaNet layer (megatron/core/ssm/gated_delta_net.py) built from an HF hybrid config
(Qwen3.5 text, Qwen3-Next), with the local (non-Transformer-Engine) linears a CPU run has.

megatron-core's `get_gated_delta_net_module_spec` gives `in_proj=None` under its local backend (it expects
Transformer Engine's fused norm + linear there), so `module_spec` names the plain column- and row-parallel linears;
the layer's input norm then stays the transformer layer's own. `transformer_config_kwargs` are the TransformerConfig
fields the module reads. On CPU, megarl.learner.cpu_shims.apply_gated_delta_net_shims must have run first (the
module needs flash-linear-attention otherwise). The weights map with megarl.models.gated_delta_net.
"""
from __future__ import annotations


def transformer_config_kwargs(hf_config: dict) -> dict:
    """The TransformerConfig fields of a gated-DeltaNet layer (megarl.models.gated_delta_net's)."""
    from megarl.models.gated_delta_net import transformer_config_kwargs as kwargs

    return kwargs(hf_config, (True, False))


def module_spec():
    """The ModuleSpec of megatron's GatedDeltaNet with local linears and a torch RMSNorm as its gated out_norm."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return ModuleSpec(module=GatedDeltaNet, params={"bias": False, "conv_bias": False},
                      submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                                         out_proj=RowParallelLinear))


def build_layer(hf_config: dict, dtype=None, layer_number: int = 1):
    """One GatedDeltaNet of `hf_config`'s shape at the initialised megatron parallel state's TP (weights
    uninitialised: load them with megarl.models.gated_delta_net.hf_to_mcore and tp_slice)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    dtype = dtype or torch.float32
    config = TransformerConfig(num_layers=hf_config["num_hidden_layers"], hidden_size=hf_config["hidden_size"],
                               num_attention_heads=hf_config["num_attention_heads"], use_cpu_initialization=True,
                               perform_initialization=False, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                               tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
                               **transformer_config_kwargs(hf_config))
    return build_module(module_spec(), config, layer_number=layer_number,
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def use_torch_path_without_fla() -> None:
    """On a GPU without flash-linear-attention, megatron's GatedDeltaNet (which refuses to build without it) runs its
    own torch path instead: the torch l2norm of megarl.learner.cpu_shims and torch_chunk_gated_delta_rule (the
    CPU shims' replacements; its constructor's CUDA allocations are right on a GPU). A no-op where fla is installed."""
    import importlib.util

    if importlib.util.find_spec("fla") is not None:
        return
    from megatron.core.ssm import gated_delta_net

    from megarl.learner.cpu_shims import l2norm

    gated_delta_net.HAVE_FLA, gated_delta_net.l2norm = True, l2norm
    gated_delta_net.chunk_gated_delta_rule = gated_delta_net.torch_chunk_gated_delta_rule
