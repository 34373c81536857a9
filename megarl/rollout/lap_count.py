"""The lap-count task: long, long-tailed completions whose length the prompt sets.

`LapCountTask` ("lap_count") is CountTask (megarl/rollout/tasks.py) stretched over laps of its alphabet, so a
completion runs to hundreds of tokens while every step of it stays a rule a 2-layer model can learn: the next
letter of the alphabet, a lap digit one lower than the last after "Z", and a stop at the prompt's letter in lap 0.
The prompt fixes the length and the reward is exact match, so RL cannot shorten the tail (configs/long.yaml).

It lives in its own module so that the task registry (tasks.py `_TASKS`) names it lazily and tasks.py, which every
embedded model's builder imports, stays as it is.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from megarl.protocols import Prompt
from megarl.rollout.tasks import COUNT_ALPHABET, EOS_TEXT

# A lap count is one digit: the model decrements it after every "Z" (a two-digit count would need a carry).
MAX_LAPS = 9


def lap_count_answer(laps: int, end: int) -> str:
    """The completion of prompt (laps, end), EOS not included: for lap = laps .. 0, the lap digit and then the
    whole alphabet, the last lap stopping at letter `end` (its index in COUNT_ALPHABET)."""
    full = "".join(f"{lap}{COUNT_ALPHABET}" for lap in range(laps, 0, -1))
    return full + "0" + COUNT_ALPHABET[:end + 1]


def completion_tokens(laps: int, end: int) -> int:
    """Tokens in the completion of (laps, end), EOS included (one byte is one token of the embedded tokenizer)."""
    return laps * (1 + len(COUNT_ALPHABET)) + 1 + end + 1 + 1


@dataclass(frozen=True)
class LapCountTask:
    """`3k=` -> `3a..Z2a..Z1a..Z0abcdefghijk`: `laps` full laps of COUNT_ALPHABET, each led by the number of laps
    still to come, then lap 0 from "a" to the prompt's letter.

    Laps are long-tailed: P(laps = k) is proportional to (1 - q)^k q for k in 0..max_laps (q = 1 / (1 + lap_mean);
    longer draws are redrawn); the end letter is uniform. With the defaults (mean 1.5, at most 9 laps) a
    completion has ~110 tokens on average and up to 533 (EOS included), p99 / mean ~4.
    """

    lap_mean: float = 1.5
    max_laps: int = MAX_LAPS

    def __post_init__(self) -> None:
        object.__setattr__(self, "lap_mean", float(self.lap_mean))
        if not 0 <= self.max_laps <= MAX_LAPS:
            raise ValueError(f"LapCountTask needs 0 <= max_laps <= {MAX_LAPS} (task.max_laps), got {self.max_laps}")
        if not self.lap_mean >= 0.0:  # also rejects NaN
            raise ValueError(f"LapCountTask needs lap_mean >= 0 (task.lap_mean), got {self.lap_mean}")

    def make_prompt(self, laps: int, end: int) -> Prompt:
        return Prompt(text=f"{laps}{COUNT_ALPHABET[end]}=", answer=lap_count_answer(laps, end),
                      meta={"laps": laps, "end": end})

    def sample_laps(self, rng: random.Random) -> int:
        go_on = self.lap_mean / (1.0 + self.lap_mean)
        while True:
            k = 0
            while rng.random() < go_on:
                k += 1
            if k <= self.max_laps:
                return k

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        # Laps first, then the letter: a seeded rng gives the same prompts everywhere.
        return [self.make_prompt(self.sample_laps(rng), rng.randrange(len(COUNT_ALPHABET))) for _ in range(n)]

    def max_completion_tokens(self) -> int:
        """The longest completion, EOS included: what sampling.max_new_tokens must allow."""
        return completion_tokens(self.max_laps, len(COUNT_ALPHABET) - 1)

    def near_miss(self, prompt: Prompt, rng: random.Random, max_offset: int) -> str:
        """The answer with lap 0 stopped 1..max_offset letters early or late (never empty): a plausible wrong
        completion, as CountTask.near_miss."""
        end = prompt.meta["end"]
        offsets = [d for d in range(-max_offset, max_offset + 1) if d and 0 <= end + d < len(COUNT_ALPHABET)]
        return lap_count_answer(prompt.meta["laps"], end + rng.choice(offsets))

    def reward(self, prompt: Prompt, completion: str) -> float:
        text = completion.strip()
        if text.endswith(EOS_TEXT):
            text = text[: -len(EOS_TEXT)].strip()
        return 1.0 if text == prompt.answer else 0.0
