"""Safe reward evaluation: one bad reward call must never stop (or stall) a run.

`score` wraps `task.reward`. A reward that raises, overruns its deadline, breaks a sandbox limit, or
returns something that is not a real number within +-REWARD_BOUND (None, a string, NaN, inf, 1e308, 3e38)
yields reward 0.0 and
an error string; the caller records the string on the Sample (`Sample.reward_error`) and the learner
counts it (`reward_errors`), so a buggy user reward shows up in the metrics instead of as a crashed or
hung sampler or a NaN loss.

The user contract (signature, return type, import path, a worked example) is docs/rewards.md. Three
guards keep a broken or slow reward from costing a run silently:
  * `check_reward`: before launch (`megarl train`) and in sampler 0 (raw torchrun launches) the function is
    called on a few real prompts with their answers as completions; a wrong signature, an exception or a
    non-number stops the run naming task.reward_fn (a timeout only warns: it may hang on some inputs only).
  * `score_group`: a group's rewards share a budget (task.reward_group_budget_s); once spent, the group's
    remaining samples fail fast without a call, so a hanging reward costs at most budget + one
    task.reward_timeout_s per group.
  * `RewardErrorWindow`: the learner stops the run, showing the first failure, once more than
    task.max_reward_error_frac of a batch's worth of the samples it received last (trained or dropped) failed.

Where a reward runs depends on who wrote it (`reward_from_config`):
  * a task's own reward (exact match): trusted and cheap, called in the sampler process.
  * `task.reward_fn: "pkg.module:fn"`, called as fn(prompt, completion, answer, meta) -> float:
      reward_sandbox=false  in one persistent worker process (`FunctionWorker`): a call costs a pipe
                            round trip; a call running past task.reward_timeout_s is killed and failed.
      reward_sandbox=true   in a fresh sandbox per call (megarl/rollout/sandbox.py), for functions that
                            run untrusted code themselves.
  * `task.reward_fn: python_output`, the built-in code-execution reward: the completion is a Python
    program, run in the sandbox; reward 1 iff its stdout equals the answer. A program that fails (an
    exception, a limit: sleeping forever, a fork bomb, 10 GB, a socket, a write outside its
    directory) is scored as failed with the sandbox's error string.
"""
from __future__ import annotations

import collections
import json
import math
import numbers
import random
import re
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from megarl.config.schema import SandboxConfig
from megarl.protocols import Prompt, Task
from megarl.rollout.sandbox import FunctionWorker, SandboxError, call, run_python

_FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def score(task: Task, prompt: Prompt, completion: str) -> tuple[float, str | None]:
    """(reward, None) on success, else (0.0, "<ExceptionType: message>")."""
    try:
        value = task.reward(prompt, completion)
    except SandboxError as exc:  # already "what failed: how" (a limit, or the child's "Type: message")
        return 0.0, str(exc)
    except Exception as exc:  # noqa: BLE001 - any user-code failure is reported, not raised
        return 0.0, f"{type(exc).__name__}: {exc}"
    # bool is a numbers.Real; accept it (True -> 1.0) since "correct?" predicates are common rewards.
    if not isinstance(value, numbers.Real):
        return 0.0, f"TypeError: reward must be a real number, got {type(value).__name__} {value!r:.80}"
    value = float(value)
    if (why := bad_reward_value(value)) is not None:
        return 0.0, f"ValueError: {why}"
    return value, None


# The documented range of a reward (docs/rewards.md). NaN and inf turn every group advantage they touch into NaN,
# and so does a value float64 holds but float32 does not (1e308); a finite float32 value near its limit (3e38)
# overflows the group statistics and the metrics (a batch mean of 2e36), and at any magnitude far beyond the
# others' it drowns every other reward's signal. 1e6 leaves room for any scale a reward is written in.
REWARD_BOUND = 1e6


