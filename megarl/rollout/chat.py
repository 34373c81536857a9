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

Tool calling (megarl/rollout/tool_calls.py): a transcript opened with `tools` renders them through the template
on every render; an assistant message may carry `tool_calls` (arguments as objects, as templates read them) and
a tool message a `tool_call_id`. A model turn added with a `parse` function is parsed from its sampled text into
`tool_calls` of its message; its ids stay as sampled whatever the template makes of the parsed calls.

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
from typing import Callable

from megarl.rollout.tool_calls import ParsedReply, ToolCallParseError, ToolMessageError, message_tool_calls


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

    def __init__(self, tokenizer, messages: list[dict], max_ids: int | None = None, tools: list[dict] | None = None):
        if not messages:
            raise ChatFormatError("a conversation needs at least one message")
        self.tokenizer = tokenizer
        self.templated = has_chat_template(tokenizer)
        self.tools = tools or None  # OpenAI function tools, rendered by the template on every render
        self.unparsed: str | None = None  # why the latest model turn's tool-call marker did not parse
        self.messages = [_message(m, i) for i, m in enumerate(messages)]
        # The text the ids spell, special tokens written out: what the next render must extend.
        self.text = self._render(self.messages, generation_prompt=True)
        self.ids: list[int] = self._encode(self.text, max_ids)

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        if not self.templated:
            return "".join(m["content"] for m in messages)
        kwargs = {"tools": self.tools} if self.tools else {}
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation_prompt, **kwargs)
        except Exception as exc:  # noqa: BLE001 - jinja's errors (TemplateError, TypeError, ...) name no common base
            what = "these tools and messages" if self.tools else "these messages"
            raise ChatFormatError(f"the model's chat template cannot render {what}: "
                                  f"{type(exc).__name__}: {exc}"[:400]) from exc

    def _encode(self, text: str, max_ids: int | None = None) -> list[int]:
        if max_ids is not None:  # refuse what cannot fit before paying for tokenising it
            least = math.ceil(len(text.encode()) / longest_token_bytes(self.tokenizer))
            if least > max_ids:
                raise OverContextError(least, max_ids, estimated=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        if max_ids is not None and len(ids) > max_ids:
            raise OverContextError(len(ids), max_ids, estimated=False)
        return ids

    def add_model_turn(self, token_ids: list[int], stop_token_ids: tuple[int, ...] = (),
                       parse: Callable[[str], ParsedReply | None] | None = None) -> str:
        """Record a model turn as produced; returns its message content (the stop token left out). With `parse`
        (a tool_calls parser) the sampled text becomes the message's content and `tool_calls`; a reply whose
        marker does not parse stays content, with the reason in `self.unparsed`."""
        self.ids.extend(token_ids)
        shown = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        self.text += shown
        content_ids = token_ids[:-1] if token_ids and token_ids[-1] in stop_token_ids else token_ids
        content = self.tokenizer.decode(content_ids, skip_special_tokens=True)
        message, self.unparsed = {"role": "assistant", "content": content}, None
        if parse is not None:
            try:
                parsed = parse(self.tokenizer.decode(content_ids, skip_special_tokens=False))
            except ToolCallParseError as exc:
                parsed, self.unparsed = None, str(exc)
            if parsed is not None and parsed.calls:
                turn = sum(m["role"] == "assistant" for m in self.messages)
                message = {"role": "assistant", "content": parsed.content, "tool_calls": [
                    {"id": f"call_{turn}_{j}", "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}
                    for j, call in enumerate(parsed.calls)]}
        self.messages.append(message)
        return message["content"]

    def add_messages(self, messages: list[dict], generation_prompt: bool = True) -> list[int]:
        """Append messages (tool results, user turns) and, with generation_prompt, the start of the next
        model turn; returns the ids added (the environment's tokens)."""
        return self.apply(self.prepare(messages, generation_prompt))

    def prepare(self, messages: list[dict], generation_prompt: bool = True, max_ids: int | None = None) -> Addition:
        """What add_messages would append, computed without changing the transcript; OverContextError when
        it takes more than max_ids tokens."""
        new = [_message(m, len(self.messages) + i) for i, m in enumerate(messages)]
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
        given = [_message(m, i) for i, m in enumerate(messages)]
        recorded = self.messages
        if len(given) < len(recorded) or not all(_same(a, b) for a, b in zip(given, recorded)):
            first = next((i for i, (a, b) in enumerate(zip(given, recorded)) if not _same(a, b)), len(given))
            raise ChatFormatError(f"message {first} differs from the episode's history (or the history is shorter: "
                                  f"{len(given)} messages given, {len(recorded)} recorded); a session's requests must "
                                  f"resend its history unchanged, model replies included, and add messages after it")
        return given[len(recorded):]


def _message(m, index: int = 0) -> dict:
    """A message as templates read it: role and content (text parts joined; None -> "" for an assistant turn of
    tool calls only), an assistant turn's tool_calls, a tool message's tool_call_id and name."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ChatFormatError(f"messages[{index}] must be a dict with a string 'role', got {m!r:.120}")
    content = m.get("content")
    if content is None and m["role"] == "assistant" and m.get("tool_calls"):
        content = ""
    elif isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                           and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)  # OpenAI's content parts, text only
    if not isinstance(content, str):
        raise ChatFormatError(f"messages[{index}].content must be a string (or text parts), got {m!r:.120}")
    out = {"role": m["role"], "content": content}
    try:
        if m["role"] == "assistant" and (calls := message_tool_calls(m, index)):
            out["tool_calls"] = calls
    except ToolMessageError as exc:
        raise ChatFormatError(str(exc)) from None
    if m["role"] == "tool":
        out.update({key: str(m[key]) for key in ("tool_call_id", "name") if m.get(key) is not None})
    return out


def _same(a: dict, b: dict) -> bool:
    # Assistant turns are compared as content the client was sent; surrounding whitespace is allowed to differ.
    if a["role"] != b["role"]:
        return False
    if a["role"] != "assistant":
        return a == b
    return a["content"].strip() == b["content"].strip() and a.get("tool_calls") == b.get("tool_calls")
