"""Safe reward evaluation: one bad reward call must never stop (or stall) a run.

`score` wraps `task.reward`. A reward that raises, overruns its deadline, breaks a sandbox limit, or
returns something that is not a finite real number (None, a string, NaN, inf) yields reward 0.0 and
an error string; the caller records the string on the Sample (`Sample.reward_error`) and the learner
counts it (`reward_errors`), so a buggy user reward shows up in the metrics instead of as a crashed or
hung sampler or a NaN loss.

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

import json
import math
import numbers
import re
from dataclasses import dataclass
from typing import Callable

from megarl.protocols import Prompt, Task
from megarl.rollout.sandbox import FunctionWorker, SandboxConfig, SandboxError, call, run_python

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
    # inf is rejected with NaN: either one turns every group advantage it touches into NaN.
    if not math.isfinite(value):
        return 0.0, f"ValueError: reward must be finite, got {value}"
    return value, None


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
