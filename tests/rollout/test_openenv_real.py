"""task.env=openenv:<module>:<attr> against the real `openenv` 0.10.0 package, run from its own environment
(megarl/rollout/openenv_env.py, built on first use): the number-guessing environment of
tests/rollout/openenv_envs/megarl_oe_guess.py, written as OpenEnv documents one, is started locally (`uvicorn`,
no Docker), lists its reset observations as megarl's prompts, and runs episodes through the agent endpoint: its
observations are environment tokens (version -1), the model's guesses sampled tokens with their versions, its
rewards the episodes' rewards. The engine is scripted (tests/rollout/test_agent.py), so every token is known."""
import os
import random
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.openenv
ENVS = Path(__file__).with_name("openenv_envs")
SPEC = "openenv:megarl_oe_guess:app"


@pytest.fixture
def env_on_path(monkeypatch):
    """The environment importable by the worker and its server (they inherit megarl's PYTHONPATH)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(ENVS)]))


@pytest.mark.timeout(1800)  # the env's first build: minutes on 2 loaded cores
def test_episodes_of_a_local_openenv_environment_are_trained_token_by_token(env_on_path):
    from megarl.embedded.tiny_chat import build_chat_tokenizer
    from megarl.rollout.openenv_adapter import AGENT, OpenEnvTask
    from tests.rollout.test_agent import ScriptedLoop

    tok = build_chat_tokenizer()
    task = OpenEnvTask(SPEC, env_tasks=8, max_turns=3, agent_timeout_s=120.0)
    assert len(task.prompts) == 8 and task.prompts[0].text.startswith("I picked a number from 1 to 9")
    secrets = [random.Random(seed).randint(1, 9) for seed in range(8)]  # as the environment draws them
    found_at_once, found_third, missed = (task.prompts[secrets.index(s)] for s in (1, 3, 5))

    def model(text: str) -> str:  # counting up: the guess after k "higher" answers is k + 1
        return str(text.count("higher") + 1)

    loop = ScriptedLoop(tok, AGENT, model, max_turns=3, timeout_s=120.0, max_seq_len=1024, max_new_tokens=8)
    try:
        episodes = sorted(loop.run([found_at_once, found_third, missed], deadline_s=300.0), key=lambda e: e.key)
    finally:
        task.worker.close()
    assert [(e.error, e.reward, e.turns) for e in episodes] == [(None, 1.0, 1), (None, 1.0, 3), (None, 0.0, 3)]
    for episode, prompt in zip(episodes, (found_at_once, found_third, missed)):
        assert len(episode.env_spans) == episode.turns - 1  # each observation after the first: environment tokens
        model_at = [i for i, v in enumerate(episode.versions) if v >= 0]
        for start, end in episode.env_spans:
            assert set(episode.versions[start:end]) == {-1}
            assert tok.decode(episode.token_ids[start:end]).count("higher") == 1
        assert len(model_at) + sum(end - start for start, end in episode.env_spans) == len(episode.token_ids)
        guesses = [tok.decode(episode.token_ids[i:j]) for i, j in _runs(model_at)]
        assert [g.replace("<|im_end|>", "").strip() for g in guesses] == [str(k + 1) for k in range(episode.turns)]


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive positions as [start, end) spans."""
    runs = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return [tuple(r) for r in runs]