class Scored(float):
    """A reward with the named parts it sums (an environment's rubric: name -> {"score", "weight"}, None where a part
    was not scored). It is the float an agent function returns (task.agent's contract) carrying `parts`, so agents
    that return a plain number are unchanged; the episode records the parts beside the reward."""

    parts: dict

    def __new__(cls, total: float, parts: dict):
        scored = super().__new__(cls, total)
        scored.parts = dict(parts)
        return scored


def bad_reward_value(value: float) -> str | None:
    """Why a real number cannot be a reward, or None."""
    if not math.isfinite(value):
        return f"reward must be finite, got {value}"
    if abs(value) > REWARD_BOUND:
        return f"reward must be within +-{REWARD_BOUND:.0e} (docs/rewards.md), got {value}"
    return None


def is_timeout(error: str) -> bool:
    """Whether a `score` error string reports a call that ran out of time (a worker's or sandbox's deadline,
    or the group's budget) rather than one that failed."""
    return error.startswith(("TimeoutError:", "wall-clock limit:"))


@dataclass
class GroupScores:
    scores: list[tuple[float, str | None]]  # (reward, error) per completion, in order
    seconds: float  # wall time of the group's reward calls
    skipped: int  # completions failed without a call: the budget was spent


def score_group(task: Task, prompt: Prompt, completions: Sequence[str], budget_s: float) -> GroupScores:
    """`score` of each completion, one after another, until the calls together took `budget_s`; the rest
    fail fast (0.0, "TimeoutError: ..."). A call started within the budget may still run to its own
    timeout, so the group takes at most budget_s + task.reward_timeout_s, plus the start-up of a new reward
    worker where a timeout killed the last one (bounded by megarl.rollout.sandbox.START_TIMEOUT_S)."""
    start, scores, skipped = time.monotonic(), [], 0
    for completion in completions:
        spent = time.monotonic() - start
        if spent >= budget_s:
            scores.append((0.0, f"TimeoutError: not scored: this group's rewards already took {spent:.1f}s "
                                f"(task.reward_group_budget_s={budget_s:g})"))
            skipped += 1
            continue
        scores.append(score(task, prompt, completion))
    return GroupScores(scores, time.monotonic() - start, skipped)


def check_reward(task: Task, reward_fn: str, num_prompts: int = 4) -> str:
    """Score `num_prompts` of the task's real prompts, each with its answer as the completion, exactly as a
    sampler will; ValueError naming task.reward_fn on the first call that raises or returns a non-number.
    Timeouts are tolerated (a reward may hang on some inputs only; the run's budget and error share handle
    them). Returns a line saying what it saw."""
    prompts = task.sample_prompts(random.Random(0), num_prompts)
    values, timeouts = [], []
    for prompt in prompts:
        value, error = score(task, prompt, prompt.answer)
        if error is None:
            values.append(value)
        elif is_timeout(error):  # no verdict; a second hang would only add another timeout to the start-up
            timeouts.append(error)
            break
        else:
            raise ValueError(f"task.reward_fn={reward_fn} failed on a real prompt of the task ({prompt.text!r:.80}, "
                             f"completion {prompt.answer!r:.40}): {error}. A reward function is called as "
                             f"fn(prompt, completion, answer, meta) and returns a real number (docs/rewards.md)")
    line = (f"task.reward_fn={reward_fn}: called on {len(values) + len(timeouts)} real prompt(s) with their answers "
            f"as completions: rewards {', '.join(f'{v:g}' for v in values) or 'none'}")
    return line + (f"; then one timed out, so the check stopped there ({timeouts[0]})" if timeouts else "")


