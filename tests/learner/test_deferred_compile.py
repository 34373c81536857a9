"""deferred_compile: torch.compile of a function compiles at its first call (megatron's jit_fuser under it imports no
torch._dynamo / inductor at import: megarl/learner/deferred_compile.py)."""
import subprocess
import sys

import torch

from megarl.learner.deferred_compile import deferred_compile
from tests.helpers import REPO


def test_a_function_compiles_at_its_first_call_with_the_arguments_given():
    compiled_graphs = []

    def backend(graph, example_inputs):  # a real torch.compile backend: runs the captured graph as is
        compiled_graphs.append(graph)
        return graph.forward

    def affine(x):
        return x * 2 + 1

    def square(x):  # dynamo caches per code object: the decorator form compiles another function
        return x * x

    real_compile = torch.compile
    with deferred_compile():
        called = torch.compile(affine, backend=backend)
        decorated = torch.compile(backend=backend)(square)  # the decorator form with arguments
        module = torch.compile(torch.nn.Linear(2, 2), backend=backend)  # not a function: compiled as before
    assert torch.compile is real_compile
    assert called.__wrapped__ is affine and isinstance(module, torch.nn.Module)
    assert not compiled_graphs  # nothing compiled before a call
    x = torch.arange(4.0)
    assert torch.equal(called(x), affine(x)) and len(compiled_graphs) == 1
    assert torch.equal(decorated(x), square(x)) and len(compiled_graphs) == 2
    assert torch.equal(called(x), affine(x)) and len(compiled_graphs) == 2  # compiled once


def test_megatron_imported_under_it_imports_no_dynamo():
    code = ("import sys, torch\n"
            "from megarl.learner.deferred_compile import deferred_compile\n"
            "with deferred_compile():\n"
            "    from megatron.core.models.gpt import GPTModel\n"
            "    from megatron.core.optimizer import get_megatron_optimizer\n"
            "    from megatron.core.transformer import TransformerConfig\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor.compile_fx') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"
