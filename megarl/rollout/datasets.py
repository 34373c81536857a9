"""Prompt datasets as tasks: rows of a JSONL or Parquet file, or of a `datasets` save_to_disk directory.

`task.name: jsonl` with `task.path`. `task.prompt_field` and `task.answer_field` name the columns; the
answer may be a string or a number, and every other field of a row goes to `Prompt.meta`, where reward
functions see it (e.g. `stdin` for the python_output reward). Parquet needs pyarrow and a directory
needs the `datasets` package; both are optional and a missing one is named in the error.

A bad row -- not valid JSON or UTF-8, not an object, its prompt or answer missing or of the wrong
type -- stops the load with "FILE:LINE: what is wrong" (`on_bad_row="error"`, the default), or is
skipped and counted in `bad_rows` (`on_bad_row="skip"`; `megarl train` prints the count and the first
problem when the run starts). Blank lines are not rows.

Prompts are drawn uniformly, with replacement, by the rng the sampler passes, and by nothing else: the
sampler seeds that rng from (run.seed, its rank, the group's index) (`tasks.prompt_rng`), so a resumed
run draws exactly the prompts it would have drawn (megarl/rollout/position.py). An epoch order (each
row once per pass) would need the group index in the Task protocol; it is not offered. The reward is
exact match on the final answer (tasks.exact_match) unless `task.reward_fn` names another.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from megarl.protocols import Prompt
from megarl.rollout.tasks import exact_match

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")  # any other file that is not .parquet is read as JSONL too


def source_of(prompt: Prompt, source_field: str) -> str:
    """The prompt's data source: its row's `source_field` column (task.source_field) as text, "" without one."""
    value = prompt.meta.get(source_field) if source_field else None
    return "" if value is None else str(value)


class BadRow(ValueError):
    """One row that cannot be a prompt; the message says what is wrong with it."""


@dataclass
class DatasetTask:
    path: str
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    on_bad_row: str = "error"
    prompts: list[Prompt] = field(init=False, repr=False)
    bad_rows: int = field(init=False, default=0)
    first_bad_row: str | None = field(init=False, default=None)  # "where: what", for the start-up summary

    def __post_init__(self) -> None:
        if self.on_bad_row not in ("error", "skip"):
            raise ValueError(f"on_bad_row must be 'error' or 'skip', got {self.on_bad_row!r}")
        self.prompts = []
        for where, row in _rows(Path(self.path).expanduser()):
            try:
                if isinstance(row, BadRow):
                    raise row
                self.prompts.append(prompt_from_row(row, self.prompt_field, self.answer_field))
            except BadRow as exc:
                if self.on_bad_row == "error":
                    raise BadRow(f"{where}: {exc} (task.on_bad_row=skip skips such rows)") from None
                self.bad_rows += 1
                self.first_bad_row = self.first_bad_row or f"{where}: {exc}"
        if not self.prompts:
            raise ValueError(f"{self.path}: no usable rows ({self.bad_rows} bad"
                             f"{': first ' + self.first_bad_row if self.first_bad_row else ''})")

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        return [self.prompts[rng.randrange(len(self.prompts))] for _ in range(n)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        return exact_match(completion, prompt.answer)


def prompt_from_row(row, prompt_field: str, answer_field: str) -> Prompt:
    """A Prompt from one row (a mapping); BadRow saying what is missing or wrong."""
    if not isinstance(row, dict):
        raise BadRow(f"expected an object with fields {prompt_field!r} and {answer_field!r}, got {type(row).__name__}")
    for key, setting in ((prompt_field, "task.prompt_field"), (answer_field, "task.answer_field")):
        if key not in row:
            raise BadRow(f"missing field {key!r} (the row has {sorted(row)}; the field is set by {setting})")
    text, answer = row[prompt_field], row[answer_field]
    if not isinstance(text, str) or not text:
        raise BadRow(f"field {prompt_field!r} must be a non-empty string, got {type(text).__name__} {text!r:.60}")
    # bool is an int: an answer "True" is almost certainly a mistaken column, so it is refused.
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise BadRow(f"field {answer_field!r} must be a string or a number, got {type(answer).__name__} {answer!r:.60}")
    meta = {k: v for k, v in row.items() if k not in (prompt_field, answer_field)}
    return Prompt(text=text, answer=str(answer), meta=meta)


def _rows(path: Path) -> Iterator[tuple[str, object]]:
    """(where, row) for every row of the dataset at `path`; an unreadable row comes as a BadRow."""
    if not path.exists():
        raise FileNotFoundError(f"dataset not found: {path}")
    if path.is_dir():
        yield from _table_rows(path, _load_hf_dataset(path))
    elif path.suffix == ".parquet":
        yield from _table_rows(path, _load_parquet(path))
    else:
        yield from _jsonl_rows(path, "" if path.suffix in JSONL_SUFFIXES else
                               f"; {path.suffix or 'a file without a suffix'} is read as JSONL: the formats read are "
                               f"JSONL (one JSON object per line), .parquet and a `datasets` save_to_disk directory")


def _jsonl_rows(path: Path, hint: str = "") -> Iterator[tuple[str, object]]:
    """`hint`: what a row that is not JSON adds to its error (a file whose suffix says another format)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, BadRow(f"not UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            if not line.strip():
                continue
            try:
                yield where, parse_json_row(line.strip())
            except ValueError as exc:
                yield where, BadRow(f"{exc}{hint}")


def parse_json_row(line: str) -> object:
    """One JSONL row's value; ValueError saying why it is not a usable row. Beyond invalid JSON that means a row
    nested deeper than Python's recursion limit (json raises RecursionError) and a string holding a lone
    surrogate (`"\\ud800"` is valid JSON but no text: it would pass here and fail when first tokenized or
    logged, mid-run)."""
    try:
        value = json.loads(line)
    except RecursionError:
        raise ValueError("nested too deep to read (more levels than Python's recursion limit)") from None
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"holds a lone surrogate ({exc.object[exc.start:exc.end]!r}), which is not text") from None
    except RecursionError:
        raise ValueError("nested too deep to read (more levels than Python's recursion limit)") from None
    return value


def _table_rows(path: Path, rows: list[dict]) -> Iterator[tuple[str, object]]:
    for number, row in enumerate(rows):
        yield f"{path} row {number}", row


def _load_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    return pq.read_table(path).to_pylist()


def _load_hf_dataset(path: Path) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{path}: a dataset directory is read with the `datasets` package "
                          f"(pip install datasets), or give a .jsonl / .parquet file") from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        raise ValueError(f"{path}: holds splits {sorted(loaded)}; point task.path at one split's directory")
    return loaded.to_list()
