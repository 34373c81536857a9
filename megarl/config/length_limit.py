"""How many tokens after its prompt a sample may have: the one rule every engine, the episode runner, the learner's
overlong shaping and the config checks apply (a pure function of the run config)."""
from __future__ import annotations

from dataclasses import dataclass

from megarl.config.schema import MULTI_TURN_TASKS


@dataclass(frozen=True)
class LengthLimit:
    """The most tokens after its prompt a sample could have had, by the rule every engine and the episode runner
    apply: min(cap, max_seq_len - prompt tokens). `cap` is sampling.max_new_tokens for a completion and
    task.max_episode_tokens for an episode (None when that is 0: the context alone bounds it); `cap_key` names it."""

    max_seq_len: int
    cap: int | None
    cap_key: str

    @classmethod
    def of(cls, cfg) -> "LengthLimit":  # cfg: the run's Config
        if bool(cfg.task.agent or cfg.task.env) or cfg.task.name in MULTI_TURN_TASKS:
            if cfg.task.max_episode_tokens:
                return cls(cfg.sampler.max_seq_len, cfg.task.max_episode_tokens, "task.max_episode_tokens")
            return cls(cfg.sampler.max_seq_len, None, "sampler.max_seq_len")
        return cls(cfg.sampler.max_seq_len, cfg.sampling.max_new_tokens, "sampling.max_new_tokens")

    @property
    def longest(self) -> int:
        return self.max_seq_len if self.cap is None else min(self.cap, self.max_seq_len)

    def of_prompt(self, prompt_tokens: int) -> int:
        return min(self.longest, self.max_seq_len - prompt_tokens)
