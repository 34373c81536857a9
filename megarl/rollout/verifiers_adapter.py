"""`task.env=verifiers:<id>`: a `verifiers` environment (its dataset, its multi-turn protocol, its rewards) trained on
megarl's samplers, unchanged, through the agent endpoint.

verifiers cannot live in megarl's environment (it pins openai<3), so it runs in its own (megarl/rollout/
verifiers_env.py) as a worker process (megarl/rollout/verifiers_worker.py) spoken to over JSON lines on its stdin and
stdout. `VerifiersTask` is the prompt source: it starts the worker, which loads the environment and lists its
dataset; every task row becomes a prompt. Each episode is an agent call (megarl/rollout/agent.py, the AgentRunner
machinery unchanged): `run_episode` asks the worker to run the row's episode against the episode's base_url, so
every model turn the environment's harness asks for is a request on megarl's endpoint (sampled tokens, versions and
log-probs as any rollout), and returns the environment's reward (the sum of its weighted rewards).

The worker is a process outside megarl: every line it writes is validated (`check_ready`, `check_result`) and a
malformed one fails what waited on it with a message naming the field; every wait has a timeout
(WORKER_START_TIMEOUT_S for loading, task.agent_timeout_s per episode); a worker that exits fails the episodes in
flight with its exit code and the tail of its stderr. Refused before launch, by name (megarl/config/load.py): another
scheme than `verifiers:`, an empty id, and with it task.agent, task.reward_fn, task.path or eval.sets.
"""
from __future__ import annotations

import atexit
import collections
import concurrent.futures
import itertools
import json
import math
import os
import random
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from megarl.protocols import Prompt
from megarl.rollout.tasks import task_from_config

SCHEME = "verifiers"
AGENT = "megarl.rollout.verifiers_adapter:run_episode"  # the agent function every verifiers episode is
WORKER_FILE = Path(__file__).with_name("verifiers_worker.py")
WORKER_START_TIMEOUT_S = 300.0  # importing verifiers and loading the environment's dataset on a loaded machine
CLOSE_TIMEOUT_S = 30.0
ANSWER_MARGIN_S = 30.0  # the worker bounds each episode by its timeout_s itself; this is for the answer to arrive
META_ENV, META_TASK = "verifiers_env", "verifiers_task"  # the prompt meta keys naming the worker and the row


class WorkerError(RuntimeError):
    """The verifiers worker failed, answered a malformed line, or did not answer in time."""


def env_id_of(spec: str) -> str:
    """The verifiers environment id of task.env=verifiers:<id>; ValueError naming task.env otherwise."""
    scheme, sep, env_id = spec.partition(":")
    if not sep or scheme != SCHEME:
        raise ValueError(f"task.env={spec!r}: only verifiers environments are supported (task.env=verifiers:<id>, "
                         f"the id of an installed verifiers environment package or a module on PYTHONPATH)")
    if not env_id.strip() or any(c.isspace() for c in env_id):
        raise ValueError(f"task.env={spec!r}: the environment id after 'verifiers:' must be non-empty, without spaces")
    return env_id


# ---- validation of the worker's lines (pure) ---------------------------------------------------------------------
@dataclass(frozen=True)
class TaskRow:
    index: int
    prompt: list[dict]  # the opening messages
    answer: str | None
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EpisodeResult:
    ok: bool
    reward: float
    rewards: dict  # name -> {"score", "weight"} (None: not scored)
    metrics: dict
    messages: list
    turns: int
    errors: list[str]


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise WorkerError(f"verifiers worker: malformed reply: {what}")


def check_ready(line: dict) -> tuple[str, list[TaskRow]]:
    """(the harness, the dataset's rows) of the worker's first line; WorkerError naming what is wrong."""
    _need(isinstance(line, dict), "a reply is a JSON object")
    if line.get("type") == "error":
        raise WorkerError(f"verifiers worker failed to start: {line.get('error')}")
    _need(line.get("type") == "ready", f"the first line must be type 'ready', got {line.get('type')!r}")
    _need(isinstance(line.get("harness"), str), "ready.harness must be a string")
    tasks = line.get("tasks")
    _need(isinstance(tasks, list) and len(tasks) > 0, "ready.tasks must be a non-empty list")
    rows = []
    for i, task in enumerate(tasks):
        _need(isinstance(task, dict) and task.get("index") == i, f"ready.tasks[{i}] must be an object with index {i}")
        prompt = task.get("prompt")
        _need(isinstance(prompt, list) and len(prompt) > 0
              and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in prompt),
              f"ready.tasks[{i}].prompt must be a non-empty list of messages with a role")
        _need(task.get("answer") is None or isinstance(task.get("answer"), str),
              f"ready.tasks[{i}].answer must be a string or null")
        _need(isinstance(task.get("info", {}), dict), f"ready.tasks[{i}].info must be an object")
        rows.append(TaskRow(i, prompt, task.get("answer"), task.get("info", {})))
    return line["harness"], rows


