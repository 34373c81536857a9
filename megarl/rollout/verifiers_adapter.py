"""`task.env=verifiers:<id>`: a `verifiers` environment (its dataset, its multi-turn protocol, its rewards) trained on
megarl's samplers, unchanged, through the agent endpoint.

verifiers cannot live in megarl's environment (it pins openai<3), so it runs in its own (megarl/rollout/
verifiers_env.py) as a worker process (megarl/rollout/verifiers_worker.py) spoken to over JSON lines on its stdin and
stdout. `VerifiersTask` is the prompt source: it starts the worker, which loads the environment and lists its
dataset; every task row becomes a prompt. Each episode is an agent call (megarl/rollout/agent.py, the AgentRunner
machinery unchanged): `run_episode` asks the worker to run the row's episode against the episode's base_url, so
every model turn the environment's harness asks for is a request on megarl's endpoint (sampled tokens, versions and
log-probs as any rollout), and returns the environment's reward (the sum of its weighted rewards).

The worker is a process outside megarl, spoken to by megarl/rollout/env_worker.py: every line it writes is validated
and a malformed one fails what waited on it with a message naming the field; every wait has a timeout
(WORKER_START_TIMEOUT_S for loading, task.agent_timeout_s per episode); a worker that exits fails the episodes in
flight with its exit code and the tail of its stderr. Refused before launch, by name (megarl/config/load.py): another
scheme than `verifiers:`, an empty id, and with it task.agent, task.reward_fn, task.path or eval.sets.
"""
from __future__ import annotations

import atexit
import json
import os
import random
import sys
import threading
from pathlib import Path

from megarl.protocols import Prompt
from megarl.rollout.env_worker import (ANSWER_MARGIN_S, CLOSE_TIMEOUT_S, WORKER_START_TIMEOUT_S,  # noqa: F401
                                       EpisodeResult, TaskRow, Worker, WorkerError, check_ready, check_result)
from megarl.rollout.tasks import task_from_config

SCHEME = "verifiers"
AGENT = "megarl.rollout.verifiers_adapter:run_episode"  # the agent function every verifiers episode is
WORKER_FILE = Path(__file__).with_name("verifiers_worker.py")
META_ENV, META_TASK = "verifiers_env", "verifiers_task"  # the prompt meta keys naming the worker and the row


def env_id_of(spec: str) -> str:
    """The verifiers environment id of task.env=verifiers:<id>; ValueError naming task.env otherwise."""
    scheme, sep, env_id = spec.partition(":")
    if not sep or scheme != SCHEME:
        raise ValueError(f"task.env={spec!r}: only verifiers environments are supported (task.env=verifiers:<id>, "
                         f"the id of an installed verifiers environment package or a module on PYTHONPATH)")
    if not env_id.strip() or any(c.isspace() for c in env_id):
        raise ValueError(f"task.env={spec!r}: the environment id after 'verifiers:' must be non-empty, without spaces")
    return env_id


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
