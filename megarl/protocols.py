"""The seams between roles: the records that flow along the data path and the protocols a backend implements.

Data path: prompts/tasks -> sampler Engine -> reward -> queue -> TrainBatch -> Learner step
-> weight publish -> sampler Engine.  A new engine or learner backend is one new file implementing
`Engine` or `Learner`; nothing else changes.

Per-token conventions (used everywhere):
  * A sample's `token_ids` are everything after its prompt. Single-turn: the model's completion.
    Multi-turn (megarl/rollout/episode.py): model turns interleaved with environment tokens (tool
    results, user turns), the latter listed in `env_spans`, with behaviour log-prob 0, version -1 and
    loss mask 0: they are context, not actions.
  * Mixture-of-experts models: a sample's `routes` (numpy, [P, moe_layers, top_k], uint8 or int16 past 255
    experts: routes_dtype) hold,
    for every position i < P = len(prompt_ids) + len(token_ids) - 1 (the last token is never an input),
    the experts each MoE layer's router chose for the input token at i, in the router's top-k order,
    under the weights that computed that position (docs/moe.md; checked by megarl.rollout.routes).
  * A model token carries the log-probability it had under the weights that produced it
    (`logprobs`, the *behaviour* log-prob, computed from logits / temperature over the full
    vocabulary) and that weights' policy `version`.
  * Batched per-token tensors are [B, S] and aligned with `input_ids`: entry [b, t] refers to the
    token input_ids[b, t] (predicted from input_ids[b, :t]). Prompt and padding positions have
    loss_mask 0, behaviour log-prob 0 and version -1.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # annotations only: the CLI reads the config and checks the task without importing torch
    import torch


def routes_dtype(num_experts: int):
    """The integer numpy dtype a sample's routes travel in: uint8, int16 past 255 experts (the MoE contract above)."""
    return np.uint8 if num_experts <= 255 else np.int16


@dataclass(frozen=True)
class RouteShape:
    """What every sample's routes must look like for an MoE model (megarl.models.moe.route_shape reads it from
    the model's config; megarl.rollout.routes checks and packs routes against it)."""

    layers: int  # MoE layers
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> torch.dtype:
        import torch  # here: the CLI imports this module without torch

        return torch.from_numpy(np.zeros(0, routes_dtype(self.num_experts))).dtype


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 16


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Completion:
    """A finished generation: every completion token with its behaviour log-prob and version."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    # "stop" (a stop token was produced, and is included) or "length"; "abort": ended early on request
    # (BuiltinEngine.cancel, an SGLang abort), the tokens are those produced until then.
    finish_reason: str
    # MoE models, when the engine records them: the routes of every position it computed (the
    # module docstring; [len(prompt_ids) + len(token_ids) - 1, moe_layers, top_k]); None otherwise.
    routes: np.ndarray | None = None


@dataclass
class Sample:
    """One scored rollout as it travels through the queue (plain data, picklable)."""

    group_id: str
    prompt: str
    completion: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    finish_reason: str
    sampler_rank: int = 0
    reward_error: str | None = None
    # Multi-turn episodes: [start, end) offsets into token_ids of the environment's tokens, and the
    # number of model turns. A single-turn sample has no environment tokens and one turn.
    env_spans: list[tuple[int, int]] = field(default_factory=list)
    turns: int = 1
    # MoE models: the routes of every position (module docstring), as the sampler's engine recorded them;
    # None for a dense model or an engine that did not record them.
    routes: np.ndarray | None = None
    # The prompt's data source (a dataset row's task.source_field), for per-source metrics; "" when it has none.
    source: str = ""
    # The named parts the reward sums where its scorer gives them (an environment's rubric, rewards.Scored), as the
    # JSON of {name: {"score": float, "weight": float} or null}; None when it has none. JSON, not a dict, so the
    # wire carries it as one checked string (reward_parts_problem).
    reward_parts: str | None = None

    @property
    def policy_versions(self) -> set[int]:
        """The policy versions that produced this sample's model tokens (environment tokens have none)."""
        return {v for v in self.versions if v >= 0}

    @property
    def oldest_version(self) -> int:
        return min(self.policy_versions, default=-1)

    def model_token_mask(self) -> list[bool]:
        """Per token of token_ids: True where the model produced it (trained), False on environment tokens."""
        mask = [True] * len(self.token_ids)
        for start, end in self.env_spans:
            mask[start:end] = [False] * (end - start)
        return mask

    def spans(self) -> list[tuple[str, int, int]]:
        """token_ids cut into ("model" | "env", start, end) runs, in order (what rollouts.jsonl records)."""
        runs: list[tuple[str, int, int]] = []
        for i, is_model in enumerate(self.model_token_mask()):
            kind = "model" if is_model else "env"
            if runs and runs[-1][0] == kind:
                runs[-1] = (kind, runs[-1][1], i + 1)
            else:
                runs.append((kind, i, i + 1))
        return runs


