"""The prompt source and agent function shared by the environment adapters whose episodes run in a worker process
(megarl/rollout/env_worker.py): verifiers_adapter.py, openenv_adapter.py.

A `WorkerTask` starts its adapter's worker (one per environment per process, reused by every task built for it),
turns each task row the worker listed into a prompt (meta names the worker and the row), and draws them uniformly.
Its reward is the environment's: `run_worker_episode` (called by the adapter's agent function) asks the worker to
run the row's episode against the episode's base_url and returns the episode's reward, or raises WorkerError (the
episode fails, counted) when the environment reported errors.
"""
from __future__ import annotations

import atexit
import random
import threading

from megarl.protocols import Prompt
from megarl.rollout.env_worker import TaskRow, Worker, WorkerError
from megarl.rollout.rewards import Scored

_WORKERS: dict[tuple[str, str], Worker] = {}  # (scheme, env id) -> its worker, for the agent functions in this process
_TIMEOUTS: dict[tuple[str, str], float] = {}
_START_LOCK = threading.Lock()


class WorkerTask:
    """An environment's task rows as prompts. Subclasses set `scheme`, `label`, `meta_env`, `meta_task` and define
    `env_id_of(spec)` and `start_worker(env_workers)`."""

    scheme = label = meta_env = meta_task = ""

    def __init__(self, env: str = "", env_workers: int = 4, agent_timeout_s: float = 300.0,
                 worker: Worker | None = None, **_ignored):
        self.env_id = self.env_id_of(env)
        key = (self.scheme, self.env_id)
        with _START_LOCK:
            if worker is None and key in _WORKERS and not _WORKERS[key].dead:
                worker = _WORKERS[key]
            if worker is None:
                worker = self.start_worker(env_workers)
                atexit.register(worker.close)
            _WORKERS[key], _TIMEOUTS[key] = worker, agent_timeout_s
        self.worker = worker
        self.prompts = [self._prompt(row) for row in worker.rows]

    def env_id_of(self, spec: str) -> str:
        raise NotImplementedError

    def start_worker(self, env_workers: int) -> Worker:
        raise NotImplementedError

    def _prompt(self, row: TaskRow) -> Prompt:
        text = "\n\n".join(m["content"] for m in row.prompt if isinstance(m.get("content"), str))
        return Prompt(text, row.answer or "", {**row.info, self.meta_env: self.env_id, self.meta_task: row.index,
                                              "data_source": f"{self.scheme}:{self.env_id}"})

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        return [rng.choice(self.prompts) for _ in range(n)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        raise RuntimeError(f"a {self.scheme} environment scores whole episodes (its agent function); no completion "
                           f"reward")


def run_worker_episode(scheme: str, env_id: str, task: int, base_url: str) -> Scored:
    """Run task row `task` of the environment's worker against base_url: its reward with the parts the environment
    scored (name -> {"score", "weight"} or None), or WorkerError."""
    worker = _WORKERS.get((scheme, env_id))
    if worker is None:
        raise WorkerError(f"no {scheme} worker for {env_id!r} in this process (its task starts it)")
    result = worker.run(task, base_url, _TIMEOUTS[(scheme, env_id)])
    if not result.ok:
        raise WorkerError(f"{scheme} environment {env_id}: episode failed: {'; '.join(result.errors)[:1500]}")
    return Scored(result.reward, result.rewards)
