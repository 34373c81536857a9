"""Every patch megatron-core 0.16.1 needs to train on CPU with gloo, in one place.

megatron-core assumes CUDA in a handful of lines (device="cuda" literals,
``torch.cuda.current_device()``, the CUDA RNG state, ``'torch.cuda.FloatTensor'`` type strings).
On a CPU-only torch each of them ends in ``AssertionError: Torch not compiled with CUDA enabled``
(or a TypeError for the type strings).  This module fixes exactly those lines and nothing else:

* Each shim rewrites the source of ONE named megatron function, replacing an exact snippet (the
  CUDA line) with its CPU equivalent, and re-binds the function where megatron looks it up.  A
  snippet that is not found raises ``RuntimeError`` naming it, so a megatron upgrade that moves a
  line fails loudly at start instead of silently running unpatched code.
* torch itself is never patched; GPU runs never apply any shim (``apply_cpu_shims`` is a no-op
  when CUDA is available, and the learner only calls it on CPU).

``SHIMS`` maps a shim name to the function that applies it; tests apply all but one to prove each
shim is needed (tests/learner/test_cpu_shims.py). ``apply_gated_delta_net_shims`` is apart from them: only a model
with gated-DeltaNet layers (megatron.core.ssm.gated_delta_net) needs it, and it stands in for a package that is
absent, not for a CUDA line alone (tests/learner/test_gated_delta_net.py).
"""
from __future__ import annotations

import inspect
import sys
import textwrap
from typing import Callable

import torch

_APPLIED: set[str] = set()


def _rewrite(owner, name: str, replacements: list[tuple[str, str]]) -> None:
    """Recompile `owner.name` (a module-level function or a method) with exact snippets replaced.

    The new function is executed in the defining module's globals, so it sees the same names the
    original did.  Methods must not use zero-argument ``super()`` (none of the rewritten ones do).
    """
    fn = inspect.unwrap(owner.__dict__[name]) if inspect.isclass(owner) else getattr(owner, name)
    src = textwrap.dedent(inspect.getsource(fn))
    for old, new in replacements:
        if old not in src:
            raise RuntimeError(
                f"megarl cpu shim: {fn.__module__}.{fn.__qualname__} no longer contains {old!r}; "
                "the installed megatron-core differs from 0.16.1, re-check megarl/learner/cpu_shims.py"
            )
        src = src.replace(old, new)
    module_globals = sys.modules[fn.__module__].__dict__
    namespace: dict = {}
    exec(compile(src, f"<megarl cpu shim: {fn.__module__}.{fn.__qualname__}>", "exec"),
         module_globals, namespace)
    setattr(owner, name, namespace[name])
    if not inspect.isclass(owner):
        # `from .clip_grads import get_grad_norm_fp32` style imports hold the original object:
        # re-bind every megatron module attribute that still points at it.
        for mod_name, mod in list(sys.modules.items()):
            if mod_name.startswith("megatron.core") and mod is not None:
                for attr, value in list(vars(mod).items()):
                    if value is fn:
                        setattr(mod, attr, namespace[name])


def _shim_schedule_token_count() -> None:
    # pipeline_parallel/schedules.py, forward_backward_no_pipelining and
    # forward_backward_pipelining_without_interleaving:
    #     total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")
    # allocates the token counter on the GPU on every call, training or not.
    from megatron.core.pipeline_parallel import schedules

    literal = [('device="cuda"', 'device="cpu"')]
    _rewrite(schedules, "forward_backward_no_pipelining", literal)
    _rewrite(schedules, "forward_backward_pipelining_without_interleaving", literal)


def _shim_memory_buffer() -> None:
    # core/utils.py, GlobalMemoryBuffer.get_tensor:
    #     torch.empty(required_len, dtype=dtype, device=torch.cuda.current_device(), ...)
    # Sequence parallelism's all-gathers (tensor_parallel/mappings.py, layers.py) take their buffers from here
    # (megatron's unfused attention did too; megarl attends through SDPA: megarl/learner/sdpa_attention.py).
    from megatron.core import utils

    _rewrite(utils.GlobalMemoryBuffer, "get_tensor",
             [("device=torch.cuda.current_device()", 'device="cpu"')])


