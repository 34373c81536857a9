"""Brings up SGLang's own Python code on CPU for the contract tests: a pinned install, and the stubs it needs.

`install(version)` puts `pip install --no-deps sglang==VERSION` into a cache directory under
~/.cache/megarl/sglang-contract/ (once; later runs reuse it), next to one shared directory of the
pure-Python packages SGLang's request types, argument parser and weight-update manager import
(DEPS, pinned; the directory's name is a hash of DEPS, so changing a pin builds a new one and a cached
directory with the old pins is never used again). Neither touches the test environment: the checks run in a
subprocess whose PYTHONPATH is those directories. A failed install raises: the contract tests fail, never skip.

`install_stubs()` (called first in that subprocess) makes the modules in STUBS importable as empty
stand-ins. Each is imported at module level somewhere on the import path of the code under test but
never used by it; none can be installed and run on these CPUs, or it would be installed instead.
`install_stubs(cpu_engine=True)` adds CPU_ENGINE_STUBS, for SGLang's CPU mode (family_loads.py).
"""
from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import time
import types
from pathlib import Path

from megarl.filelock import exclusive

CACHE = Path(os.environ.get("MEGARL_CACHE", Path.home() / ".cache" / "megarl")) / "sglang-contract"
DEPS = ("pybase64==1.5.1", "msgspec==0.23.0", "fastapi==0.165.0", "starlette==1.10.0", "openai==3.57.0",
        "httpx==0.28.1", "httpcore==1.0.9", "distro==1.9.0", "jiter==0.19.0", "partial_json_parser==0.2.1.1.post7",
        "opentelemetry-api==1.45.2", "uvloop==0.23.0", "uvicorn==0.54.0",
        # Imported at module level by sglang/srt/utils/common.py (orjson, requests) and sglang/utils.py (requests,
        # IPython.display), with what they import in turn. A fresh venv has none of them; a Python that happens to
        # have them (a system one) hides their absence, so the fresh-venv CI (.ci/run) is what checks this list.
        "orjson==3.13.0", "requests==2.34.2", "urllib3==2.8.0", "certifi==2026.10.19.post1", "idna==3.20",
        "charset-normalizer==3.5.3", "ipython==9.18.1", "traitlets==5.16.1")
STUBS = {
    "triton": "GPU kernel compiler (CUDA only); sglang.srt.utils.common imports it at module level",
    "aiohttp": "HTTP client of SGLang's frontend language (sglang.lang), imported by sglang/__init__",
    "torchvision": "image transforms of the multimodal processors, imported through the model configs",
    "tvm_ffi": "FFI of the flashinfer/TVM CUDA kernels, imported by the kernel registry",
    "sentencepiece": "tokenizer backend of some multimodal models' processors (never loaded here)",
    "compressed_tensors": "quantisation configs of compressed-tensors checkpoints (quantization/__init__)",
    "gguf": "GGUF checkpoint reader (quantization/__init__); GGUF kernels are CUDA only",
}
# Stubbed as well where SGLang runs in its CPU mode (SGLANG_USE_CPU_ENGINE=1: family_loads.py builds its models).
CPU_ENGINE_STUBS = {
    "sgl_kernel": "SGLang's kernel library: PyPI's sgl-kernel wheels are CUDA builds and its CPU build is compiled "
                  "from source; in CPU mode the KV-cache pool imports it at module level, building a model and "
                  "loading its weights call none of it",
}


def _pip(target: Path, *requirements: str) -> None:
    partial = target.with_name(target.name + ".partial")
    subprocess.run(["rm", "-rf", str(partial)], check=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                           "--no-deps", "--target", str(partial), *requirements],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"pip install --no-deps --target {partial} {' '.join(requirements)} failed "
                           f"(rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    partial.rename(target)  # a half-finished install never looks finished


def install(version: str) -> tuple[list[Path], float]:
    """(PYTHONPATH entries for SGLang `version`, seconds spent installing: 0 on a warm cache)."""
    start = time.monotonic()
    CACHE.mkdir(parents=True, exist_ok=True)
    sglang_dir = CACHE / f"sglang-{version}"
    deps_dir = CACHE / f"deps-{hashlib.sha1(' '.join(DEPS).encode()).hexdigest()[:12]}"  # new pins: new dir
    with exclusive(CACHE / ".install.lock"):  # test processes running at once install once, never into each other
        if not sglang_dir.exists():
            _pip(sglang_dir, f"sglang=={version}")
        if not deps_dir.exists():
            _pip(deps_dir, *DEPS)
    return [sglang_dir, deps_dir], time.monotonic() - start


class _StubMeta(type):
    """Stub classes: every attribute is another stub class; used as a decorator, they leave the function."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(f"{cls.__name__}.{name}")

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return super().__call__()

    def __getitem__(cls, item):
        return cls


class _Stub(metaclass=_StubMeta):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(name)

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and not kwargs and callable(args[0]) else _Stub()


def _stub(name: str) -> type:
    return _StubMeta(name, (_Stub,), {})


def _module_getattr(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _stub(name)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, stubs: dict[str, str]):
        self.stubs = stubs

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.stubs:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__, module.__getattr__, module.__version__ = [], _module_getattr, "0.0.0"
        return module

    def exec_module(self, module):
        pass


def install_stubs(cpu_engine: bool = False) -> None:
    """STUBS importable from here on; CPU_ENGINE_STUBS too with `cpu_engine`."""
    # torch decides once whether triton exists: let it see the truth before the triton stub appears.
    import torch._inductor.compile_fx  # noqa: F401

    sys.meta_path.insert(0, _StubFinder({**STUBS, **CPU_ENGINE_STUBS} if cpu_engine else STUBS))
