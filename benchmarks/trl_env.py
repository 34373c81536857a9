"""The separate Python environment benchmarks/vs_trl.py runs Hugging Face TRL in: `python benchmarks/trl_env.py`.

TRL is never installed into megarl's environment (it would pull its own accelerate / datasets / transformers
pins into it, and a torch requirement admitting a newer release pulls a CUDA build of several GB). As the
vLLM environment (megarl/sampler/vllm_env.py), it is one virtual environment built once per machine, by
default ~/.cache/megarl/trl-env (override with MEGARL_TRL_ENV), in ENV.partial under a file lock and renamed
when `import trl` passed, so a half-built one never looks finished:

    python -m venv ENV
    ENV/bin/python -m pip install torch==2.13.0                    the CPU build (on disk here)
    ENV/bin/python -m pip install torch==2.13.0 trl==1.16.0 transformers==5.24.0
                                        torch pinned again so the resolver cannot upgrade it; transformers
                                        pinned to megarl's, so both sides load the model with the same code

1.5 GB (TRL 1.16.0 brings accelerate 1.15.0, datasets 5.2.0, pyarrow 26.0.1); it took 9.8 minutes to build here with
the 2 cores shared by other jobs (load average ~15).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megarl.filelock import exclusive  # noqa: E402

PINS = {"torch": "2.13.0", "trl": "1.16.0", "transformers": "5.24.0"}
READY = "megarl-trl-env.json"
INSTALL_TIMEOUT_S = 1800


def env_dir() -> Path:
    default = Path(os.environ.get("MEGARL_CACHE", Path.home() / ".cache" / "megarl")) / "trl-env"
    return Path(os.environ.get("MEGARL_TRL_ENV", default)).expanduser()


def env_python(directory: Path | None = None) -> Path:
    return (directory or env_dir()) / "bin" / "python"


def is_ready(directory: Path | None = None) -> bool:
    directory = directory or env_dir()
    try:
        record = json.loads((directory / READY).read_text())
    except (OSError, ValueError):
        return False
    return record.get("pins") == PINS and env_python(directory).exists()


def _run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"trl env: {what} failed (rc {proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc.stdout


def ensure_env(directory: Path | None = None) -> Path:
    """The environment's python; builds the environment first if it is not ready."""
    directory = directory or env_dir()
    if is_ready(directory):
        return env_python(directory)
    with exclusive(directory.with_name(f".{directory.name}.lock")):
        if is_ready(directory):  # another process built it while we waited
            return env_python(directory)
        start = time.monotonic()
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(directory, ignore_errors=True)  # a stale or other-version env
        pins = [f"{name}=={version}" for name, version in PINS.items()]
        print(f"vs_trl: building the TRL environment {directory} ({' '.join(pins)}; once per machine, minutes, 1.5 GB)",
              file=sys.stderr, flush=True)
        _run([sys.executable, "-m", "venv", str(partial)], "python -m venv")
        py = str(env_python(partial))
        pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        _run([*pip, pins[0]], f"pip install {pins[0]}")
        _run([*pip, *pins], f"pip install {' '.join(pins)}")
        versions = json.loads(_run([py, "-c", "import json, torch, trl, transformers; print(json.dumps({"
                                        "'torch': torch.__version__, 'trl': trl.__version__, "
                                        "'transformers': transformers.__version__}))"],
                                   "import torch, trl, transformers").strip().splitlines()[-1])
        if any(not versions[name].startswith(version) for name, version in PINS.items()):
            raise RuntimeError(f"trl env: built {versions}, expected {PINS}")
        partial.rename(directory)
        (directory / READY).write_text(json.dumps({"pins": PINS, "versions": versions,
                                                   "built_s": round(time.monotonic() - start, 1)}) + "\n")
    return env_python(directory)


if __name__ == "__main__":
    print(ensure_env())
