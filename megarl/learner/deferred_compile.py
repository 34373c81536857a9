"""Import megatron-core without paying for torch.compile's machinery until something compiled is called.

megatron-core decorates its fusable functions with ``jit_fuser`` (``torch.compile`` on torch >= 2.2) when
they are imported. ``torch.compile`` compiles lazily, at the first call, but the decoration itself imports
``torch._dynamo`` and inductor's ``compile_fx``: about 1.8 s of CPU on these cores, on the learner's path to
its first step (docs/benchmarks.md, "Start-up, part by part"), for functions (bias-GeLU/GeGLU/SwiGLU
fusions, squared ReLU, L2 norm, the attention output gate) that megarl's models only reach with fusions
or features they do not use. ``deferred_compile()`` makes ``torch.compile`` of a plain function return
a wrapper that calls the real ``torch.compile`` with the same arguments at its first call, so what runs
compiled is exactly what ran compiled before, and the import happens only if it ever does.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Iterator

import torch


def _deferred(real_compile):
    def compile_later(model=None, **kwargs):
        if model is None:  # the decorator form with arguments: @torch.compile(mode=...)
            return lambda fn: compile_later(fn, **kwargs)
        if not inspect.isfunction(model):  # a module or other callable: what torch.compile gives for it
            return real_compile(model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **call_kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **kwargs)
            return compiled(*args, **call_kwargs)

        return first_call_compiles

    return compile_later


@contextlib.contextmanager
def deferred_compile() -> Iterator[None]:
    """While inside, ``torch.compile(fn)`` compiles `fn` at its first call (see the module docstring); for
    the first import of megatron-core, whose ``jit_fuser`` keeps the function it saw then."""
    real_compile = torch.compile
    torch.compile = _deferred(real_compile)
    try:
        yield
    finally:
        torch.compile = real_compile