def _shim_rotary() -> None:
    # models/common/embeddings/rotary_pos_embedding.py, RotaryEmbedding.get_emb:
    #     self.inv_freq = self.inv_freq.to(device=torch.cuda.current_device())
    # moves the RoPE frequencies to the GPU on the first forward; on CPU they stay where they are.
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    _rewrite(rotary_pos_embedding.RotaryEmbedding, "get_emb",
             [("device=torch.cuda.current_device()", 'device="cpu"')])


def _cpu_get_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _shim_rng_tracker() -> None:
    # tensor_parallel/random.py: model_parallel_cuda_manual_seed -> CudaRNGStatesTracker.add calls
    #     orig_rng_state = torch.cuda.get_rng_state(); torch.cuda.manual_seed(seed); ...
    # and every attention forward enters get_cuda_rng_tracker().fork(), which saves/restores the
    # state through _get_cuda_rng_state / _set_cuda_rng_state (torch.cuda.default_generators).
    # On CPU the tracked states are CPU-generator states: same fork semantics, CPU generator.
    from megatron.core.tensor_parallel import random

    random._get_cuda_rng_state = _cpu_get_rng_state
    random._set_cuda_rng_state = _cpu_set_rng_state
    _rewrite(random.CudaRNGStatesTracker, "add", [
        ("orig_rng_state = torch.cuda.get_rng_state()", "orig_rng_state = torch.get_rng_state()"),
        ("torch.cuda.manual_seed(seed)", "torch.manual_seed(seed)"),
        ("self.states_[name] = torch.cuda.get_rng_state()", "self.states_[name] = torch.get_rng_state()"),
    ])


def _shim_grad_buffer() -> None:
    # distributed/param_and_grad_buffer.py, _ParamAndGradBuffer.__init__ (megatron DDP):
    #     self.param_data = torch.zeros(..., device=torch.cuda.current_device(), ...)
    #     self.grad_data = torch.zeros(..., device=torch.cuda.current_device(), ...)
    # the contiguous param/grad buffers every DDP-wrapped model allocates.
    from megatron.core.distributed import param_and_grad_buffer

    _rewrite(param_and_grad_buffer._ParamAndGradBuffer, "__init__",
             [("device=torch.cuda.current_device()", 'device="cpu"')])


def _shim_fp32_optimizer() -> None:
    # optimizer/optimizer.py, FP32Optimizer.__init__:
    #     self._scale = torch.tensor([1.0], dtype=torch.float, device='cuda')
    # (the non-distributed fp32 optimizer's constant loss scale).
    from megatron.core.optimizer import optimizer

    _rewrite(optimizer.FP32Optimizer, "__init__", [("device='cuda'", "device='cpu'")])


def _shim_grad_norm() -> None:
    # optimizer/clip_grads.py, get_grad_norm_fp32 (called by every optimizer.step() to report
    # the grad norm, clipping or not): zero/overflow buffers allocated with device='cuda';
    # core/utils.py, local_multi_tensor_l2_norm (the no-apex fallback it calls):
    #     l2_cuda = torch.tensor([float(l2_reduced)], dtype=torch.float, device="cuda")
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    _rewrite(clip_grads, "get_grad_norm_fp32", [("device='cuda'", "device='cpu'")])
    _rewrite(utils, "local_multi_tensor_l2_norm", [('device="cuda"', 'device="cpu"')])


def _shim_clip_grads() -> None:
    # optimizer/clip_grads.py, clip_grad_by_total_norm_fp32 (only when clip_grad > 0):
    #     assert param.grad.type() == 'torch.cuda.FloatTensor'
    #     dummy_overflow_buf = torch.zeros(1, dtype=torch.int, device='cuda')
    from megatron.core.optimizer import clip_grads

    _rewrite(clip_grads, "clip_grad_by_total_norm_fp32", [
        ("param.grad.type() == 'torch.cuda.FloatTensor'", "param.grad.type() == 'torch.FloatTensor'"),
        ("device='cuda'", "device='cpu'"),
    ])


