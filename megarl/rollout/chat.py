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
"""
from __future__ import annotations


class ChatFormatError(ValueError):
    """A conversation the transcript cannot extend (the caller's history differs from the recorded one)."""


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


class ChatTranscript:
    """One conversation: `messages` and `ids` (prompt + model + added tokens, exactly as the engine saw them)."""

    def __init__(self, tokenizer, messages: list[dict]):
        if not messages:
            raise ChatFormatError("a conversation needs at least one message")
        self.tokenizer = tokenizer
        self.templated = has_chat_template(tokenizer)
        self.messages = [_message(m) for m in messages]
        # The text the ids spell, special tokens written out: what the next render must extend.
        self.text = self._render(self.messages, generation_prompt=True)
        self.ids: list[int] = self._encode(self.text)

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        if not self.templated:
            return "".join(m["content"] for m in messages)
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

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
        ids = self._encode(added)
        self.messages.extend(new)
        self.text += added
        self.ids.extend(ids)
        return ids

    def extend_to(self, messages: list[dict]) -> list[dict]:
        """The messages of `messages` after the recorded ones, checking the recorded ones are its start
        (an agent resends the whole history with every request)."""
        given = [_message(m) for m in messages]
        recorded = self.messages
        if len(given) < len(recorded) or not all(_same(a, b) for a, b in zip(given, recorded)):
            first = next((i for i, (a, b) in enumerate(zip(given, recorded)) if not _same(a, b)), len(given))
            raise ChatFormatError(f"message {first} differs from this session's history (or the history is shorter: "
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
