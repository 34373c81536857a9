"""Built-in synthetic tasks: prompt sources with a verifiable reward, and the name -> task registry.

A task implements `megarl.protocols.Task`: `sample_prompts(rng, n)` draws prompts and
`reward(prompt, completion)` scores one completion text. The built-in `ArithmeticTask`
("12+7=" -> "19") is what the embedded default model is warm-started on and what the CPU demo
trains with RL; it needs no data files, so a fresh machine can run end to end.
"""
from __future__ import annotations

import operator
import random
from dataclasses import dataclass
from typing import Callable

from megarl.protocols import Prompt

EOS_TEXT = "<|endoftext|>"

_OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclass(frozen=True)
class ArithmeticTask:
    """`a<op>b=` -> the decimal result, operands drawn uniformly from [min_operand, max_operand].

    Defaults (addition, operands 0..19): 400 distinct prompts, answers 0..38 of one or two digits,
    prompts of 4-6 characters. Small enough that the tiny embedded model learns it in seconds on a
    CPU, large enough that answers are not guessable (a uniform guess is right 1 time in 39).
    """

    min_operand: int = 0
    max_operand: int = 19
    ops: tuple[str, ...] = ("+",)

    def __post_init__(self) -> None:
        # Accept any sequence (e.g. an OmegaConf ListConfig from a YAML file) but store a tuple so the
        # task stays hashable and immutable.
        object.__setattr__(self, "ops", tuple(self.ops))
        unknown = [op for op in self.ops if op not in _OPS]
        if not self.ops or unknown:
            raise ValueError(f"ArithmeticTask ops must be a non-empty subset of {sorted(_OPS)}, got {list(self.ops)}")
        if self.min_operand < 0 or self.max_operand < self.min_operand:
            raise ValueError(
                f"ArithmeticTask needs 0 <= min_operand <= max_operand, got {self.min_operand}..{self.max_operand}"
            )

    def make_prompt(self, a: int, op: str, b: int) -> Prompt:
        return Prompt(text=f"{a}{op}{b}=", answer=str(_OPS[op](a, b)), meta={"a": a, "op": op, "b": b})

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        # Draw op then operands, in this fixed order, so a seeded rng gives the same prompts everywhere.
        prompts = []
        for _ in range(n):
            op = rng.choice(self.ops)
            a = rng.randint(self.min_operand, self.max_operand)
            b = rng.randint(self.min_operand, self.max_operand)
            prompts.append(self.make_prompt(a, op, b))
        return prompts

    def all_prompts(self) -> list[Prompt]:
        """Every distinct prompt, in a fixed order (for exhaustive evaluation)."""
        span = range(self.min_operand, self.max_operand + 1)
        return [self.make_prompt(a, op, b) for op in self.ops for a in span for b in span]

    def answer_range(self) -> tuple[int, int]:
        """Smallest and largest possible result: where a plausible wrong answer lives."""
        results = [_OPS[op](a, b) for op in self.ops for a in (self.min_operand, self.max_operand)
                   for b in (self.min_operand, self.max_operand)]
        return min(results), max(results)

    def reward(self, prompt: Prompt, completion: str) -> float:
        return exact_match(completion, prompt.answer)


def exact_match(completion: str, answer: str) -> float:
    """1.0 iff the completion, with the EOS marker and surrounding whitespace removed, equals answer."""
    text = completion.strip()
    if text.endswith(EOS_TEXT):
        text = text[: -len(EOS_TEXT)].strip()
    return 1.0 if text == answer.strip() else 0.0


_TASKS: dict[str, Callable[..., object]] = {"arithmetic": ArithmeticTask}


def build_task(name: str, **kwargs):
    """The built-in task called `name`, constructed with `kwargs` (its dataclass fields)."""
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(_TASKS)}")
    return _TASKS[name](**kwargs)
