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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megarl.cached_env import CachedEnv  # noqa: E402

PINS = {"torch": "2.13.0", "trl": "1.16.0", "transformers": "5.24.0"}
ENV = CachedEnv("trl-env", "MEGARL_TRL_ENV", "megarl-trl-env.json",
                is_current=lambda record: record.get("pins") == PINS, label="trl env")


def _install(py: str) -> dict:
    """torch first (the CPU build), then everything with torch pinned again; the READY record."""
    pins = [f"{name}=={version}" for name, version in PINS.items()]
    pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    ENV.run([*pip, pins[0]], f"pip install {pins[0]}")
    ENV.run([*pip, *pins], f"pip install {' '.join(pins)}")
    versions = json.loads(ENV.run([py, "-c", "import json, torch, trl, transformers; print(json.dumps({"
                                         "'torch': torch.__version__, 'trl': trl.__version__, "
                                         "'transformers': transformers.__version__}))"],
                                  "import torch, trl, transformers").strip().splitlines()[-1])
    if any(not versions[name].startswith(version) for name, version in PINS.items()):
        raise RuntimeError(f"trl env: built {versions}, expected {PINS}")
    return {"pins": PINS, "versions": versions}


def ensure_env(directory: Path | None = None) -> Path:
    """The environment's python; builds the environment first if it is not ready."""
    directory = directory or ENV.directory()
    pins = " ".join(f"{name}=={version}" for name, version in PINS.items())
    return ENV.ensure(_install, lambda: print(
        f"vs_trl: building the TRL environment {directory} ({pins}; once per machine, minutes, 1.5 GB)",
        file=sys.stderr, flush=True), directory)[0]


if __name__ == "__main__":
    print(ensure_env())
