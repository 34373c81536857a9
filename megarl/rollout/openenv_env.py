"""The separate Python environment OpenEnv environments run in: `python -m megarl.rollout.openenv_env [PACKAGE...]`.

PyPI `openenv` 0.10.0 pulls gradio, whose pins downgrade packages megarl's environment holds (pillow), so it never
goes into megarl's environment. `ensure_env()` builds one virtual environment, by default
~/.cache/megarl/openenv-env (override with MEGARL_OPENENV_ENV), once per machine:

    python -m venv ENV
    ENV/bin/python -m pip install openenv==0.10.0
    ENV/bin/python -c "import openenv.core.env_server, uvicorn, websockets"     the check; only then is READY written

built in ENV.partial under a file lock and renamed when it passed (megarl/cached_env.py). An environment's own
package goes into it as users install it (`python -m megarl.rollout.openenv_env PACKAGE...`: pip specifiers or
paths), or is importable from PYTHONPATH (the worker, megarl/rollout/openenv_worker.py, and the server it starts
inherit it).
"""
from __future__ import annotations

import sys
from pathlib import Path

from megarl.cached_env import CachedEnv, environment_main

OPENENV_VERSION = "0.10.0"

ENV = CachedEnv("openenv-env", "MEGARL_OPENENV_ENV", "megarl-openenv-env.json",
                is_current=lambda record: record.get("openenv") == OPENENV_VERSION, label="openenv env")


def ensure_env(directory: Path | None = None, log=None) -> tuple[Path, float]:
    """(the env's python, seconds spent building: 0 when it was ready). Builds it on first use."""
    directory = directory or ENV.directory()
    say = log or (lambda msg: print(f"megarl: {msg}", file=sys.stderr, flush=True))

    def install(py: str) -> dict:
        ENV.run([py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", f"openenv=={OPENENV_VERSION}"],
                f"pip install openenv=={OPENENV_VERSION}")
        version = ENV.run([py, "-c", "import importlib.metadata as m, openenv.core.env_server, uvicorn, websockets; "
                                     "print(m.version('openenv'))"],
                          "import openenv.core.env_server, uvicorn, websockets").strip().splitlines()[-1]
        if version != OPENENV_VERSION:
            raise RuntimeError(f"openenv env: built openenv {version}, expected {OPENENV_VERSION}")
        return {"openenv": version}

    python, seconds = ENV.ensure(install, lambda: say(
        f"building the OpenEnv environment {directory} (openenv=={OPENENV_VERSION}; once per machine, minutes)"),
        directory)
    if seconds:
        say(f"OpenEnv environment ready: {directory} in {seconds:.0f}s")
    return python, seconds


def main(argv: list[str] | None = None) -> int:
    return environment_main(ENV, ensure_env, "megarl.rollout.openenv_env", "OpenEnv environments", argv)


if __name__ == "__main__":
    raise SystemExit(main())
