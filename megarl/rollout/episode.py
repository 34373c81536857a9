"""Multi-turn episodes on a sampler: model turns from the engine, environment turns from a thread pool.

An `Episode` is one sample in the making: the conversation (megarl.rollout.chat.ChatTranscript) and,
after the prompt, every token with its behaviour log-prob and version -- a model turn's as the engine
produced them (versions free to change within a turn, at an in-flight update, and between turns), an
environment turn's with log-prob 0 and version -1 and listed in `env_spans` (loss mask 0).

`EpisodeRunner` drives episodes for the sampler loop, engine-agnostic (it only submits
GenerationRequests with the episode's token ids so far and is handed their Completions):

  model turn finishes -> the environment's step runs on a worker thread (a slow tool never stalls
  decoding) -> `poll()` collects it: done -> the episode is finished (with the environment's reward);
  not done -> its messages become environment tokens and the next model turn is submitted.

Limits, each ending the episode as truncated (finish_reason "length", reward 0): task.max_turns model
turns, task.max_episode_tokens tokens after the prompt, the engine's context (sampler.max_seq_len).
An environment turn that would leave the next model turn no room is not added (`environment_room`):
an episode's tokens never exceed the context, so nothing over it reaches the learner.
An environment step that raises, returns something malformed, or runs past task.env_timeout_s fails
the episode (reward 0, `error` says why, counted in `env_failures`) and the run goes on; a thread
stuck in a hung step is abandoned (Python cannot kill it) and occupies one of the task.env_workers.

A resumed run never continues an episode: it re-issues the prompt groups its checkpoint had not
retired from their first turn, under the resumed weights.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from megarl.protocols import Completion, GenerationRequest, Prompt, SamplingParams
from megarl.rollout.chat import Addition, ChatFormatError, ChatTranscript, OverContextError
from megarl.rollout.environment import check_observation


@dataclass
class Episode:
    key: str  # "<group id>/<index in group>"
    prompt: Prompt
    chat: ChatTranscript | None  # None until an agent's first request opens it (megarl/rollout/agent.py)
    prompt_len: int  # tokens of the opening messages
    environment: object = None
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    env_spans: list[tuple[int, int]] = field(default_factory=list)
    turns: int = 0
    # MoE models: the routes of the latest model turn's request, which (re)computed every position before
    # its last token: the turn's prompt is the whole episode so far, prefilled anew (docs/moe.md).
    routes: np.ndarray | None = None
    sampling: SamplingParams | None = None  # its turns' sampling, else the runner's (an evaluation's greedy episodes)
    finish_reason: str = "stop"
    reward: float = 0.0
    reward_parts: dict | None = None  # the named parts the reward sums, where its scorer gives them (rewards.Scored)
    error: str | None = None
    done: bool = False

    @property
    def prompt_ids(self) -> list[int]:
        return self.chat.ids[:self.prompt_len] if self.chat else []

    @property
    def token_ids(self) -> list[int]:
        return self.chat.ids[self.prompt_len:] if self.chat else []

    def add_model_turn(self, completion: Completion, stop_token_ids: tuple[int, ...], parse=None) -> None:
        """Record a model turn as sampled; `parse` (a megarl.rollout.tool_calls parser) reads its tool calls."""
        self.chat.add_model_turn(completion.token_ids, stop_token_ids, parse)
        self.logprobs.extend(completion.logprobs)
        self.versions.extend(completion.versions)
        self.routes = completion.routes
        self.turns += 1

    def add_environment_turn(self, addition: Addition) -> None:
        """Append messages prepared (rendered, tokenised) by self.chat.prepare."""
        start = len(self.chat.ids) - self.prompt_len
        added = self.chat.apply(addition)
        self.logprobs.extend([0.0] * len(added))
        self.versions.extend([-1] * len(added))
        if added:
            self.env_spans.append((start, start + len(added)))

    def sample_routes(self) -> np.ndarray | None:
        """Routes of every position of the finished episode (prompt + tokens - 1 rows), None without routes.

        The latest turn's request computed the positions before its last token; what follows -- that token
        as an input, the chat markers after it, a final environment turn -- no engine computed, and no
        trained token's log-prob depends on them (each is predicted from earlier positions only), so their
        rows get experts 0..k-1, the filler megarl.rollout.routes pads a batch with."""
        if self.routes is None:
            return None
        rows = len(self.chat.ids) - 1
        filled = np.empty((rows, *self.routes.shape[1:]), dtype=self.routes.dtype)
        filled[:] = np.arange(self.routes.shape[2], dtype=self.routes.dtype)
        filled[:len(self.routes)] = self.routes
        return filled

    def end(self, reward: float, finish_reason: str | None = None, error: str | None = None) -> None:
        self.reward, self.error, self.done = float(reward), error, True
        if finish_reason is not None:
            self.finish_reason = finish_reason


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_episode_tokens: int  # after the prompt, model and environment tokens together; 0 = context only
    max_seq_len: int  # the engine's context
    min_new_tokens: int = 1  # room a turn needs (SGLang refuses a request that leaves less)
    env_timeout_s: float = 10.0

    @classmethod
    def of(cls, task_config, max_seq_len: int, min_new_tokens: int) -> "EpisodeLimits":
        """The limits task.* sets (task_config: the TaskConfig) on an engine of context `max_seq_len`."""
        tc = task_config
        return cls(tc.max_turns, tc.max_episode_tokens, max_seq_len, min_new_tokens, tc.env_timeout_s)


def turn_room(episode: Episode, limits: EpisodeLimits) -> int | None:
    """The most tokens the episode's next model turn may take, None when a limit leaves it no turn."""
    room = limits.max_seq_len - len(episode.chat.ids)
    if limits.max_episode_tokens > 0:
        room = min(room, limits.max_episode_tokens - len(episode.token_ids))
    return None if episode.turns >= limits.max_turns or room < limits.min_new_tokens else room


