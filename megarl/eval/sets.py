"""What an evaluation scores and when: the held-out sets a config names, and the policy versions it evaluates.

A set is a fixed list of prompts and the reward that scores them. `eval.sets[i].path` empty: held-out
prompts of the training task (megarl/rollout/heldout.py: eval.heldout_fraction of them, which such a run
never trains on: `heldout_fraction`), drawn with eval.seed from a stream of their own (`eval_rng`), so
every process and `megarl eval` draw the same ones; a path: the file's rows, read as task.name=jsonl
reads a dataset (a malformed row stops the launch naming FILE:LINE). The reward is the set's reward_fn, else task.reward_fn,
else the task's own (exact match for files).

Versions: version v is the policy after v optimizer steps (run.steps batches publish run.steps *
algo.sync_epochs of them). `due_versions` is the set a run evaluates: the first (eval.at_start), the one
published every eval.every_steps steps, and the last (eval.at_end); a resumed run starts at its
checkpoint's version and evaluates none before it.
"""
from __future__ import annotations

import random
from pathlib import Path
from dataclasses import dataclass, replace

from megarl.protocols import Prompt, Task
from megarl.rollout.heldout import draw_heldout, training_split
from megarl.rollout.tasks import task_from_config


@dataclass(frozen=True)
class EvalSet:
    name: str
    prompts: tuple[Prompt, ...]
    task: Task  # scores the prompts: task.reward(prompt, completion)


def eval_rng(seed: int, set_name: str) -> random.Random:
    """The generator that draws a built-in set's prompts (string seeds hash the same in every process)."""
    return random.Random(f"megarl-eval/{seed}/{set_name}")


def build_sets(cfg) -> list[EvalSet]:
    """Every set of cfg.eval.sets with its prompts and reward; raises ValueError (a file's FILE:LINE) on bad input."""
    sets = []
    for sc in cfg.eval.sets:
        reward_fn = sc.reward_fn or cfg.task.reward_fn
        if sc.path:
            task = task_from_config(replace(cfg.task, name="jsonl", path=sc.path, reward_fn=reward_fn,
                                            on_bad_row="error"))
            rows = getattr(task, "task", task).prompts  # a task scored by reward_fn wraps the dataset
            prompts = rows[:sc.prompts] if sc.prompts else rows
        else:
            task = task_from_config(replace(cfg.task, reward_fn=reward_fn))
            prompts = draw_heldout(task, eval_rng(cfg.eval.seed, sc.name), sc.prompts, cfg.eval.heldout_fraction)
        sets.append(EvalSet(sc.name, tuple(prompts), task))
    return sets


def heldout_fraction(cfg) -> float | None:
    """The share of the training task's prompts a run must not train on: eval.heldout_fraction when a set
    draws from the training task (an empty path), else None (files are held out by being other files)."""
    return cfg.eval.heldout_fraction if any(not sc.path for sc in cfg.eval.sets) else None


def due_versions(cfg, first_version: int = 0) -> set[int]:
    """The versions a run evaluates, from `first_version` (a resumed run's) through the last. A step publishes
    version steps * algo.sync_epochs (sync mode trains K epochs per batch; pipeline mode: K = 1)."""
    ec, per_step = cfg.eval, cfg.algo.sync_epochs
    last = cfg.run.steps * per_step
    if not ec.sets:
        return set()
    every = ec.every_steps * per_step
    due = set(range(every, last, every)) if every else set()
    if ec.at_start:
        due.add(first_version)
    if ec.at_end:
        due.add(last)
    return {v for v in due if first_version <= v <= last}


def prompt_count(prompts: list) -> str:
    """"64 prompts", or "64 prompts (29 distinct)" where some repeat (a set drawn with replacement from a small
    task): its scores rest on the distinct ones."""
    distinct = len({(p.text, p.answer) for p in prompts})
    return f"{len(prompts)} prompts" + (f" ({distinct} distinct)" if distinct < len(prompts) else "")


def too_long_counts(cfg, model_dir, sets: list) -> tuple[list[int] | None, str]:
    """([for each of `sets`, its prompts that do not fit sampler.max_seq_len with one new token], "") as the
    samplers' tokenizer counts them, or (None, why not) when the tokenizer does not load. Remembered in
    model.cache_dir's check memo under the tokenizer's files, the prompts, the limit and this code
    (megarl.check_memo): transformers' import is ~2 CPU-s that `megarl train` would otherwise spend while its
    ranks start."""
    from importlib.metadata import version

    from megarl.check_memo import content_key, memo_path, recall, remember, tokenizer_inputs

    memo = memo_path(cfg.model.cache_dir)
    key = content_key(tokenizer_inputs(Path(model_dir)), Path(__file__).read_text(), version("transformers"),
                      str(cfg.sampler.max_seq_len), *(f"{s.name}\0{p.text}" for s in sets for p in s.prompts))
    counts = recall(memo, key)
    if isinstance(counts, list) and len(counts) == len(sets) and all(type(c) is int for c in counts):
        return counts, ""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises bare Exceptions; the model check
        # looks at file names only, the samplers load it for real (and say what is wrong)
        return None, f" (lengths not counted here: the tokenizer did not load: {str(exc)[:120]})"
    counts = [sum(len(tokenizer.encode(p.text, add_special_tokens=False)) + 1 > cfg.sampler.max_seq_len
                  for p in s.prompts) for s in sets]
    remember(memo, key, counts)
    return counts, ""


def check_sets(cfg, model_dir) -> list[str]:
    """Build every set as the samplers will and say what it holds: its prompts and how many do not fit
    sampler.max_seq_len with one new token (skipped and counted in every evaluation); a user reward
    function is called on a few real prompts; the training side of the held-out split is drawn from once.
    Raises ValueError (FILE:LINE of a bad row, a reward that
    raises) before anything starts."""
    from megarl.rollout.rewards import check_reward

    sets = build_sets(cfg)
    if (fraction := heldout_fraction(cfg)) is not None:  # what the samplers will train on: not empty either
        training_split(task_from_config(cfg.task), fraction).sample_prompts(random.Random(0), 1)
    over_counts, unloaded = too_long_counts(cfg, model_dir, sets)
    lines = []
    for i, (sc, s) in enumerate(zip(cfg.eval.sets, sets)):
        line = f"eval set {s.name}: {prompt_count(s.prompts)}" + (f" ({sc.path})" if sc.path else "")
        if over_counts is None:
            line += unloaded
        elif over := over_counts[i]:
            line += f", {over} longer than sampler.max_seq_len={cfg.sampler.max_seq_len} (skipped, counted)"
        lines.append(line)
        reward_fn = sc.reward_fn or cfg.task.reward_fn
        if ":" in reward_fn:
            lines.append(f"eval set {s.name}: {check_reward(s.task, reward_fn)}")
    return lines
