"""SFT records -> token ids and loss masks (pure: a tokenizer, no model, no process group).

One JSON object per line of a JSONL file, in either format (`megarl sft`, docs/sft.md):

* ``{"prompt": str, "completion": str}``: ids = encode(prompt) + encode(completion) + [EOS]; the
  completion's tokens and the EOS are trained (loss mask 1), the prompt is context. Each part is encoded
  on its own and no chat template is applied, exactly as `megarl train` samples: the sampler encodes a
  `task.name=jsonl` prompt's text and the model's completion ends with the tokenizer's EOS (its stop
  token), so SFT trains the very token sequences RL samples afterwards.
* ``{"messages": [{"role": str, "content": str, ...}, ...]}``: rendered with the model directory's chat
  template (``tokenizer.apply_chat_template``). An assistant turn is the text the template adds for it
  after the generation prompt of the turns before it; it is trained up to and including the tokenizer's
  EOS (what the sampler stops on), while what the template writes after the EOS (a newline) and every
  other turn are context. Each span is encoded on its own, so the mask boundaries are exact. A template
  that renders an earlier turn differently once later turns follow cannot be split this way (the record
  is refused, naming why); one whose assistant turns never contain the EOS is refused as a whole (a model
  trained on it would never stop). Text after the last assistant turn trains nothing and is dropped.

Other keys of a record are ignored (one file may serve `megarl sft` and `task.name=jsonl`, which reads
``prompt`` and ``answer``). A line that is empty, not UTF-8 / JSON, not an object, of neither format, or
of both is a bad row (``sft.on_bad_row``: error naming FILE:LINE, or skip and count); a record longer
than the context (``sft.max_seq_len``) is overlong (``sft.on_overlong``: the same two choices).
"""
from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megarl.rollout.datasets import parse_json_row


class BadRecord(ValueError):
    """One line that is not a usable record; the message says what is wrong with it."""


class SFTDataError(ValueError):
    """The data cannot be used at all (no file, no record, a chat template that cannot be trained on)."""


@dataclass
class Example:
    ids: list[int]
    mask: list[int]  # aligned with ids: 1 where ids[t] is trained (predicted from ids[:t])
    where: str  # FILE:LINE

    @property
    def trained_tokens(self) -> int:
        return sum(self.mask)


@dataclass
class Records:
    """The usable records of one file and what was skipped."""

    path: str
    examples: list[Example] = field(default_factory=list)
    formats: Counter = field(default_factory=Counter)  # "prompt_completion" / "messages" -> records
    bad_rows: int = 0
    first_bad_row: str | None = None
    overlong: int = 0
    first_overlong: str | None = None

    def summary(self) -> str:
        kinds = ", ".join(f"{n} {kind.replace('_', '/')}" for kind, n in sorted(self.formats.items()))
        line = f"{self.path}: {len(self.examples)} records ({kinds}), {sum(e.trained_tokens for e in self.examples)} trained tokens"
        if self.bad_rows:
            line += f"; {self.bad_rows} bad lines skipped (first: {self.first_bad_row})"
        if self.overlong:
            line += f"; {self.overlong} overlong records skipped (first: {self.first_overlong})"
        return line


def chat_template_missing(model_dir: str | Path) -> str:
    d = Path(model_dir)
    return (f"model directory {d} has no chat template (no {d / 'chat_template.jinja'} and no 'chat_template' key in "
            f"{d / 'tokenizer_config.json'}); add one there, or write the records as prompt/completion")


def render_prompt_completion(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise SFTDataError("the tokenizer has no eos_token, which ends every trained completion (and stops the sampler)")
    p = _encode(tokenizer, prompt)
    c = _encode(tokenizer, completion) + [eos]
    return p + c, [0] * len(p) + [1] * len(c)


def render_messages(tokenizer, messages: list[dict], model_dir: str | Path = "the model directory"
                    ) -> tuple[list[int], list[int]]:
    """ids and mask of a conversation (module docstring); BadRecord for this record, SFTDataError for the
    template (none in the model directory, or assistant turns without the EOS)."""
    if not getattr(tokenizer, "chat_template", None):
        raise SFTDataError(chat_template_missing(model_dir))
    eos = tokenizer.eos_token_id
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    messages = messages[:last + 1]
    full = _render(tokenizer, messages, generation_prompt=False)
    spans: list[tuple[int, int]] = []  # [start, end) characters of each assistant turn in `full`
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True)
        upto = _render(tokenizer, messages[:i + 1], generation_prompt=False)
        if not (upto.startswith(before) and full.startswith(upto)) or (spans and len(before) < spans[-1][1]):
            raise BadRecord(f"the chat template does not render this conversation as a prefix of itself at message {i} "
                            "(it renders an earlier turn differently once later turns follow), so the assistant "
                            "turns cannot be cut out exactly")
        spans.append((len(before), len(upto)))
    ids, mask, pos = [], [], 0
    for start, end in spans:
        context = _encode(tokenizer, full[pos:start])
        turn = _encode(tokenizer, full[start:end])
        if eos is None or eos not in turn:
            raise SFTDataError(
                f"the chat template ends an assistant turn without the tokenizer's eos_token "
                f"({tokenizer.eos_token!r}), the token the sampler stops on, so a model trained on it would never "
                f"stop: the turn renders as {full[start:end]!r:.200}; set eos_token (tokenizer_config.json) to the "
                f"template's end-of-turn token")
        trained = turn.index(eos) + 1
        ids += context + turn
        mask += [0] * len(context) + [1] * trained + [0] * (len(turn) - trained)
        pos = end
    while mask and mask[-1] == 0:  # the template's text after the last trained token predicts nothing trained
        mask.pop()
        ids.pop()
    return ids, mask