def check_result(line: dict) -> EpisodeResult:
    """The episode result of a worker's `result` line; WorkerError naming the bad field."""
    _need(line.get("type") == "result", f"expected type 'result', got {line.get('type')!r}")
    reward = line.get("reward")
    _need(isinstance(reward, (int, float)) and not isinstance(reward, bool) and math.isfinite(reward),
          f"result.reward must be a finite number, got {reward!r:.80}")
    _need(isinstance(line.get("ok"), bool), "result.ok must be a boolean")
    rewards = line.get("rewards")
    _need(isinstance(rewards, dict) and all(
        r is None or (isinstance(r, dict) and all(isinstance(r.get(k), (int, float)) for k in ("score", "weight")))
        for r in rewards.values()), "result.rewards must map names to {score, weight} or null")
    for key, kind in (("metrics", dict), ("messages", list), ("errors", list)):
        _need(isinstance(line.get(key), kind), f"result.{key} must be a {kind.__name__}")
    _need(isinstance(line.get("turns"), int), "result.turns must be an integer")
    return EpisodeResult(line["ok"], float(reward), rewards, line["metrics"], line["messages"], line["turns"],
                         [str(e) for e in line["errors"]])


# ---- the worker process ------------------------------------------------------------------------------------------
class Worker:
    """One worker process: `start()` reads its dataset, `run(task, base_url, timeout_s)` runs one episode (any
    thread; several at once), `close()` ends it."""

    def __init__(self, argv: list[str], env: dict | None = None):
        self.argv, self.env = argv, env
        self.proc: subprocess.Popen | None = None
        self.ids = itertools.count(1)
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.abandoned: set[int] = set()  # requests whose wait timed out: their late answers are dropped
        self.lock = threading.Lock()  # pending, writes to stdin, dead
        self.dead: str | None = None  # why the worker cannot answer any more
        self.stderr_tail: collections.deque = collections.deque(maxlen=40)
        self.ready: concurrent.futures.Future = concurrent.futures.Future()
        self.harness, self.rows = "", []

    def start(self, timeout_s: float = WORKER_START_TIMEOUT_S) -> "Worker":
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, encoding="utf-8", env=self.env, bufsize=1)
        threading.Thread(target=self._read_stdout, daemon=True, name="verifiers-worker-out").start()
        self.err_reader = threading.Thread(target=self._read_stderr, daemon=True, name="verifiers-worker-err")
        self.err_reader.start()
        try:
            self.harness, self.rows = self.ready.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            self.close(polite=False)
            raise WorkerError(f"verifiers worker: no dataset listed within {timeout_s:g}s of starting "
                              f"({' '.join(self.argv)}){self._tail()}") from None
        except WorkerError:
            self.close()
            raise
        return self

    def _tail(self) -> str:
        return ("; its stderr ends:\n" + "".join(self.stderr_tail)[-3000:]) if self.stderr_tail else ""

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr_tail.append(line)

    def _read_stdout(self) -> None:
        for raw in self.proc.stdout:
            try:
                line = json.loads(raw)
            except ValueError:
                self._die(f"verifiers worker: malformed reply: a line that is not JSON: {raw[:200]!r}")
                return
            if not self.ready.done():
                try:
                    self.ready.set_result(check_ready(line))
                except WorkerError as exc:
                    self.ready.set_exception(exc)
                    return
                continue
            request_id = line.get("id") if isinstance(line, dict) else None
            with self.lock:
                future = self.pending.pop(request_id, None) if isinstance(request_id, int) else None
                late = future is None and request_id in self.abandoned
                self.abandoned.discard(request_id)
            if late:
                continue
            if future is None:
                self._die(f"verifiers worker: malformed reply: it answers no pending request: {raw[:200]!r}")
                return
            if line.get("type") == "error":
                future.set_exception(WorkerError(f"verifiers worker: {line.get('error')}"))
                continue
            try:
                future.set_result(check_result(line))
            except WorkerError as exc:
                future.set_exception(exc)
        try:
            rc = self.proc.wait(timeout=CLOSE_TIMEOUT_S)  # its stdout is closed: it has exited or is about to
        except subprocess.TimeoutExpired:
            rc = "unknown: it closed its stdout and did not exit; killed"
        self.err_reader.join(timeout=CLOSE_TIMEOUT_S)  # the stderr tail says why
        self._die(f"verifiers worker exited (rc {rc})")

    def _die(self, why: str) -> None:
        """Fail everything waiting: after a malformed line the stream cannot be trusted to pair answers."""
        with self.lock:
            self.dead = self.dead or why
            pending, self.pending = self.pending, {}
        error = WorkerError(f"{why}{self._tail()}")
        if not self.ready.done():
            self.ready.set_exception(error)
        for future in pending.values():
            future.set_exception(error)
        if self.proc.poll() is None:
            self.proc.kill()

    def run(self, task: int, base_url: str, timeout_s: float) -> EpisodeResult:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            if self.dead:
                raise WorkerError(f"{self.dead}{self._tail()}")
            request_id = next(self.ids)
            self.pending[request_id] = future
            try:
                self.proc.stdin.write(json.dumps({"id": request_id, "op": "run", "task": task, "base_url": base_url,
                                                  "timeout_s": timeout_s}) + "\n")
                self.proc.stdin.flush()
            except OSError as exc:
                self.pending.pop(request_id, None)
                raise WorkerError(f"verifiers worker: cannot send a request ({exc}){self._tail()}") from exc
        try:
            return future.result(timeout=timeout_s + ANSWER_MARGIN_S)
        except concurrent.futures.TimeoutError:
            with self.lock:
                if self.pending.pop(request_id, None) is not None:
                    self.abandoned.add(request_id)
            raise WorkerError(f"verifiers worker: no answer for task {task} within {timeout_s + ANSWER_MARGIN_S:g}s "
                              f"(task.agent_timeout_s)") from None

    def close(self, polite: bool = True) -> None:
        """Ask it to cancel its episodes and exit (`polite`), else (or when it does not within CLOSE_TIMEOUT_S) kill."""
        with self.lock:
            self.dead = self.dead or "verifiers worker: closed"
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            if not polite:
                raise OSError("killed")
            with self.lock:
                self.proc.stdin.write('{"op": "close"}\n')
                self.proc.stdin.close()
            self.proc.wait(timeout=CLOSE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=CLOSE_TIMEOUT_S)


