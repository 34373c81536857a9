"""The program megarl runs inside the OpenEnv environment (megarl/rollout/openenv_env.py): one OpenEnv environment
server started locally, its episodes driven against the base_urls megarl hands it.

It imports only the standard library and what `openenv` brings (uvicorn, websockets), never megarl (run as
`ENV/bin/python openenv_worker.py --app MODULE:ATTR`). The server starts as OpenEnv documents a local run without
Docker, `python -m uvicorn MODULE:ATTR --host 127.0.0.1 --port P`, as a child process. An episode is one WebSocket
session on its /ws (the HTTP /reset and /step build a fresh environment per request, so only /ws keeps an episode's
state): `reset` with the task's seed, then, until the environment says done or --max-turns model turns:

    observation -> a user message (its one text field, else its fields as JSON)
    the model's reply, from megarl's endpoint (POST base_url/chat/completions) -> the action's one text field
    step -> the next observation and its reward; the episode's reward is the sum of the step rewards

Supported: actions with exactly one required string field (besides OpenEnv's `metadata`), read from the server's
/schema; another action schema is refused when the worker starts, naming the fields.

Protocol: megarl/rollout/env_worker.py's JSON lines, stdin in, stdout out (anything else goes to stderr: fd 1 is
moved there). The tasks are seeds 0..--tasks-1, each listed with its reset observation as the prompt.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request

if __package__:  # imported as a megarl module (the tests)
    from megarl.rollout.worker_lines import check_request, protocol_stdout, refuse_start, send
else:  # run as a file by its environment's Python, which has no megarl: the sibling file
    from worker_lines import check_request, protocol_stdout, refuse_start, send

SERVER_START_TIMEOUT_S = 120.0  # importing the environment's app (FastAPI, gradio) on a loaded machine
HTTP_TIMEOUT_S = 60.0
PLAIN_FIELDS = {"metadata"}  # OpenEnv's own Action/Observation fields that are not the environment's content


def action_field(schema: dict) -> str:
    """The action's one text field (its JSON schema from /schema); ValueError naming the fields otherwise."""
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k not in PLAIN_FIELDS}
    required = [k for k in schema.get("required") or [] if k in props]
    texts = [k for k in (required or list(props)) if props[k].get("type") == "string"]
    if len(texts) != 1 or any(k not in texts for k in required):
        raise ValueError(f"its action fields {sorted(props)} (required {sorted(required)}): megarl's OpenEnv adapter "
                         f"supports actions with exactly one required string field, filled with the model's reply")
    return texts[0]


def observation_text(observation: dict) -> str:
    """What the model reads of an observation: its one text field, else its fields (less metadata) as JSON."""
    fields = {k: v for k, v in observation.items() if k not in PLAIN_FIELDS}
    texts = [v for v in fields.values() if isinstance(v, str)]
    if len(fields) == 1 and texts:
        return texts[0]
    return json.dumps(fields, sort_keys=True, default=str)


def _reward(value) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"the environment returned reward {value!r}; a finite number or null is expected")
    return float(value)