def _shim_p2p() -> None:
    # pipeline_parallel/p2p_communication.py, P2PCommunicator._communicate (every PP send/recv):
    #     torch.empty(recv_shape, ..., device=torch.cuda.current_device(), ...)   (receive buffers)
    #     torch.cuda.synchronize()                                                (batch_p2p_sync)
    # and P2PCommunicator._communicate_shapes (PP with variable_seq_lengths, which megarl uses so
    # micro-batches keep their own trimmed lengths): the shape tensors are allocated the same way
    # and it synchronizes unconditionally.
    from megatron.core.pipeline_parallel import p2p_communication

    cpu = [("device=torch.cuda.current_device()", 'device="cpu"'), ("torch.cuda.synchronize()", "pass")]
    _rewrite(p2p_communication.P2PCommunicator, "_communicate", cpu)
    _rewrite(p2p_communication.P2PCommunicator, "_communicate_shapes", cpu)


def _shim_tied_embedding_sync() -> None:
    # models/common/language_module/language_module.py, setup_embeddings_and_output_layer: with PP > 1
    # and tied embeddings the last stage's output weight is copied from the first stage's word
    # embedding by an all-reduce over the embedding group, after `weight.data = weight.data.cuda()`.
    from megatron.core.models.common.language_module import language_module

    _rewrite(language_module.LanguageModule, "setup_embeddings_and_output_layer",
             [("weight.data = weight.data.cuda()", "pass")])


def _shim_distributed_optimizer() -> None:
    # optimizer/distrib_optimizer.py, DistributedOptimizer._build_model_and_main_param_groups:
    #     elif model_param.type() == 'torch.cuda.FloatTensor':  ... else: raise TypeError(...)
    # classifies each parameter by its CUDA type string; a CPU fp32 parameter is 'torch.FloatTensor'.
    # Its base class, optimizer.py MixedPrecisionOptimizer.__init__, allocates the overflow buffer
    # and the unit loss scale with device='cuda' (its zero-argument super() call is spelled out,
    # since the rewritten method is compiled outside the class body).
    from megatron.core.optimizer import distrib_optimizer, optimizer

    _rewrite(distrib_optimizer.DistributedOptimizer, "_build_model_and_main_param_groups",
             [("model_param.type() == 'torch.cuda.FloatTensor'", "model_param.type() == 'torch.FloatTensor'")])
    _rewrite(optimizer.MixedPrecisionOptimizer, "__init__", [
        ("super().__init__(optimizer, config, init_state_fn)",
         "MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)"),
        ("device='cuda'", "device='cpu'"),
    ])


def _shim_distributed_optimizer_load() -> None:
    # optimizer/distrib_optimizer.py, DistributedOptimizer._set_main_param_and_optimizer_states, when a
    # checkpoint is loaded (megarl/checkpoint saves the distributed optimizer `fully_reshardable`):
    #     for key in dst_tensors: dst_tensors[key].copy_(tensors[key])
    # copies every key of the torch-Adam state, "step" included, from the checkpoint's tensors, which
    # carry none (load_state_dict has set the step from the param groups already): KeyError 'step'.
    # Apex/TE's FusedAdam keeps its step in the param groups; on CPU there is only torch's Adam.
    from megatron.core.optimizer import distrib_optimizer

    _rewrite(distrib_optimizer.DistributedOptimizer, "_set_main_param_and_optimizer_states",
             [("for key in dst_tensors:", "for key in tensors:")])


# ---- MoE (megatron-core 0.16.1, local spec, SequentialMLP, alltoall dispatcher; sequence parallelism at TP > 1).

def _shim_moe_router_device() -> None:
    # transformer/moe/router.py, Router.gating (every MoE layer's forward):
    #     if self.weight.device.type == 'cpu': self.weight.data = self.weight.data.to(device=torch.cuda.current_device())
    # moves the router weight (and bias) to the GPU on the first forward; on CPU they stay.
    from megatron.core.transformer.moe import router

    _rewrite(router.Router, "gating", [("device=torch.cuda.current_device()", 'device="cpu"')])


