"""`task.env=openenv:<module>:<app>`: an OpenEnv environment (its reset/step server, started locally as OpenEnv
documents a run without Docker) trained on megarl's samplers through the agent endpoint.

`openenv` pulls gradio, whose pins fight megarl's, so it runs in its own environment (megarl/rollout/openenv_env.py)
as a worker process (megarl/rollout/openenv_worker.py, protocol of megarl/rollout/env_worker.py) that starts the
environment's server (`uvicorn <module>:<app>` on a free local port) and drives its episodes. `OpenEnvTask` is the
prompt source: every task is a reset seed (0..task.env_tasks-1), listed with its first observation. Each episode is
an agent call (megarl/rollout/agent.py): `run_episode` asks the worker to run it against the episode's base_url, so
the environment's observations are user messages (environment tokens, version -1) and the model's replies, the
actions, are requests on megarl's endpoint (sampled tokens with their versions and log-probs); the episode's reward
is the sum of the environment's step rewards. An episode ends when the environment says done, after task.max_turns
model turns, or at the endpoint's limits.

Refused before launch, by name (megarl/config/load.py): a spec that is not `openenv:<module>:<attr>`, and with it
task.agent, task.reward_fn, task.path or eval.sets; refused when the worker starts (before any episode): an action
schema other than exactly one required string field.
"""
from __future__ import annotations

import os
from pathlib import Path

from megarl.rollout.env_worker import Worker
from megarl.rollout.worker_task import WorkerTask, run_worker_episode

SCHEME = "openenv"
AGENT = "megarl.rollout.openenv_adapter:run_episode"  # the agent function every OpenEnv episode is
WORKER_FILE = Path(__file__).with_name("openenv_worker.py")
META_ENV, META_TASK = "openenv_env", "openenv_task"  # the prompt meta keys naming the worker and the seed


def env_id_of(spec: str) -> str:
    """The server app `<module>:<attr>` of task.env=openenv:<module>:<attr>; ValueError naming task.env otherwise."""
    scheme, sep, app = spec.partition(":")
    module, colon, attr = app.partition(":")
    if (scheme != SCHEME or not sep or not colon or not all(p.isidentifier() for p in module.split("."))
            or not all(p.isidentifier() for p in attr.split("."))):
        raise ValueError(f"task.env={spec!r}: an OpenEnv environment is named by its server app as "
                         f"task.env=openenv:<module>:<attr> (what `uvicorn <module>:<attr>` serves, e.g. "
                         f"openenv:echo_env.server.app:app), importable in the OpenEnv environment or on PYTHONPATH")
    return app


def worker_argv(python: Path, app: str, n_tasks: int, max_turns: int, max_concurrent: int) -> list[str]:
    return [str(python), str(WORKER_FILE), "--app", app, "--tasks", str(n_tasks), "--max-turns", str(max_turns),
            "--max-concurrent", str(max_concurrent)]


class OpenEnvTask(WorkerTask):
    """The prompt source of task.env=openenv:<module>:<attr>: its reset seeds, drawn uniformly; the reward is the
    environment's (run_episode returns it)."""

    scheme, label, meta_env, meta_task = SCHEME, "openenv worker", META_ENV, META_TASK

    def __init__(self, env: str = "", env_tasks: int = 64, max_turns: int = 4, **kwargs):
        self.n_tasks, self.max_turns = env_tasks, max_turns
        super().__init__(env, **kwargs)

    def env_id_of(self, spec: str) -> str:
        return env_id_of(spec)

    def start_worker(self, env_workers: int) -> Worker:
        from megarl.rollout.openenv_env import ensure_env

        python, _ = ensure_env()
        environ = dict(os.environ, PYTHONUNBUFFERED="1")
        return Worker(worker_argv(python, self.env_id, self.n_tasks, self.max_turns, env_workers), environ,
                      self.label).start()


def run_episode(base_url: str, prompt: str, answer: str, meta: dict) -> float:
    """The agent function (task.agent contract) of an OpenEnv episode: the worker runs it against base_url; the sum
    of its step rewards, or WorkerError (the episode fails, counted)."""
    return run_worker_episode(SCHEME, meta[META_ENV], meta[META_TASK], base_url)
