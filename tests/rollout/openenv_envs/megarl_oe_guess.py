"""A small OpenEnv environment written as OpenEnv documents one (an Environment, its Action and Observation models,
`create_app`), served by `uvicorn megarl_oe_guess:app`: guess a secret number in 1..9 (drawn from the reset's seed);
each guess is answered "higher", "lower" or "correct"; a correct guess ends the episode with reward 1.

It runs without network or Docker; tests/rollout/test_openenv_real.py trains on it (task.env=openenv:megarl_oe_guess:app,
with this folder on PYTHONPATH) and docs/multiturn.md shows it as the worked example.
"""
import random
import re
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

LOW, HIGH = 1, 9


class GuessAction(Action):
    message: str  # the model's reply; its first integer is the guess


class GuessObservation(Observation):
    text: str


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # every WebSocket session has its own instance

    def __init__(self):
        super().__init__()
        self.secret, self._state = LOW, State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.secret = random.Random(seed).randint(LOW, HIGH)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GuessObservation(text=f"I picked a number from {LOW} to {HIGH}. Guess it: reply with one number.",
                                done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        found = re.search(r"-?\d+", action.message)
        if found is None:
            return GuessObservation(text="That is not a number. Reply with one number.", done=False, reward=0.0)
        guess = int(found.group())
        if guess == self.secret:
            return GuessObservation(text="correct", done=True, reward=1.0)
        return GuessObservation(text="higher" if guess < self.secret else "lower", done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="megarl_oe_guess", max_concurrent_envs=8)