def _shim_moe_gating_gemm() -> None:
    # transformer/moe/moe_utils.py, RouterGatingLinearFunction.forward/backward test
    # `te_general_gemm is not None`, but the module binds `te_general_gemm` only inside its Transformer
    # Engine import `try`: without TE every router forward raises NameError (a 0.16.1 bug, GPU too).
    # Binding the name to None selects the torch.mm path the code already has.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _shim_moe_dispatcher_streams() -> None:
    # transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher: __init__ creates a class-wide
    # `torch.cuda.Stream()` for device-to-host copies of the split sizes, and _maybe_dtoh_and_synchronize
    # enters it, records an event on it and synchronizes on that event. On CPU the copies are plain calls.
    from megatron.core.transformer.moe import token_dispatcher

    cls = token_dispatcher.MoEAlltoAllTokenDispatcher
    _rewrite(cls, "__init__", [
        ("MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()", "pass"),
        ("super().__init__(", "MoETokenDispatcher.__init__(self, "),
    ])
    _rewrite(cls, "_maybe_dtoh_and_synchronize", [
        ("on_side_stream = torch.cuda.current_stream() != self.cuda_dtoh_stream", "on_side_stream = False"),
        ("self.cuda_dtoh_stream.wait_stream(torch.cuda.current_stream())", "pass"),
        ("with torch.cuda.stream(self.cuda_dtoh_stream):", "if True:"),
        ("self.d2h_event = self.cuda_dtoh_stream.record_event()", "pass"),
        ("self.d2h_event.synchronize()", "pass"),
    ])


def _shim_moe_collectives_device() -> None:
    # tensor_parallel/mappings.py: the gathers / reduce-scatters along the first and last dim and the
    # alltoall-v autograd function (_AllToAll, expert parallelism) allocate their outputs with
    # device=torch.cuda.current_device(); on CPU they go where the input is.
    from megatron.core.tensor_parallel import mappings

    on_input = [("device=torch.cuda.current_device()", "device=input_.device")]
    for name in ("_gather_along_last_dim", "_gather_along_first_dim", "_reduce_scatter_along_first_dim"):
        _rewrite(mappings, name, on_input)
    _rewrite(mappings._AllToAll, "forward", [("device=torch.cuda.current_device()", "device=input.device")])


def _shim_moe_split_sizes() -> None:
    # transformer/moe/moe_utils.py, maybe_move_tensor_to_cpu converts only CUDA tensors, so on CPU the
    # alltoall dispatcher's input/output split sizes stay tensors where it asked for numpy arrays, and
    # torch.distributed.all_to_all_single takes them as a TypeError (expert parallelism > 1).
    from megatron.core.transformer.moe import moe_utils

    _rewrite(moe_utils, "maybe_move_tensor_to_cpu",
             [("if torch.is_tensor(tensor) and tensor.is_cuda:", "if torch.is_tensor(tensor):")])


def _shim_moe_sequence_parallel() -> None:
    # tensor_parallel/layers.py, LinearWithGradAccumulationAndAsyncCommunication.backward: under sequence parallelism
    # (which megarl runs for MoE models at learner.tp > 1: megarl.learner.sequence_parallel) every column-parallel
    # linear's backward allocates the reduce-scattered input gradient with device=torch.cuda.current_device().
    # (gloo itself has reduce_scatter_tensor and all_gather_into_tensor in torch 2.13: no collective is replaced.)
    from megatron.core.tensor_parallel import layers

    _rewrite(layers.LinearWithGradAccumulationAndAsyncCommunication, "backward",
             [("device=torch.cuda.current_device()", "device=input.device")])


