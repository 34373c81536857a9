"""Built-in synthetic tasks: prompt sources with a verifiable reward, and the name -> task registry.

A task implements `megarl.protocols.Task`: `sample_prompts(rng, n)` draws prompts and
`reward(prompt, completion)` scores one completion text. The built-in `ArithmeticTask`
("12+7=" -> "19") is what the embedded default model is warm-started on and what the CPU demo
trains with RL; it needs no data files, so a fresh machine can run end to end.

With `think_mean > 0` the task has a "thinking" segment: the target completion is a run of filler
tokens (`THINK_CHAR`, "." -- one token) of geometrically distributed length with that mean, then the
answer: `"12+7="` -> `"..........19<eos>"`. That gives long-tailed generation lengths (like reasoning
RL) while the reward still depends only on the final answer.

`CountTask` ("count": `"d-k="` -> `"defghijk"`) is the task whose completion length the prompt sets:
spell the alphabet run from one letter to another, run lengths drawn long-tailed, so RL cannot
shorten the tail without losing reward (docs/tasks.md says why it is the demo's task).

`ToolArithmeticTask` ("tool_arith": `"37*43"` -> a `>>> 37*43` tool call, the tool's `1591`, the answer
`1591`) is the multi-turn task: a chat episode only solvable by calling the Python tool and copying
its output (megarl/rollout/environment.py), what the multi-turn demo trains.

`PythonOutputTask` ("python_output") asks for a program instead and scores it by running it in the
sandbox; "jsonl" is a prompt dataset (megarl/rollout/datasets.py). `task_from_config` builds the task a
config names, scored by `task.reward_fn` when set (megarl/rollout/rewards.py).
"""
from __future__ import annotations

import inspect
import operator
import random
from dataclasses import dataclass, field
from typing import Callable

from megarl.config.schema import SandboxConfig
from megarl.protocols import Prompt
from megarl.rollout.environment import Observation, PythonTool, message_code
from megarl.rollout.rewards import WithReward, python_output_reward, reward_from_config
from megarl.rollout.sandbox import load_function

EOS_TEXT = "<|endoftext|>"
THINK_CHAR = "."  # the filler "thinking" token: one byte, so one token of the embedded tokenizer

_OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclass(frozen=True)
class ArithmeticTask:
    """`a<op>b=` -> the decimal result, operands drawn uniformly from [min_operand, max_operand].

    Defaults (addition, operands 0..19): 400 distinct prompts, answers 0..38 of one or two digits,
    prompts of 4-6 characters. Small enough that the tiny embedded model learns it in seconds on a
    CPU, large enough that answers are not guessable (a uniform guess is right 1 time in 39).

    `think_mean` (default 0: no thinking) is the mean number of filler `THINK_CHAR` tokens before the
    answer in a target completion; their count is geometric (a constant per-token probability
    1 / (1 + think_mean) of stopping), so completion lengths are long-tailed. It shapes the targets
    (`target_completion`, used by the embedded model's warm start); the reward ignores leading filler
    whatever its value, so it only ever scores the final answer.
    """

    min_operand: int = 0
    max_operand: int = 19
    ops: tuple[str, ...] = ("+",)
    think_mean: float = 0.0

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
        object.__setattr__(self, "think_mean", float(self.think_mean))
        if not self.think_mean >= 0.0:  # also rejects NaN
            raise ValueError(f"ArithmeticTask needs think_mean >= 0, got {self.think_mean}")

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

    def sample_think_length(self, rng: random.Random, max_len: int | None = None) -> int:
        """A geometric number of filler tokens with mean `think_mean` (0 when not thinking).

        P(k) = (1 - q)^k q with q = 1 / (1 + think_mean): every filler token is followed by another
        with the same probability, so a model trained on these targets learns a constant stop rate.
        With `max_len`, longer draws are redrawn (the tail beyond it is cut off, not piled on it)."""
        if self.think_mean <= 0.0:
            return 0
        if max_len is not None and max_len < 0:
            raise ValueError(f"max_len must be >= 0, got {max_len}")
        go_on = self.think_mean / (1.0 + self.think_mean)
        while True:
            k = 0
            while rng.random() < go_on:
                k += 1
            if max_len is None or k <= max_len:
                return k

    def target_completion(self, prompt: Prompt, rng: random.Random, max_think: int | None = None) -> str:
        """A correct completion (EOS not included): filler of geometric length, then the answer."""
        return THINK_CHAR * self.sample_think_length(rng, max_think) + prompt.answer

    def reward(self, prompt: Prompt, completion: str) -> float:
        return exact_match(completion, prompt.answer)


