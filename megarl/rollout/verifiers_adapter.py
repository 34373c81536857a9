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

import json
import os
import sys
from pathlib import Path

from megarl.rollout.env_worker import (ANSWER_MARGIN_S, CLOSE_TIMEOUT_S, WORKER_START_TIMEOUT_S,  # noqa: F401
                                       EpisodeResult, TaskRow, Worker, WorkerError, check_ready, check_result)
from megarl.rollout.worker_task import WorkerTask, run_worker_episode

SCHEME = "verifiers"
AGENT = "megarl.rollout.verifiers_adapter:run_episode"  # the agent function every verifiers episode is
WORKER_FILE = Path(__file__).with_name("verifiers_worker.py")
META_ENV, META_TASK = "verifiers_env", "verifiers_task"  # the prompt meta keys naming the worker and the row


def env_id_of(spec: str) -> str:
    """The verifiers environment id of task.env=verifiers:<id>; ValueError naming task.env otherwise."""
    scheme, sep, env_id = spec.partition(":")
    if not sep or scheme != SCHEME:
        raise ValueError(f"task.env={spec!r}: a verifiers environment is named task.env=verifiers:<id> ("
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
class VerifiersTask(WorkerTask):
    """The prompt source of task.env=verifiers:<id>: every row of the environment's dataset, drawn uniformly. The
    reward is the environment's (run_episode returns it), so `reward` is never called."""

    scheme, label, meta_env, meta_task = SCHEME, "verifiers worker", META_ENV, META_TASK

    def env_id_of(self, spec: str) -> str:
        return env_id_of(spec)

    def start_worker(self, env_workers: int) -> Worker:
        from megarl.rollout.verifiers_env import ensure_env

        python, _ = ensure_env()
        return Worker(worker_argv(python, self.env_id, env_workers), worker_environ(python), self.label).start()


def run_episode(base_url: str, prompt: str, answer: str, meta: dict) -> float:
    """The agent function (task.agent contract) of a verifiers episode: the worker runs the row's episode against
    base_url; its reward, or WorkerError (the episode fails, counted) when the environment reported errors."""
    return run_worker_episode(SCHEME, meta[META_ENV], meta[META_TASK], base_url)


if __name__ == "__main__":  # pragma: no cover - a quick manual look at an environment's dataset
    task = VerifiersTask(sys.argv[1])
    print(json.dumps([p.__dict__ for p in task.prompts[:5]], indent=1, default=str))
    task.worker.close()
