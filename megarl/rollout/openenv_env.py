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

import argparse
import sys
from pathlib import Path

from megarl.cached_env import CachedEnv

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
    parser = argparse.ArgumentParser(prog="python -m megarl.rollout.openenv_env",
                                     description="Build (once) the separate environment OpenEnv environments run in.")
    parser.add_argument("packages", nargs="*", help="packages to install into it (an environment's own package)")
    parser.add_argument("--dir", type=Path, default=None, help="environment directory (default: ~/.cache/megarl/"
                                                                "openenv-env, or MEGARL_OPENENV_ENV)")
    parser.add_argument("--print-python", action="store_true", help="only print the env's python path")
    args = parser.parse_args(argv)
    python, seconds = ensure_env(args.dir)
    if args.packages:
        ENV.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args.packages],
                f"pip install {' '.join(args.packages)}")
    print(python if args.print_python else f"{python} (built in {seconds:.0f}s)" if seconds else f"{python} (ready)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