def strip_thinking(completion: str) -> str:
    """The final answer of a completion: EOS marker, surrounding whitespace and leading filler removed."""
    text = completion.strip()
    if text.endswith(EOS_TEXT):
        text = text[: -len(EOS_TEXT)].strip()
    return text.lstrip(THINK_CHAR).strip()


def exact_match(completion: str, answer: str) -> float:
    """1.0 iff the completion, with the EOS marker, surrounding whitespace and any leading thinking
    filler removed, equals answer. A completion with no answer (empty, or filler only -- e.g. cut at
    the length limit while still thinking) gets 0."""
    text = strip_thinking(completion)
    return 1.0 if text and text == answer.strip() else 0.0


# The alphabet CountTask spells runs of: 52 one-byte characters, so one token each in the embedded tokenizer.
COUNT_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class CountTask:
    """`d-k=` -> `defghijk`: the run of COUNT_ALPHABET from the first letter to the second, inclusive.

    The prompt alone sets the completion's length (the run, then EOS) and the reward is exact match,
    so a policy cannot shorten a long completion without losing its reward: unlike a filler run, the
    length tail survives RL. Run lengths are long-tailed: P(L = k) is proportional to
    (1 - q)^(k-1) q for k in 1..max_length (q = 1 / length_mean; longer draws are redrawn), which
    with the defaults (mean 8, at most 48) gives p99 / mean ~4.3, like the reasoning lengths of a
    real RL batch. The start letter is uniform among those that leave room for the run.
    """

    length_mean: float = 8.0
    max_length: int = 48

    def __post_init__(self) -> None:
        object.__setattr__(self, "length_mean", float(self.length_mean))
        if not 1 <= self.max_length <= len(COUNT_ALPHABET):
            raise ValueError(f"CountTask needs 1 <= max_length <= {len(COUNT_ALPHABET)}, got {self.max_length}")
        if not self.length_mean >= 1.0:  # also rejects NaN
            raise ValueError(f"CountTask needs length_mean >= 1, got {self.length_mean}")

    def make_prompt(self, start: int, length: int) -> Prompt:
        run = COUNT_ALPHABET[start:start + length]
        return Prompt(text=f"{run[0]}-{run[-1]}=", answer=run, meta={"start": start, "length": length})

    def sample_length(self, rng: random.Random) -> int:
        go_on = 1.0 - 1.0 / self.length_mean
        while True:
            k = 1
            while rng.random() < go_on:
                k += 1
            if k <= self.max_length:
                return k

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        # Length first, then the start: a seeded rng gives the same prompts everywhere.
        prompts = []
        for _ in range(n):
            length = self.sample_length(rng)
            prompts.append(self.make_prompt(rng.randint(0, len(COUNT_ALPHABET) - length), length))
        return prompts

    def near_miss(self, prompt: Prompt, rng: random.Random, max_offset: int) -> str:
        """The run from the same start stopped 1..max_offset letters early or late (within the alphabet,
        never empty): a plausible wrong completion. "Z-Z=" has no such run; its miss stops at once."""
        start, length = prompt.meta["start"], prompt.meta["length"]
        room = len(COUNT_ALPHABET) - start
        offsets = [d for d in range(-max_offset, max_offset + 1) if d and 1 <= length + d <= room] or [-length]
        return COUNT_ALPHABET[start:start + length + rng.choice(offsets)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        text = completion.strip()
        if text.endswith(EOS_TEXT):
            text = text[: -len(EOS_TEXT)].strip()
        return 1.0 if text == prompt.answer else 0.0


@dataclass(frozen=True)
class PythonOutputTask:
    """Code execution: "# Python 3: print the value of 12+7" -> a program, scored by running it in the
    sandbox (megarl/rollout/sandbox.py): reward 1.0 iff it prints "19". Prompts and answers are
    ArithmeticTask's; a program that fails or breaks a sandbox limit is a failed reward with its error."""

    max_operand: int = 19
    reward_timeout_s: float = 10.0  # wall-clock bound of one program run
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        return [Prompt(f"# Python 3: print the value of {p.text[:-1]}\n", p.answer, p.meta)
                for p in ArithmeticTask(max_operand=self.max_operand).sample_prompts(rng, n)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        return python_output_reward(prompt, completion, self.sandbox, self.reward_timeout_s)


@dataclass(frozen=True)
class ToolArithmeticTask:
    """Multiply two numbers of `digits` digits, with a Python tool: a chat episode of up to max_turns model turns.

    The user turn is `"37*43"`. A model turn `>>> <code>` is run by the tool (PythonTool, in the sandbox)
    and answered by a "tool" message with its output; any other model turn is the answer: reward 1.0 iff it
    is the product. The embedded model cannot multiply (a uniform guess of a 4-digit product is right about
    1 time in 9000), so the reward measures whether it calls the tool with the right operands and copies
    the result: two model turns that depend on each other through the environment's tokens."""

    digits: int = 2
    tool_timeout_s: float = 5.0
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 4:
            raise ValueError(f"ToolArithmeticTask needs 1 <= digits <= 4, got {self.digits}")
        # One tool for every episode, its outputs memoised: the calls are arithmetic (see PythonTool).
        object.__setattr__(self, "_tool", PythonTool(self.tool_timeout_s, sandbox=self.sandbox, memo=True))

    def make_prompt(self, a: int, b: int) -> Prompt:
        return Prompt(text=f"{a}*{b}", answer=str(a * b), meta={"a": a, "b": b})

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        lo, hi = 10 ** (self.digits - 1), 10 ** self.digits - 1
        return [self.make_prompt(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(n)]

    def opening_messages(self, prompt: Prompt) -> list[dict]:
        return [{"role": "user", "content": prompt.text}]

    def environment(self, prompt: Prompt) -> "ToolArithmeticEnv":
        return ToolArithmeticEnv(prompt.answer, self._tool)


@dataclass
class ToolArithmeticEnv:
    answer: str
    tool: PythonTool

    def step(self, messages: list[dict]) -> Observation:
        code = message_code(messages[-1])
        if code is None:
            return Observation(done=True, reward=1.0 if messages[-1]["content"].strip() == self.answer else 0.0)
        answer = {"role": "tool", "content": self.tool.output(code)}
        if messages[-1].get("tool_calls"):
            answer["tool_call_id"] = messages[-1]["tool_calls"][0]["id"]
        return Observation(messages=[answer])


# A string entry is imported on first use ("module:Class"): megarl.rollout.datasets builds on this module.
_TASKS: dict[str, Callable[..., object] | str] = {
    "arithmetic": ArithmeticTask, "count": CountTask, "python_output": PythonOutputTask,
    "tool_arith": ToolArithmeticTask, "jsonl": "megarl.rollout.datasets:DatasetTask",
    "lap_count": "megarl.rollout.lap_count:LapCountTask"}

def _factory(name: str) -> Callable[..., object]:
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(_TASKS)}")
    factory = _TASKS[name]
    return load_function(factory) if isinstance(factory, str) else factory


def build_task(name: str, **kwargs):
    """The built-in task called `name`, constructed with `kwargs` (its dataclass fields)."""
    return _factory(name)(**kwargs)


def task_from_config(tc):
    """The task `tc.name` (tc: the TaskConfig), given the task.* keys named like its fields, scored by
    `task.reward_fn` when that is set (megarl/rollout/rewards.py)."""
    accepted = inspect.signature(_factory(tc.name)).parameters
    task = build_task(tc.name, **{key: getattr(tc, key) for key in accepted if hasattr(tc, key)})
    reward = reward_from_config(tc)
    return task if reward is None else WithReward(task, reward)


def prompt_rng(seed: int, stream: int, index: int) -> random.Random:
    """The generator that draws prompt group `index` of sampler `stream` (its role rank) in run `seed`.

    A pure function of the three (string seeds are hashed with SHA-512, the same in every process), so
    a resumed run can re-issue exactly the prompts that were in flight (megarl/rollout/position.py)."""
    return random.Random(f"megarl-prompt/{seed}/{stream}/{index}")


def sync_sampling_seed(seed: int, engine: int, version: int) -> int:
    """The sampling seed of the sync-mode batch that engine `engine` generates under policy `version` in run `seed`.

    A pure function of the three, like prompt_rng: the batch's completions then depend on the weights, the
    prompts and these numbers only, not on how many batches this process generated before (a resumed run
    generates the batches the uninterrupted one did) nor on the learner's layout (which moves global ranks)."""
    return random.Random(f"megarl-sync-sampling/{seed}/{engine}/{version}").getrandbits(63)
