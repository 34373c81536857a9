"""The worker side of megarl/rollout/env_worker.py's JSON-lines protocol, shared by the programs megarl runs inside an
environment of their own (verifiers_worker.py, openenv_worker.py).

Standard library only: those programs run under another virtual environment's Python, which has no megarl; run as
files, they import this module as a sibling (`import worker_lines`), imported as megarl modules (tests), from
megarl.rollout.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from typing import TextIO


def protocol_stdout() -> TextIO:
    """The protocol's channel: the process's stdout, after fd 1 is moved to stderr, so that whatever the
    environment's stack prints cannot corrupt the protocol."""
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def send(out: TextIO, lock: threading.Lock, message: dict) -> None:
    """Write one protocol line (strict JSON: a NaN is a bug, never a line), whole, whichever thread sends it."""
    line = json.dumps(message, allow_nan=False)
    with lock:
        out.write(line + "\n")
        out.flush()


def refuse_start(out: TextIO, what: str, exc: Exception) -> int:
    """Tell megarl, as the first line, why the worker could not start; the exit status to return."""
    out.write(json.dumps({"type": "error", "id": None, "error": f"{what}: {type(exc).__name__}: {exc}"}) + "\n")
    out.flush()
    return 1


def check_request(request, n_tasks: int | None = None) -> str | None:
    """Why a request line is not a well-formed run/close request (None: it is); with `n_tasks`, a run's task index
    must be one of the worker's tasks."""
    if not isinstance(request, dict):
        return "a request is a JSON object"
    if request.get("op") == "close":
        return None
    if request.get("op") != "run":
        return f"unknown op {request.get('op')!r} (run, close)"
    for key, kind in (("id", int), ("task", int), ("base_url", str), ("timeout_s", (int, float))):
        if not isinstance(request.get(key), kind) or isinstance(request.get(key), bool):
            return f"run request needs {key!r} of type {getattr(kind, '__name__', 'number')}, got {request.get(key)!r}"
    if request["timeout_s"] <= 0:
        return f"timeout_s must be > 0, got {request['timeout_s']}"
    if n_tasks is not None and not 0 <= request["task"] < n_tasks:
        return f"task {request['task']} out of range (0..{n_tasks - 1})"
    return None