def environment_room(episode: Episode, limits: EpisodeLimits) -> int:
    """The most tokens an environment turn (or, before any, the opening) may add and still leave the next
    model turn limits.min_new_tokens of room."""
    if episode.chat is None:
        return limits.max_seq_len - limits.min_new_tokens
    room = limits.max_seq_len - len(episode.chat.ids)
    if limits.max_episode_tokens > 0:
        room = min(room, limits.max_episode_tokens - len(episode.token_ids))
    return room - limits.min_new_tokens


class EpisodeRunner:
    """Episodes of a multi-turn task in flight on one engine (see the module docstring)."""

    def __init__(self, task, tokenizer, submit: Callable[[GenerationRequest], None], sampling: SamplingParams,
                 limits: EpisodeLimits, stop_token_ids: tuple[int, ...], workers: int):
        self.task, self.tokenizer, self.submit = task, tokenizer, submit
        self.sampling, self.limits, self.stop_token_ids = sampling, limits, stop_token_ids
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="megarl-env")
        self.episodes: dict[str, Episode] = {}
        # key -> future of its environment step, queued or running on the pool; key -> when it started running
        # (env_timeout_s bounds the step itself, not its wait for a free worker).
        self.stepping: dict[str, concurrent.futures.Future] = {}
        self.step_started: dict[str, float] = {}
        self.env_failures = 0
        self.over_context = 0  # environment turns refused for the context (their episodes end truncated)
        self.env_s = 0.0  # wall time of finished environment steps, summed over threads
        self.ready = threading.Event()  # an environment step finished: poll() has work
        self._lock = threading.Lock()

    def opening(self, prompt: Prompt) -> ChatTranscript:
        return ChatTranscript(self.tokenizer, self.task.opening_messages(prompt))

    def start(self, key: str, prompt: Prompt, chat: ChatTranscript, sampling: SamplingParams | None = None) -> None:
        """Begin an episode whose opening (from `opening`) the caller has checked fits the context; its turns
        sample with `sampling`, else the runner's."""
        episode = Episode(key, prompt, chat, len(chat.ids), self.task.environment(prompt), sampling=sampling)
        self.episodes[key] = episode
        self._next_turn(episode)

    def _next_turn(self, episode: Episode) -> Episode | None:
        """Submit the episode's next model turn, or end it (truncated) when no limit leaves room; the ended
        episode is returned."""
        room = turn_room(episode, self.limits)
        if room is None:
            episode.end(0.0, "length")
            return self._finished(episode)
        base = episode.sampling or self.sampling
        sampling = replace(base, max_new_tokens=min(base.max_new_tokens, room))
        self.submit(GenerationRequest(f"{episode.key}/{episode.turns}", list(episode.chat.ids), sampling,
                                      stop_token_ids=self.stop_token_ids))
        return None

    def on_completion(self, completion: Completion) -> Episode | None:
        """A model turn finished: its environment step starts (None), or the episode ended and is returned."""
        episode = self.episodes[completion.request_id.rsplit("/", 1)[0]]
        episode.add_model_turn(completion, self.stop_token_ids)
        if completion.finish_reason != "stop":  # cut at a length limit (or aborted) mid-turn: nothing to answer
            episode.end(0.0, completion.finish_reason)
            return self._finished(episode)
        messages = [dict(m) for m in episode.chat.messages]
        self.stepping[episode.key] = self.pool.submit(self._timed_step, episode.key, episode.environment, messages)
        return None

    def _timed_step(self, key: str, environment, messages):
        start = time.monotonic()
        with self._lock:
            self.step_started[key] = start
        try:
            return environment.step(messages)
        finally:
            with self._lock:
                self.env_s += time.monotonic() - start
            self.ready.set()

    def _settled(self, key: str, now: float) -> bool:
        """Whether episode `key`'s environment step finished or ran past task.env_timeout_s."""
        with self._lock:
            started = self.step_started.get(key)
        return self.stepping[key].done() or (started is not None and now - started >= self.limits.env_timeout_s)

    def all_settled(self) -> bool:
        """Every environment step in flight finished or overdue: the next `poll` applies them all, in the order
        their model turns finished (an evaluation waits for this, so its turns follow one order every time)."""
        now = time.monotonic()
        return all(self._settled(key, now) for key in list(self.stepping))

    def poll(self) -> list[Episode]:
        """Apply finished (or overdue) environment steps; returns the episodes that ended."""
        self.ready.clear()
        ended, now = [], time.monotonic()
        for key, future in list(self.stepping.items()):
            if not self._settled(key, now):
                continue
            del self.stepping[key]
            with self._lock:
                self.step_started.pop(key, None)
            episode = self.episodes[key]
            if not future.done():
                self._fail(episode, f"environment: step timed out after {self.limits.env_timeout_s:g}s "
                                    f"(task.env_timeout_s); its thread is abandoned")
            else:
                try:
                    obs = check_observation(future.result())
                    if obs.done:
                        episode.end(float(obs.reward))
                    else:
                        episode.add_environment_turn(episode.chat.prepare(
                            list(obs.messages), max_ids=environment_room(episode, self.limits)))
                except OverContextError:
                    self.over_context += 1
                    episode.end(0.0, "length")  # truncated, without the messages that do not fit
                except (ChatFormatError, ValueError) as exc:
                    self._fail(episode, f"environment: {exc}")
                except Exception as exc:  # noqa: BLE001 - a user environment's failure fails its episode only
                    self._fail(episode, f"environment: {type(exc).__name__}: {exc}")
            if episode.done:
                ended.append(self._finished(episode))
            elif (truncated := self._next_turn(episode)) is not None:
                ended.append(truncated)
        return ended

    def _fail(self, episode: Episode, error: str) -> None:
        self.env_failures += 1
        episode.end(0.0, error=error)

    def _finished(self, episode: Episode) -> Episode:
        del self.episodes[episode.key]
        return episode

    @property
    def num_stepping(self) -> int:
        return len(self.stepping)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
