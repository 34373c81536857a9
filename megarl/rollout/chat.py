"""Chat formatting for multi-turn episodes, token in and token out.

A `ChatTranscript` holds one conversation twice: as chat messages (what an environment or an agent
reads and writes) and as the exact token ids the engine was given and produced (what is trained).
Model turns enter as token ids and are never re-tokenised; new messages (a tool result, a user turn)
enter as text and become the ids of the part of the rendered chat they add: the tokenizer's chat
template (tokenizer_config.json / chat_template.jinja in the model directory) renders the whole
conversation before and after, and the added text is the difference, tokenised on its own and
appended. So the ids always extend the previous ids; a model's tokens keep the ids it sampled
even where re-tokenising the text would merge or split them differently (the drift that makes a
re-tokenised trajectory a different action sequence than the one whose log-probs were recorded).

Where the template renders a model turn differently from what the model produced (a template that
strips whitespace, a turn cut at the length limit before its end marker) the rendered history no
longer extends the produced text; the added part is then what the template renders after the
model turn's message (from the end of the rendered history), so the model's tokens still stand
as produced and the new message still reads as the template writes it.

Without a chat template (a base model) a conversation is plain text: the first user message is
the prompt and every later message's content is appended as is.

Messages from outside (an agent's request) may be of any size: given `max_ids`, a transcript refuses
text that cannot fit (`OverContextError`) before tokenising it where its byte length already proves it
(no token spells more bytes than the vocabulary's longest entry), and after tokenising otherwise. New
messages can be prepared (rendered and tokenised: the slow part, touching nothing) and applied later
(appending ids), so a caller can tokenise outside a lock it shares with others.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass


class ChatFormatError(ValueError):
    """A conversation the transcript cannot extend (the caller's history differs from the recorded one)."""


class OverContextError(ValueError):
    """Messages whose tokens do not fit the room left (the context, or task.max_episode_tokens)."""

    def __init__(self, tokens: int, room: int, estimated: bool):
        self.tokens, self.room = tokens, room
        super().__init__(f"the new messages take {'at least ' if estimated else ''}{tokens} tokens"
                         f"{' (by their size in bytes)' if estimated else ''}, over the {room} left")


@dataclass(frozen=True)
class Addition:
    """New messages rendered and tokenised against a transcript of `base` ids (see ChatTranscript.prepare)."""
    messages: list[dict]
    text: str
    ids: list[int]
    base: int


@functools.lru_cache(maxsize=8)
def longest_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes any vocabulary entry spells: every token covers at most this much text (a
    byte-level BPE entry's characters stand for one byte each, a SentencePiece '▁' for a space)."""
    return max(len(token.encode()) for token in tokenizer.get_vocab())


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


class ChatTranscript:
    """One conversation: `messages` and `ids` (prompt + model + added tokens, exactly as the engine saw them)."""

    def __init__(self, tokenizer, messages: list[dict], max_ids: int | None = None):
        if not messages:
            raise ChatFormatError("a conversation needs at least one message")
        self.tokenizer = tokenizer
        self.templated = has_chat_template(tokenizer)
        self.messages = [_message(m) for m in messages]
        # The text the ids spell, special tokens written out: what the next render must extend.
        self.text = self._render(self.messages, generation_prompt=True)
        self.ids: list[int] = self._encode(self.text, max_ids)

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        if not self.templated:
            return "".join(m["content"] for m in messages)
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _encode(self, text: str, max_ids: int | None = None) -> list[int]:
        if max_ids is not None:  # refuse what cannot fit before paying for tokenising it
            least = math.ceil(len(text.encode()) / longest_token_bytes(self.tokenizer))
            if least > max_ids:
                raise OverContextError(least, max_ids, estimated=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        if max_ids is not None and len(ids) > max_ids:
            raise OverContextError(len(ids), max_ids, estimated=False)
        return ids

    def add_model_turn(self, token_ids: list[int], stop_token_ids: tuple[int, ...] = ()) -> str:
        """Record a model turn as produced; returns its message content (the stop token left out)."""
        self.ids.extend(token_ids)
        shown = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        self.text += shown
        content_ids = token_ids[:-1] if token_ids and token_ids[-1] in stop_token_ids else token_ids
        content = self.tokenizer.decode(content_ids, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": content})
        return content

    def add_messages(self, messages: list[dict], generation_prompt: bool = True) -> list[int]:
        """Append messages (tool results, user turns) and, with generation_prompt, the start of the next
        model turn; returns the ids added (the environment's tokens)."""
        return self.apply(self.prepare(messages, generation_prompt))

    def prepare(self, messages: list[dict], generation_prompt: bool = True, max_ids: int | None = None) -> Addition:
        """What add_messages would append, computed without changing the transcript; OverContextError when
        it takes more than max_ids tokens."""
        new = [_message(m) for m in messages]
        before = self._render(self.messages, generation_prompt=False)
        after = self._render(self.messages + new, generation_prompt=generation_prompt)
        if after.startswith(self.text):
            added = after[len(self.text):]
        elif after.startswith(before):
            added = after[len(before):]  # the model turn renders differently from how it was produced
        else:
            raise ChatFormatError("the chat template does not render the conversation as a prefix of itself "
                                  "extended by the new messages; megarl cannot append to it token by token")
        return Addition(new, added, self._encode(added, max_ids), len(self.ids))

    def apply(self, addition: Addition) -> list[int]:
        """Append a prepared Addition; returns its ids."""
        if addition.base != len(self.ids):  # the transcript changed since: appending would misplace the ids
            raise ChatFormatError(f"an addition prepared against {addition.base} ids applied to {len(self.ids)}")
        self.messages.extend(addition.messages)
        self.text += addition.text
        self.ids.extend(addition.ids)
        return addition.ids

    def extend_to(self, messages: list[dict]) -> list[dict]:
        """The messages of `messages` after the recorded ones, checking the recorded ones are its start
        (an agent resends the whole history with every request)."""
        given = [_message(m) for m in messages]
        recorded = self.messages
        if len(given) < len(recorded) or not all(_same(a, b) for a, b in zip(given, recorded)):
            first = next((i for i, (a, b) in enumerate(zip(given, recorded)) if not _same(a, b)), len(given))
            raise ChatFormatError(f"message {first} differs from the episode's history (or the history is shorter: "
                                  f"{len(given)} messages given, {len(recorded)} recorded); a session's requests must "
                                  f"resend its history unchanged, model replies included, and add messages after it")
        return given[len(recorded):]


def _message(m) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
        raise ChatFormatError(f"a message must be a dict with string 'role' and 'content', got {m!r:.120}")
    return {"role": m["role"], "content": m["content"]}


def _same(a: dict, b: dict) -> bool:
    # Assistant turns are compared as content the client was sent; surrounding whitespace is allowed to differ.
    if a["role"] != b["role"]:
        return False
    return a["content"].strip() == b["content"].strip() if a["role"] == "assistant" else a["content"] == b["content"]
