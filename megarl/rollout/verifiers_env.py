"""The separate Python environment `verifiers` environments run in: `python -m megarl.rollout.verifiers_env`.

PyPI `verifiers` 0.4.0 pins `openai<3` while megarl's environment holds openai 3.x, so verifiers never goes into
megarl's environment. `ensure_env()` builds one virtual environment, by default ~/.cache/megarl/verifiers-env
(override with MEGARL_VERIFIERS_ENV), once per machine:

    python -m venv ENV
    ENV/bin/python -m pip install verifiers==0.4.0 uv==0.13.9     uv: verifiers' chat harness runs its program
                                                                  as a PEP 723 script (`uv sync --script`)
    ENV/bin/python -c "import verifiers.v1"                       the check; only then is READY written

built in ENV.partial under a file lock and renamed when it passed (megarl/cached_env.py); 10 min on 2 loaded CPU
cores (load average 20). An environment's own package goes into it as users install it, `python -m
megarl.rollout.verifiers_env PACKAGE...` (pip specifiers or paths, installed into the ready env), or is importable from
PYTHONPATH (the worker inherits it). megarl runs megarl/rollout/verifiers_worker.py with ENV/bin/python, ENV/bin first
on PATH (the harness runs its program with that uv, which installs the program's own dependencies once, into uv's
cache, on the first episode).
"""
from __future__ import annotations

import sys
from pathlib import Path

from megarl.cached_env import CachedEnv, environment_main

VERIFIERS_VERSION = "0.4.0"
UV_VERSION = "0.13.9"


ENV = CachedEnv("verifiers-env", "MEGARL_VERIFIERS_ENV", "megarl-verifiers-env.json",
                is_current=lambda record: record.get("verifiers") == VERIFIERS_VERSION, label="verifiers env")


def ensure_env(directory: Path | None = None, log=None) -> tuple[Path, float]:
    """(the env's python, seconds spent building: 0 when it was ready). Builds it on first use."""
    env = ENV
    directory = directory or env.directory()
    say = log or (lambda msg: print(f"megarl: {msg}", file=sys.stderr, flush=True))

    def install(py: str) -> dict:
        pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        env.run([*pip, f"verifiers=={VERIFIERS_VERSION}", f"uv=={UV_VERSION}"],
                f"pip install verifiers=={VERIFIERS_VERSION} uv=={UV_VERSION}")
        version = env.run([py, "-c", "import importlib.metadata as m, verifiers.v1; print(m.version('verifiers'))"],
                          "import verifiers.v1").strip().splitlines()[-1]
        if version != VERIFIERS_VERSION:
            raise RuntimeError(f"verifiers env: built verifiers {version}, expected {VERIFIERS_VERSION}")
        return {"verifiers": version}

    python, seconds = env.ensure(install, lambda: say(
        f"building the verifiers environment {directory} (verifiers=={VERIFIERS_VERSION}; once per machine, "
        f"minutes: 10 on 2 loaded cores)"), directory)
    if seconds:
        say(f"verifiers environment ready: {directory} in {seconds:.0f}s")
    return python, seconds


def main(argv: list[str] | None = None) -> int:
    return environment_main(ENV, ensure_env, "megarl.rollout.verifiers_env", "verifiers environments", argv)


if __name__ == "__main__":
    raise SystemExit(main())