class RewardErrorWindow:
    """Failed rewards among the last `size` samples (a batch's worth) the learner received, trained or
    dropped (a failing reward scores every sample 0.0, so zero-variance filtering would drop them all:
    counting only trained samples could never trip). `add` raises RuntimeError, showing the window's first
    failure, as soon as more than `max_frac` * `size` of them failed -- already before the window is full,
    since no later sample can bring that share back down: a reward that fails on every call stops the run
    after max_frac of one batch."""

    def __init__(self, size: int, max_frac: float):
        self.max_frac = max_frac
        self.window: collections.deque[tuple[str, str | None]] = collections.deque(maxlen=size)  # (prompt, error)

    def add(self, samples) -> None:
        self.window.extend((s.prompt, s.reward_error) for s in samples)
        failed = [(prompt, error) for prompt, error in self.window if error is not None]
        if len(failed) > self.max_frac * self.window.maxlen:
            prompt, error = failed[0]
            raise RuntimeError(
                f"rewards: {len(failed)} of the last {len(self.window)} samples' rewards failed, more than "
                f"task.max_reward_error_frac={self.max_frac:g} of a batch ({self.window.maxlen} samples); the "
                f"first of them (prompt {prompt!r:.60}): {error}. Fix task.reward_fn (docs/rewards.md), or "
                f"raise task.max_reward_error_frac to train on regardless")


def extract_code(completion: str) -> str:
    """The program in a completion: its first ```python fenced block, else the whole text."""
    fenced = _FENCED.search(completion)
    return fenced.group(1) if fenced else completion


def python_output_reward(prompt: Prompt, completion: str, sandbox: SandboxConfig, timeout_s: float) -> float:
    """1.0 iff the completion, run as a Python program in the sandbox with `prompt.meta["stdin"]` (if any)
    as input, prints `prompt.answer` (surrounding whitespace ignored); SandboxError if it does not finish."""
    result = run_python(extract_code(completion), stdin=str(prompt.meta.get("stdin", "")), limits=sandbox,
                        timeout_s=timeout_s)
    if result.error is not None:
        raise SandboxError(f"program failed: {result.error}")
    return 1.0 if result.stdout.strip() == prompt.answer.strip() else 0.0


def _plain(meta: dict) -> dict:
    """Prompt metadata as JSON types (what crosses into a worker or sandbox); other values become str."""
    return json.loads(json.dumps(meta, default=str))


@dataclass
class UserReward:
    """A user reward function given by dotted path, run outside the sampler process (see module docstring)."""

    fn_path: str
    timeout_s: float
    sandbox: SandboxConfig | None = None  # None: trusted, in a persistent worker; else a sandbox per call

    def __post_init__(self):
        self.worker = FunctionWorker(self.fn_path, self.timeout_s) if self.sandbox is None else None

    def __call__(self, prompt: Prompt, completion: str) -> float:
        args = [prompt.text, completion, prompt.answer, _plain(prompt.meta)]
        if self.worker is not None:
            return self.worker(*args)
        return call(self.fn_path, args, self.sandbox, self.timeout_s)


@dataclass
class PythonOutputReward:
    """The built-in code-execution reward as a (prompt, completion) callable, for `task.reward_fn: python_output`."""

    sandbox: SandboxConfig
    timeout_s: float

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return python_output_reward(prompt, completion, self.sandbox, self.timeout_s)


@dataclass
class WithReward:
    """`task`'s prompts, scored by `reward` instead of the task's own reward."""

    task: Task
    reward_fn: Callable[[Prompt, str], float]

    def sample_prompts(self, rng, n: int):
        return self.task.sample_prompts(rng, n)

    def reward(self, prompt: Prompt, completion: str) -> float:
        return self.reward_fn(prompt, completion)


BUILTIN_REWARDS: dict[str, Callable] = {"python_output": lambda tc: PythonOutputReward(tc.sandbox, tc.reward_timeout_s)}


def reward_from_config(tc) -> Callable[[Prompt, str], float] | None:
    """The reward `task.reward_fn` selects (`tc` is the TaskConfig), or None for the task's own reward."""
    if not tc.reward_fn:
        return None
    if ":" not in tc.reward_fn:
        if tc.reward_fn not in BUILTIN_REWARDS:
            raise ValueError(f"task.reward_fn: unknown built-in reward {tc.reward_fn!r} (known: "
                             f"{sorted(BUILTIN_REWARDS)}); a user function is given as 'package.module:function'")
        return BUILTIN_REWARDS[tc.reward_fn](tc)
    return UserReward(tc.reward_fn, tc.reward_timeout_s, tc.sandbox if tc.reward_sandbox else None)