def _post(url: str, body: dict, timeout_s: float) -> dict:
    """POST JSON, the reply's JSON; an HTTP error names its status and body, never the URL (a session URL holds
    megarl's secret token)."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"the server answered HTTP {exc.code}: {exc.read()[:500]!r}") from None


class Server:
    """The environment's server, a child process on a free local port."""

    def __init__(self, app: str, timeout_s: float = SERVER_START_TIMEOUT_S):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port",
                                      str(self.port), "--log-level", "warning"], stdout=sys.stderr, stderr=sys.stderr)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server `uvicorn {app}` exited (rc {self.proc.returncode}) before it answered "
                                   f"/health; its stderr is above")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the server `uvicorn {app}` did not answer /health within {timeout_s:g}s")
            time.sleep(0.2)
        with urllib.request.urlopen(f"{self.url}/schema", timeout=HTTP_TIMEOUT_S) as reply:
            self.schema = json.loads(reply.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Episode:
    """One WebSocket session of the server (a context manager): reset, step, each answered by an observation or an
    error."""

    def __init__(self, server_url: str, timeout_s: float):
        from websockets.sync.client import connect

        self.connection = connect(server_url.replace("http://", "ws://") + "/ws", open_timeout=timeout_s,
                                  max_size=64 * 2**20)

    def __enter__(self) -> "Episode":
        self.ws = self.connection.__enter__()
        return self

    def call(self, kind: str, data: dict, timeout_s: float) -> dict:
        self.ws.send(json.dumps({"type": kind, "data": data}))
        reply = json.loads(self.ws.recv(timeout=max(timeout_s, 0.001)))
        if reply.get("type") != "observation":
            raise RuntimeError(f"the environment answered {kind} with {json.dumps(reply)[:800]}")
        return reply["data"]

    def __exit__(self, *exc) -> None:
        try:
            self.ws.send(json.dumps({"type": "close", "data": {}}))
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.connection.__exit__(*exc)


class Worker:
    def __init__(self, app: str, n_tasks: int, max_turns: int, max_concurrent: int, model: str, out):
        self.app, self.max_turns, self.model, self.out = app, max_turns, model, out
        self.write_lock = threading.Lock()
        self.server = Server(app)
        try:
            self.field = action_field(self.server.schema.get("action") or {})
        except ValueError as exc:
            self.server.close()
            raise ValueError(f"OpenEnv environment {app!r}: {exc}") from None
        self.prompts = [observation_text(_post(f"{self.server.url}/reset", {"seed": i}, HTTP_TIMEOUT_S)["observation"])
                        for i in range(n_tasks)]
        self.pool = concurrent.futures.ThreadPoolExecutor(max_concurrent, thread_name_prefix="episode")

    def send(self, message: dict) -> None:
        send(self.out, self.write_lock, message)

    def ready(self) -> dict:
        return {"type": "ready", "env": self.app, "harness": f"openenv:{self.field}",
                "tasks": [{"index": i, "prompt": [{"role": "user", "content": text}], "answer": None,
                           "info": {"seed": i}} for i, text in enumerate(self.prompts)]}

    def run(self, request: dict) -> None:
        request_id, seed = request["id"], request["task"]
        deadline = time.monotonic() + request["timeout_s"]
        left = lambda: deadline - time.monotonic()  # noqa: E731
        messages, reward, turns, done = [], 0.0, 0, False
        try:
            with Episode(self.server.url, left()) as episode:
                step = episode.call("reset", {"seed": seed}, left())
                reward += _reward(step.get("reward"))
                done = bool(step.get("done"))
                while not done and turns < self.max_turns:
                    if left() <= 0:
                        raise TimeoutError(f"episode of task {seed} ran past {request['timeout_s']:g}s")
                    messages.append({"role": "user", "content": observation_text(step["observation"])})
                    reply = _post(f"{request['base_url']}/chat/completions",
                                  {"model": self.model, "messages": messages}, left())
                    content = reply["choices"][0]["message"].get("content") or ""
                    messages.append({"role": "assistant", "content": content})
                    turns += 1
                    step = episode.call("step", {self.field: content}, left())
                    reward += _reward(step.get("reward"))
                    done = bool(step.get("done"))
            self.send({"type": "result", "id": request_id, "ok": True, "reward": reward,
                       "rewards": {"openenv": {"score": reward, "weight": 1.0}},
                       "metrics": {"done": done, "steps": turns}, "messages": messages, "turns": turns,
                       "errors": []})
        except Exception as exc:  # noqa: BLE001 - one episode's failure is that episode's answer
            self.send({"type": "error", "id": request_id, "error": f"{type(exc).__name__}: {exc}\n"
                                                                   f"{traceback.format_exc(limit=-3)}"[-4000:]})

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="megarl's OpenEnv worker (JSON lines on stdin/stdout)")
    parser.add_argument("--app", required=True, help="the environment's server app, MODULE:ATTR (uvicorn's form)")
    parser.add_argument("--tasks", type=int, default=64, help="episodes are reset with seeds 0..tasks-1")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--model", default="megarl", help="the model name sent with each request")
    parser.add_argument("--max-concurrent", type=int, default=4)
    args = parser.parse_args(argv)
    out = protocol_stdout()
    try:
        worker = Worker(args.app, args.tasks, args.max_turns, args.max_concurrent, args.model, out)
    except Exception as exc:  # noqa: BLE001 - told to megarl as the first line, then exit
        return refuse_start(out, f"starting OpenEnv environment {args.app!r}", exc)
    try:
        worker.send(worker.ready())
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                request = json.loads(line)
            except ValueError as exc:
                worker.send({"type": "error", "id": None, "error": f"request is not JSON: {exc}"})
                continue
            if (problem := check_request(request, len(worker.prompts))) is not None:
                worker.send({"type": "error", "id": request.get("id") if isinstance(request, dict) else None,
                             "error": problem})
                continue
            if request["op"] == "close":
                break
            worker.pool.submit(worker.run, request)
    finally:
        worker.close()
    out.flush()
    os._exit(0)  # episode threads blocked on a socket must not hold the exit


if __name__ == "__main__":
    raise SystemExit(main())
