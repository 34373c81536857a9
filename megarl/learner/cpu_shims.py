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
shim is needed (tests/learner/test_cpu_shims.py).
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
    # dot_product_attention.py takes its attention-score buffer from here on every forward.
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


SHIMS: dict[str, Callable[[], None]] = {
    "schedule_token_count": _shim_schedule_token_count,
    "memory_buffer": _shim_memory_buffer,
    "rotary": _shim_rotary,
    "rng_tracker": _shim_rng_tracker,
    "grad_buffer": _shim_grad_buffer,
    "fp32_optimizer": _shim_fp32_optimizer,
    "grad_norm": _shim_grad_norm,
    "clip_grads": _shim_clip_grads,
}


def apply_cpu_shims(names=None) -> None:
    """Apply the CPU shims (all, or the named subset); idempotent; a no-op when CUDA is available."""
    if torch.cuda.is_available():
        return
    for name in SHIMS if names is None else names:
        if name not in _APPLIED:
            SHIMS[name]()
            _APPLIED.add(name)
