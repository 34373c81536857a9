"""Environments of multi-turn episodes: the protocol, and the Python tool that runs model-written code.

An environment is what answers a model turn: it sees the conversation so far (the last message is
the model's turn) and returns an `Observation`: the messages that follow (a tool result, a user turn),
whether the episode is done and, when it is, its reward. A multi-turn task (`MultiTurnTask`) is a
task that gives each episode its opening messages and a fresh environment; the sampler
(megarl/rollout/episode.py) runs the turns, token in and token out.

`PythonTool` runs a model turn written as `>>> <code>` in the sandbox (megarl/rollout/sandbox.py) like
an interactive interpreter: statements run, the value of a final expression is printed; the tool
message is its output (or the error's last line), cut to `max_chars`. Anything else is an answer.
"""
from __future__ import annotations

import concurrent.futures
import numbers
import threading
from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

from megarl.config.schema import SandboxConfig
from megarl.protocols import Prompt
from megarl.rollout.rewards import bad_reward_value
from megarl.rollout.sandbox import run_python

TOOL_PREFIX = ">>> "
# The Python tool as an OpenAI function tool (an agent's `tools=`; the tool-calling model's warm start): short, so
# the tiny model's context holds it.
PYTHON_TOOL_SCHEMA = {"type": "function", "function": {"name": "python", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}}}}

# The program the sandbox runs: the model's code arrives on stdin (never spliced into source text).
_REPL = """import ast, sys
tree = ast.parse(sys.stdin.read(), "<tool>", "exec")
last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
scope = {"__name__": "__main__"}
exec(compile(tree, "<tool>", "exec"), scope)
if last is not None:
    value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), scope)
    if value is not None:
        print(repr(value))
"""


@dataclass(frozen=True)
class Observation:
    """What an environment answers a model turn with."""

    messages: Sequence[dict] = ()  # appended to the conversation, e.g. {"role": "tool", "content": "1591"}
    done: bool = False
    reward: float | None = None  # required when done


@runtime_checkable
class Environment(Protocol):
    def step(self, messages: list[dict]) -> Observation:
        """The conversation so far, its last message the model's turn -> what follows it."""


@runtime_checkable
class MultiTurnTask(Protocol):
    """A task whose samples are episodes: opening messages, then model turns answered by an environment."""

    def sample_prompts(self, rng, n: int) -> Sequence[Prompt]: ...

    def opening_messages(self, prompt: Prompt) -> list[dict]: ...

    def environment(self, prompt: Prompt) -> Environment: ...


def is_multi_turn(task) -> bool:
    return isinstance(task, MultiTurnTask)


def check_observation(obs) -> Observation:
    """The observation if well formed, else ValueError saying what is wrong (the episode then fails)."""
    if not isinstance(obs, Observation):
        raise ValueError(f"an environment step must return an Observation, got {type(obs).__name__} {obs!r:.80}")
    for m in obs.messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"an observation message must be a dict with string 'role' and 'content', got {m!r:.80}")
    if obs.done:
        if isinstance(obs.reward, bool) or not isinstance(obs.reward, numbers.Real):
            raise ValueError(f"a finished episode needs a real-valued reward, got {obs.reward!r}")
        if (why := bad_reward_value(float(obs.reward))) is not None:
            raise ValueError(f"a finished episode needs a real-valued reward: {why}")
    elif not obs.messages:
        raise ValueError("an episode that is not done needs at least one message for the model to answer")
    return obs


@dataclass
class PythonTool:
    """Runs `>>> <code>` model turns in the sandbox; `output(code)` is the tool message's content.

    With `memo` the output of each distinct code text is kept (at most `memo_size`) and reused: right for
    code whose output depends on nothing but its text -- arithmetic, string work; the sandbox has no
    network and a read-only filesystem, but a program that reads the clock or draws random numbers would
    see its first answer again. A group's episodes mostly make the same call, so this saves most of the
    sandbox starts (~70 ms each on a CPU core)."""

    timeout_s: float = 5.0
    max_chars: int = 64
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    memo: bool = False
    memo_size: int = 4096
    _memo: dict[str, concurrent.futures.Future] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def output(self, code: str) -> str:
        if not self.memo:
            return self._run(code)
        with self._lock:
            entry = self._memo.get(code)
            owner = entry is None
            if owner:  # the first caller runs it; concurrent callers of the same code wait for its answer
                if len(self._memo) >= self.memo_size:
                    self._memo.pop(next(iter(self._memo)))  # the oldest entry
                entry = self._memo[code] = concurrent.futures.Future()
        if owner:
            try:
                entry.set_result(self._run(code))
            except BaseException as exc:
                with self._lock:
                    self._memo.pop(code, None)  # a failure to run is not an answer: the next caller retries
                entry.set_exception(exc)
        return entry.result()

    def _run(self, code: str) -> str:
        result = run_python(_REPL, stdin=code, limits=self.sandbox, timeout_s=self.timeout_s)
        if result.error is None and result.returncode == 0:
            text = result.stdout.strip()
        else:  # the error's last line ("NameError: name 'x' is not defined"), or the limit that stopped it
            lines = result.stderr.strip().splitlines()
            text = lines[-1] if lines else (result.error or f"exit status {result.returncode}")
        return text[: self.max_chars]


def tool_code(content: str) -> str | None:
    """The code of a tool-call turn (`>>> code`), None for an answer."""
    return content[len(TOOL_PREFIX):] if content.startswith(TOOL_PREFIX) else None


def message_code(message: dict) -> str | None:
    """The code a model turn asks to run: its first `python` tool call's `code` (OpenAI tool calling), else its
    `>>> code` text; None for an answer. A call of another tool, or without string code, runs "" (no output)."""
    calls = message.get("tool_calls")
    if calls:
        fn = calls[0].get("function", {})
        code = fn.get("arguments", {}).get("code") if fn.get("name") == "python" else None
        return code if isinstance(code, str) else ""
    return tool_code(message["content"])