def worker_argv(python: Path, env_id: str, max_concurrent: int) -> list[str]:
    return [str(python), str(WORKER_FILE), "--env", env_id, "--max-concurrent", str(max_concurrent)]


def worker_environ(python: Path) -> dict:
    """megarl's environment, the verifiers env's bin first on PATH (its uv runs the harness's program)."""
    return dict(os.environ, PATH=f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1")


# ---- the prompt source and the agent function ------------------------------------------------------------------
_WORKERS: dict[str, Worker] = {}  # env id -> its worker, for run_episode (the agent function) in this process
_TIMEOUTS: dict[str, float] = {}
_START_LOCK = threading.Lock()


def register(env_id: str, worker: Worker, timeout_s: float) -> None:
    _WORKERS[env_id], _TIMEOUTS[env_id] = worker, timeout_s


class VerifiersTask:
    """The prompt source of task.env=verifiers:<id>: every row of the environment's dataset, drawn uniformly. The
    reward is the environment's (run_episode returns it), so `reward` is never called."""

    def __init__(self, env: str = "", env_workers: int = 4, agent_timeout_s: float = 300.0, worker: Worker | None = None,
                 **_ignored):
        self.env_id = env_id_of(env)
        with _START_LOCK:
            if worker is None and self.env_id in _WORKERS and not _WORKERS[self.env_id].dead:
                worker = _WORKERS[self.env_id]
            if worker is None:
                from megarl.rollout.verifiers_env import ensure_env

                python, _ = ensure_env()
                worker = Worker(worker_argv(python, self.env_id, env_workers), worker_environ(python)).start()
                atexit.register(worker.close)
            register(self.env_id, worker, agent_timeout_s)
        self.worker = worker
        self.prompts = [self._prompt(row) for row in worker.rows]

    def _prompt(self, row: TaskRow) -> Prompt:
        text = "\n\n".join(m["content"] for m in row.prompt if isinstance(m.get("content"), str))
        return Prompt(text, row.answer or "", {**row.info, META_ENV: self.env_id, META_TASK: row.index,
                                              "data_source": f"{SCHEME}:{self.env_id}"})

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        return [rng.choice(self.prompts) for _ in range(n)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        raise RuntimeError("a verifiers environment scores whole episodes (run_episode); no completion reward")


def run_episode(base_url: str, prompt: str, answer: str, meta: dict) -> float:
    """The agent function (task.agent contract) of a verifiers episode: the worker runs the row's episode against
    base_url; its reward, or WorkerError (the episode fails, counted) when the environment reported errors."""
    env_id = meta[META_ENV]
    worker = _WORKERS.get(env_id)
    if worker is None:
        raise WorkerError(f"no verifiers worker for {env_id!r} in this process (VerifiersTask starts it)")
    result = worker.run(meta[META_TASK], base_url, _TIMEOUTS[env_id])
    if not result.ok:
        raise WorkerError(f"verifiers environment {env_id}: episode failed: {'; '.join(result.errors)[:1500]}")
    return result.reward


def agent_for(tc) -> str:
    """The agent function of the run's episodes: task.agent, or the adapter's with task.env."""
    return tc.agent or (AGENT if tc.env else "")


def task_for(tc):
    """The run's prompt source (tc: the TaskConfig): with task.env the environment's dataset (its worker started),
    else the task task.name names (megarl/rollout/tasks.py)."""
    if tc.env:
        return VerifiersTask(tc.env, env_workers=tc.env_workers, agent_timeout_s=tc.agent_timeout_s)
    return task_from_config(tc)


if __name__ == "__main__":  # pragma: no cover - a quick manual look at an environment's dataset
    task = VerifiersTask(sys.argv[1])
    print(json.dumps([p.__dict__ for p in task.prompts[:5]], indent=1, default=str))
    task.worker.close()