def _shim_expert_bias() -> None:
    # transformer/moe/router.py, TopKRouter.__init__ with moe_router_enable_expert_bias (GLM-4.5's router bias,
    # megarl.models.moe): the expert bias and its token counter are registered as buffers with
    # device=torch.cuda.current_device() (its zero-argument super() call is spelled out, as above).
    from megatron.core.transformer.moe import router

    _rewrite(router.TopKRouter, "__init__", [
        ("device=torch.cuda.current_device()", 'device="cpu"'),
        ("super().__init__(config=config, pg_collection=pg_collection)",
         "Router.__init__(self, config=config, pg_collection=pg_collection)"),
    ])


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """x scaled to unit L2 norm along `dim`: fla.modules.l2norm.l2norm's function (its Triton kernel computes
    x * rsqrt(sum(x * x) + eps)), as transformers' Qwen3-Next / Qwen3.5 torch path computes it too."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def apply_gated_delta_net_shims() -> None:
    """megatron-core's GatedDeltaNet (ssm/gated_delta_net.py) on CPU; idempotent; a no-op when CUDA is available.

    The module imports flash-linear-attention (`fla`) for two names, l2norm and chunk_gated_delta_rule, and its
    constructor refuses to run without them (HAVE_FLA). Both are Triton GPU kernels, so on CPU they are replaced
    by torch: l2norm by `l2norm` above, chunk_gated_delta_rule by the module's own torch path
    (torch_chunk_gated_delta_rule, which it runs under config.deterministic_mode: the same arguments and
    results). Its constructor also allocates conv1d, dt_bias and A_log on `torch.cuda.current_device()`, and
    calls the zero-argument super(), which a recompiled method cannot (its class cell is gone)."""
    if torch.cuda.is_available() or "gated_delta_net" in _APPLIED:
        return
    from megatron.core.ssm import gated_delta_net

    gated_delta_net.l2norm = l2norm
    gated_delta_net.chunk_gated_delta_rule = gated_delta_net.torch_chunk_gated_delta_rule
    gated_delta_net.HAVE_FLA = True
    _rewrite(gated_delta_net.GatedDeltaNet, "__init__", [
        ("super().__init__(config)", "MegatronModule.__init__(self, config)"),
        ("device=torch.cuda.current_device()", 'device="cpu"')])
    _APPLIED.add("gated_delta_net")
def _shim_mla_rotary() -> None:
    # models/common/embeddings/yarn_rotary_pos_embedding.py, YarnRotaryEmbedding.__init__: multi-latent attention
    # (DeepSeek-V3, megarl.models.latent_attention) builds one per layer without use_cpu_initialization, so its
    # frequencies are allocated on torch.cuda.current_device() (its zero-argument super() call is spelled out), and
    # its get_emb (which __init__ calls to fill a cos / sin cache) moves them there.
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding

    _rewrite(yarn_rotary_pos_embedding.YarnRotaryEmbedding, "__init__", [
        ("device = 'cpu' if use_cpu_initialization else torch.cuda.current_device()", "device = 'cpu'"),
        ("super().__init__(", "RotaryEmbedding.__init__(self, "),
        ("use_cpu_initialization=use_cpu_initialization,", "use_cpu_initialization=True,"),
    ])
    _rewrite(yarn_rotary_pos_embedding.YarnRotaryEmbedding, "get_emb",
             [("device=torch.cuda.current_device()", 'device="cpu"')])


SHIMS: dict[str, Callable[[], None]] = {
    "schedule_token_count": _shim_schedule_token_count,
    "memory_buffer": _shim_memory_buffer,
    "rotary": _shim_rotary,
    "rng_tracker": _shim_rng_tracker,
    "grad_buffer": _shim_grad_buffer,
    "fp32_optimizer": _shim_fp32_optimizer,
    "grad_norm": _shim_grad_norm,
    "clip_grads": _shim_clip_grads,
    "p2p": _shim_p2p,
    "tied_embedding_sync": _shim_tied_embedding_sync,
    "distributed_optimizer": _shim_distributed_optimizer,
    "distributed_optimizer_load": _shim_distributed_optimizer_load,
    "moe_router_device": _shim_moe_router_device,
    "moe_gating_gemm": _shim_moe_gating_gemm,
    "moe_dispatcher_streams": _shim_moe_dispatcher_streams,
    "moe_collectives_device": _shim_moe_collectives_device,
    "moe_split_sizes": _shim_moe_split_sizes,
    "moe_sequence_parallel": _shim_moe_sequence_parallel,
    "expert_bias": _shim_expert_bias,
    "mla_rotary": _shim_mla_rotary,
}


def apply_cpu_shims(names=None) -> None:
    """Apply the CPU shims (all, or the named subset); idempotent; a no-op when CUDA is available."""
    if torch.cuda.is_available():
        return
    for name in SHIMS if names is None else names:
        if name not in _APPLIED:
            SHIMS[name]()
            _APPLIED.add(name)