def sample_shape_problem(s: Sample) -> str | None:
    """What breaks the invariants across a sample's fields that a batch relies on, or None: per-token lists of
    equal length, env spans ordered inside token_ids, MoE routes one row per input position (megarl.distributed.wire
    checks these and the value ranges on every message; the learner's batch assembly checks these again)."""
    n = len(s.token_ids)
    if len(s.logprobs) != n or len(s.versions) != n:
        return f"token_ids, logprobs and versions differ in length ({n}, {len(s.logprobs)}, {len(s.versions)})"
    end = 0
    for start, stop in s.env_spans:
        if not end <= start < stop <= n:
            return f"env_spans {s.env_spans} are not ordered, non-empty spans within the {n} tokens"
        end = stop
    positions = len(s.prompt_ids) + n - 1  # every input position; the last token is never an input
    if s.routes is not None and s.routes.shape[0] != positions:
        return f"routes hold {s.routes.shape[0]} positions, the sample has {positions} (prompt + completion - 1)"
    return reward_parts_problem(s.reward_parts)


# A rubric names a handful of parts; the bound keeps a forged message from making every rollouts.jsonl row huge.
MAX_REWARD_PARTS_CHARS = 16384


def reward_parts_problem(parts: str | None) -> str | None:
    """What makes `parts` not a Sample.reward_parts value, or None: at most MAX_REWARD_PARTS_CHARS characters of
    JSON holding an object of names -> null or {"score": finite number, "weight": finite number}."""
    if parts is None:
        return None
    if len(parts) > MAX_REWARD_PARTS_CHARS:
        return f"reward_parts: {len(parts)} characters, over {MAX_REWARD_PARTS_CHARS}"
    try:
        value = json.loads(parts, parse_constant=_refuse_constant)  # no NaN/Infinity: rollouts.jsonl stays JSON
    except (ValueError, RecursionError) as e:
        return f"reward_parts: not JSON ({str(e)[:80]})"

    def part_ok(part) -> bool:
        return part is None or (isinstance(part, dict) and set(part) == {"score", "weight"} and all(
            type(part[k]) in (int, float) and math.isfinite(part[k]) for k in ("score", "weight")))

    if not (isinstance(value, dict) and all(part_ok(p) for p in value.values())):
        return "reward_parts: expected an object of names -> null or {score, weight} (finite numbers)"
    return None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


@dataclass
class TrainBatch:
    """A learner batch; per-token tensors are [B, S], aligned with input_ids (see module docstring)."""

    input_ids: torch.Tensor  # long [B, S], prompt + completion, right-padded
    loss_mask: torch.Tensor  # float [B, S]: 1.0 on completion tokens that are trained on
    behaviour_logprobs: torch.Tensor  # float [B, S]
    versions: torch.Tensor  # long [B, S], -1 off the mask
    advantages: torch.Tensor  # float [B, S], the sample's advantage broadcast over its tokens
    learner_version: int  # the version of the weights the step starts from
    samples: list[Sample] = field(default_factory=list)  # provenance, for logging
    # MoE models: uint8/int16 [B, S, L_moe, top_k], the experts the engine routed input token [b, t] to in
    # each MoE layer (megarl.rollout.routes); None for dense models or when routes were not recorded.
    routes: torch.Tensor | None = None
    # advantage.estimator=gae: float [B, S], each sample's reward on its last model token (megarl.algo.values
    # .terminal_rewards); the learner's critic turns them into per-token GAE advantages. None otherwise.
    rewards: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


@runtime_checkable
class Engine(Protocol):
    """A generation engine on one sampler rank."""

    @property
    def version(self) -> int: ...

    @property
    def num_unfinished(self) -> int: ...

    def add_request(self, request: GenerationRequest) -> None: ...

    def step(self) -> list[Completion]:
        """Admit waiting requests, run one decode step for every running request, return finished ones."""

    def stage_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Hand over new weights; they take effect at the next step boundary (in flight)."""

    def close(self) -> None:
        """Release what the engine started (an SGLang server, its TP followers); nothing to do in-process."""


@runtime_checkable
class Learner(Protocol):
    """A training backend on the learner ranks."""

    @property
    def version(self) -> int: ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on the batch; increments version; returns scalar metrics."""

    def logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Per-token log-probs [B, S] under the current weights (entry [:, 0] is 0)."""

    def publish_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors of the current weights, in a fixed order (every learner rank iterates it;
        collective over TP); valid until the next train_step (they may be the parameters themselves)."""

    def publish_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This TP rank's slices of those tensors, in megarl.models.tp_shard's layout (for samplers of the
        same TP size: shard-to-shard publish)."""

    def publish_spec(self, shards: bool = False) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, shape, dtype) of what publish_tensors (shards: publish_shards) yields, in its order,
        computed without materialising a tensor: the publisher streams them against it."""


@runtime_checkable
class Task(Protocol):
    """A prompt source with a verifiable reward."""

    def sample_prompts(self, rng, n: int) -> Sequence["Prompt"]: ...

    def reward(self, prompt: "Prompt", completion: str) -> float: ...


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: str
    meta: dict = field(default_factory=dict)