def render_record(tokenizer, record, model_dir: str | Path = "the model directory") -> tuple[str, list[int], list[int]]:
    """(format, ids, mask) of one parsed JSON line; BadRecord saying what is wrong with it."""
    if not isinstance(record, dict):
        raise BadRecord(f"expected a JSON object with 'prompt' and 'completion', or 'messages'; got {type(record).__name__}")
    pc = [k for k in ("prompt", "completion") if k in record]
    if "messages" in record and pc:
        raise BadRecord(f"has both 'messages' and {' and '.join(map(repr, pc))}: a record is one format or the other")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise BadRecord(f"'messages' must be a non-empty list of messages, got {messages!r:.80}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise BadRecord(f"message {i} must be an object with string 'role' and 'content', got {m!r:.80}")
        if not any(m["role"] == "assistant" for m in messages):
            raise BadRecord(f"no assistant message: nothing to train (roles: {[m['role'] for m in messages]})")
        return "messages", *render_messages(tokenizer, messages, model_dir)
    if len(pc) < 2:
        missing = {"prompt", "completion"} - set(pc)
        raise BadRecord(f"missing key {' and '.join(map(repr, sorted(missing)))}: expected 'prompt' and 'completion', "
                        f"or 'messages' (the record has {sorted(record)})")
    for key in ("prompt", "completion"):
        value = record[key]
        if not isinstance(value, str) or not value:
            raise BadRecord(f"'{key}' must be a non-empty string, got {type(value).__name__} {value!r:.60}")
    return "prompt_completion", *render_prompt_completion(tokenizer, record["prompt"], record["completion"])


def load_records(path: str | Path, tokenizer, max_seq_len: int, on_bad_row: str = "error",
                 on_overlong: str = "error", model_dir: str | Path = "the model directory",
                 context_source: str = "sft.max_seq_len") -> Records:
    """Every usable record of the JSONL file at `path`, rendered; raises BadRecord (on_bad_row /
    on_overlong = error: FILE:LINE and what is wrong) or SFTDataError."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise SFTDataError(f"{path}: file not found")
    out = Records(str(path))
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path}:{number}"
            try:
                kind, ids, mask = render_record(tokenizer, _parse(raw), model_dir)
            except BadRecord as exc:
                if on_bad_row == "error":
                    raise BadRecord(f"{where}: {exc} (sft.on_bad_row=skip skips such lines)") from None
                out.bad_rows += 1
                out.first_bad_row = out.first_bad_row or f"{where}: {exc}"
                continue
            except SFTDataError as exc:
                raise SFTDataError(f"{where}: {exc}") from None
            if len(ids) > max_seq_len:
                why = f"{where}: {len(ids)} tokens, longer than the context of {max_seq_len} ({context_source})"
                if on_overlong == "error":
                    raise BadRecord(f"{why} (sft.on_overlong=skip skips such records)")
                out.overlong += 1
                out.first_overlong = out.first_overlong or why
                continue
            out.examples.append(Example(ids, mask, where))
            out.formats[kind] += 1
    if not out.examples:
        skipped = [f"{n} {what} (first: {first})" for n, what, first in (
            (out.bad_rows, "bad lines", out.first_bad_row), (out.overlong, "overlong", out.first_overlong)) if n]
        raise SFTDataError(f"{path}: no usable records" + (f": {'; '.join(skipped)} skipped" if skipped else
                                                           " (the file is empty)"))
    return out


def _parse(raw: bytes):
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRecord(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not line.strip():
        raise BadRecord("empty line")
    try:
        return parse_json_row(line)
    except ValueError as exc:
        raise BadRecord(str(exc)) from None


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    if not messages and not generation_prompt:
        return ""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # a template may refuse a conversation (raise_exception in jinja, an empty one)
        if not messages:
            return ""
        raise BadRecord(f"the chat template refused the conversation: {type(exc).__name__}: {exc}") from None


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


# --------------------------------------------------------------------------------------------- split, order, batch

def split_heldout(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, held-out): round(fraction * n) records drawn with `seed` (at least 1 when fraction > 0,
    and at least one record left to train on), both in file order."""
    n = len(examples)
    k = 0 if fraction <= 0 or n < 2 else min(n - 1, max(1, round(fraction * n)))
    held = set(random.Random(seed).sample(range(n), k))
    return [e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held]


def num_steps(records: int, batch_size: int, epochs: float, steps: int) -> int:
    return steps if steps > 0 else max(1, math.ceil(epochs * records / batch_size))


def batch_order(records: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """The record indices of every step: epoch after epoch, each a fresh permutation drawn from `seed`
    and the epoch's number, cut into consecutive batches (a batch may straddle two epochs)."""
    stream: list[int] = []
    epoch = 0
    while len(stream) < steps * batch_size:
        order = list(range(records))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        stream += order
        epoch += 1
    return [stream[i * batch_size:(i + 1) * batch_size] for i in range(steps)]


def collate(examples: list[Example], pad_id: int, learner_version: int = 0):
    """A TrainBatch of the examples, right-padded: behaviour log-probs and advantages 0 (the supervised
    loss reads neither), versions -1 off the mask and `learner_version` on it."""
    from megarl.protocols import TrainBatch

    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.float32)
    for row, e in enumerate(examples):
        ids[row, :len(e.ids)] = torch.tensor(e.ids)
        mask[row, :len(e.mask)] = torch.tensor(e.mask, dtype=torch.float32)
    versions = torch.where(mask > 0, learner_version, -1).long()
    zeros = torch.zeros_like(mask)
    return TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=zeros, versions=versions,
                      advantages=zeros.clone(), learner_version=learner_version)
