"""The client side of an environment worker: a process in an environment of its own (verifiers', OpenEnv's) that
lists its tasks and runs episodes against megarl's agent endpoint, spoken to over JSON lines on its stdin and stdout.

Protocol (megarl/rollout/verifiers_worker.py and openenv_worker.py speak it):

    out  {"type": "ready", "env": ID, "harness": str, "tasks": [{"index": i, "prompt": [messages],
          "answer": str | null, "info": {...}}, ...]}                               once, first
    in   {"id": N, "op": "run", "task": i, "base_url": URL, "timeout_s": S}         one episode
    out  {"type": "result", "id": N, "ok": bool, "reward": float, "rewards": {name: {"score", "weight"}},
          "metrics": {...}, "messages": [...], "turns": int, "errors": [str]}        when it ended
    out  {"type": "error", "id": N | null, "error": str}                           a request it cannot run
    in   {"op": "close"}  (or end of input)                                         cancel what runs, exit 0

The worker is a process outside megarl: every line it writes is validated (`check_ready`, `check_result`) and a
malformed one fails what waited on it with a message naming the field; every wait has a timeout; a worker that exits
fails the episodes in flight with its exit code and the tail of its stderr. `label` ("verifiers worker") names the
worker in every message.
"""
from __future__ import annotations

import collections
import concurrent.futures
import itertools
import json
import math
import subprocess
import threading
from dataclasses import dataclass, field

WORKER_START_TIMEOUT_S = 300.0  # importing the stack and loading the environment's tasks on a loaded machine
CLOSE_TIMEOUT_S = 30.0
ANSWER_MARGIN_S = 30.0  # the worker bounds each episode by its timeout_s itself; this is for the answer to arrive


class WorkerError(RuntimeError):
    """An environment worker failed, answered a malformed line, or did not answer in time."""


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


class _Malformed(ValueError):
    """What is wrong with a worker's line (check_ready/check_result name the worker around it)."""


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise _Malformed(what)


def check_ready(line: dict, label: str = "verifiers worker") -> tuple[str, list[TaskRow]]:
    """(the harness, the dataset's rows) of the worker's first line; WorkerError naming what is wrong."""
    try:
        return _check_ready(line, label)
    except _Malformed as exc:
        raise WorkerError(f"{label}: malformed reply: {exc}") from None


def _check_ready(line: dict, label: str) -> tuple[str, list[TaskRow]]:
    _need(isinstance(line, dict), "a reply is a JSON object")
    if line.get("type") == "error":
        raise WorkerError(f"{label} failed to start: {line.get('error')}")
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


def check_result(line: dict, label: str = "verifiers worker") -> EpisodeResult:
    """The episode result of a worker's `result` line; WorkerError naming the bad field."""
    try:
        return _check_result(line)
    except _Malformed as exc:
        raise WorkerError(f"{label}: malformed reply: {exc}") from None


def _check_result(line: dict) -> EpisodeResult:
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


def label_thread(label: str) -> str:
    return label.replace(" ", "-")


# ---- the worker process ------------------------------------------------------------------------------------------
class Worker:
    """One worker process: `start()` reads its dataset, `run(task, base_url, timeout_s)` runs one episode (any
    thread; several at once), `close()` ends it."""

    def __init__(self, argv: list[str], env: dict | None = None, label: str = "verifiers worker"):
        self.argv, self.env, self.label = argv, env, label
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
        threading.Thread(target=self._read_stdout, daemon=True, name=f"{label_thread(self.label)}-out").start()
        self.err_reader = threading.Thread(target=self._read_stderr, daemon=True, name=f"{label_thread(self.label)}-err")
        self.err_reader.start()
        try:
            self.harness, self.rows = self.ready.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            self.close(polite=False)
            raise WorkerError(f"{self.label}: no dataset listed within {timeout_s:g}s of starting "
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
                self._die(f"{self.label}: malformed reply: a line that is not JSON: {raw[:200]!r}")
                return
            if not self.ready.done():
                try:
                    self.ready.set_result(check_ready(line, self.label))
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
                self._die(f"{self.label}: malformed reply: it answers no pending request: {raw[:200]!r}")
                return
            if line.get("type") == "error":
                future.set_exception(WorkerError(f"{self.label}: {line.get('error')}"))
                continue
            try:
                future.set_result(check_result(line, self.label))
            except WorkerError as exc:
                future.set_exception(exc)
        try:
            rc = self.proc.wait(timeout=CLOSE_TIMEOUT_S)  # its stdout is closed: it has exited or is about to
        except subprocess.TimeoutExpired:
            rc = "unknown: it closed its stdout and did not exit; killed"
        self.err_reader.join(timeout=CLOSE_TIMEOUT_S)  # the stderr tail says why
        self._die(f"{self.label} exited (rc {rc})")

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
                raise WorkerError(f"{self.label}: cannot send a request ({exc}){self._tail()}") from exc
        try:
            return future.result(timeout=timeout_s + ANSWER_MARGIN_S)
        except concurrent.futures.TimeoutError:
            with self.lock:
                if self.pending.pop(request_id, None) is not None:
                    self.abandoned.add(request_id)
            raise WorkerError(f"{self.label}: no answer for task {task} within {timeout_s + ANSWER_MARGIN_S:g}s "
                              f"(task.agent_timeout_s)") from None

    def close(self, polite: bool = True) -> None:
        """Ask it to cancel its episodes and exit (`polite`), else (or when it does not within CLOSE_TIMEOUT_S) kill."""
        with self.lock:
            self.dead = self.dead or f"{self.label}: closed"
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
