"""The held-out split of a task's prompts: which prompts a run may train on and which it evaluates on.

A prompt is held out when the SHA-256 of its text falls in the first `fraction` of the hash range: a pure
function of the text, the same in every process and in `megarl eval`, for every task (the built-in
generators and task.name=jsonl datasets alike), with no list of prompts to store. A run with a set drawn
from its training task (eval.sets[i].path empty) trains only on the other prompts (`TrainingSplit`,
what the sampler draws from; `training_split` keeps a multi-turn task's episodes) and evaluates only on
held-out ones (`draw_heldout`), so no eval prompt is ever a training prompt. Both draw from the task's
own distribution and keep what falls on their side, so each side's prompts follow the task's
distribution restricted to that side.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable

from megarl.protocols import Prompt, Task
from megarl.rollout.environment import is_multi_turn

MAX_DRAWS = 10_000  # draws in a row that may fall on the other side before the task is called too small


def is_heldout(text: str, fraction: float) -> bool:
    """Whether the prompt text `text` is in the held-out `fraction` of the task's prompts."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2 ** 64


def draw(task: Task, rng: random.Random, n: int, keep: Callable[[Prompt], bool], side: str) -> list[Prompt]:
    """n prompts of `task` drawn with `rng`, keeping those `keep` accepts; ValueError when MAX_DRAWS draws in a
    row were all refused (a prompt space with (almost) nothing on that side)."""
    prompts = []
    while len(prompts) < n:
        for _ in range(MAX_DRAWS):
            prompt = task.sample_prompts(rng, 1)[0]
            if keep(prompt):
                prompts.append(prompt)
                break
        else:
            raise ValueError(f"{MAX_DRAWS} prompts drawn in a row, none of them a {side} prompt: the task has too few "
                             f"distinct prompts for eval.heldout_fraction; change it, give the eval set prompts of its "
                             f"own (eval.sets[].path) or evaluate nothing (eval.sets=[]) (docs/eval.md)")
    return prompts


def draw_heldout(task: Task, rng: random.Random, n: int, fraction: float) -> list[Prompt]:
    return draw(task, rng, n, lambda p: is_heldout(p.text, fraction), "held-out")


@dataclass(frozen=True)
class TrainingSplit:
    """`task` without its held-out prompts: what a run that evaluates on them trains on."""

    task: Task
    fraction: float

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        return draw(self.task, rng, n, lambda p: not is_heldout(p.text, self.fraction), "training")

    def reward(self, prompt: Prompt, completion: str) -> float:
        return self.task.reward(prompt, completion)


@dataclass(frozen=True)
class MultiTurnTrainingSplit(TrainingSplit):
    """The training side of a multi-turn task: its episodes open and step as the task's do."""

    def opening_messages(self, prompt: Prompt) -> list[dict]:
        return self.task.opening_messages(prompt)

    def environment(self, prompt: Prompt):
        return self.task.environment(prompt)


def training_split(task: Task, fraction: float) -> TrainingSplit:
    """`task` without its held-out prompts, multi-turn when `task` is."""
    return (MultiTurnTrainingSplit if is_multi_turn(task) else TrainingSplit)(task, fraction)
