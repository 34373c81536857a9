"""Which prompt source and agent function a run uses: task.env picks an environment adapter by its scheme
(verifiers: megarl/rollout/verifiers_adapter.py, openenv: megarl/rollout/openenv_adapter.py); without it,
task.agent and the task task.name names (megarl/rollout/tasks.py)."""
from __future__ import annotations

from megarl.rollout import openenv_adapter, verifiers_adapter
from megarl.rollout.tasks import task_from_config

ADAPTERS = {verifiers_adapter.SCHEME: verifiers_adapter, openenv_adapter.SCHEME: openenv_adapter}


def adapter_of(env: str):
    """The adapter module of task.env; ValueError naming task.env and the schemes otherwise."""
    scheme = env.partition(":")[0]
    if scheme not in ADAPTERS:
        raise ValueError(f"task.env={env!r}: unknown environment scheme {scheme!r}; supported: "
                         f"{', '.join(f'{s}:<...>' for s in ADAPTERS)}")
    return ADAPTERS[scheme]


def agent_for(tc) -> str:
    """The agent function of the run's episodes: task.agent, or the adapter's with task.env."""
    return tc.agent or (adapter_of(tc.env).AGENT if tc.env else "")


def task_for(tc):
    """The run's prompt source (tc: the TaskConfig): with task.env the environment's tasks (its worker started),
    else the task task.name names."""
    if not tc.env:
        return task_from_config(tc)
    if adapter_of(tc.env) is openenv_adapter:
        return openenv_adapter.OpenEnvTask(tc.env, env_tasks=tc.env_tasks, max_turns=tc.max_turns,
                                           env_workers=tc.env_workers, agent_timeout_s=tc.agent_timeout_s)
    return verifiers_adapter.VerifiersTask(tc.env, env_workers=tc.env_workers, agent_timeout_s=tc.agent_timeout_s)
