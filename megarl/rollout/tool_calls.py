"""OpenAI tool calling over a model's own chat format: reply parsers per template family, and history checks.

A model writes tool calls as text in its family's format; the agent endpoint (megarl/rollout/agent.py) renders
a request's `tools` through the model's chat template and parses each reply with the parser of that template's
family into OpenAI `tool_calls`:

| parser    | template family                  | a tool call as the model writes it                                  |
|-----------|----------------------------------|---------------------------------------------------------------------|
| `hermes`  | Hermes, Qwen2.5/Qwen3, tiny chat | `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`     |
| `llama3`  | Llama 3.1+ (JSON tool calling)   | `<|python_tag|>{"name": "f", "parameters": {...}}` (tag optional)    |
| `harmony` | gpt-oss                          | `<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>` |

`parser_for(tokenizer, name)` picks one: `name` (task.tool_parser) when not "auto", else by markers in the
template. Parsing only ever reads the sampled text: what is trained are the sampled ids, never a rendering of
the parsed calls. A reply that carries a tool-call marker but does not parse (bad JSON, no name, an unclosed
tag) raises `ToolCallParseError`; the endpoint returns it as plain content and counts it.

`check_history(messages)` validates the tool-calling parts of a request's messages (malformed arguments JSON, a
tool message answering no call) and returns them as templates read them (arguments as objects).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

PARSERS = ("hermes", "llama3", "harmony")


class ToolCallParseError(ValueError):
    """A reply with a tool-call marker whose call cannot be read."""


class ToolMessageError(ValueError):
    """A request's messages or tools that are not valid OpenAI tool calling (the message says which and why)."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict

    def openai(self, call_id: str) -> dict:
        """As OpenAI returns it: arguments as a JSON string."""
        return {"id": call_id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass(frozen=True)
class ParsedReply:
    content: str  # the text around the calls ("" when the reply is only calls)
    calls: tuple[ToolCall, ...]


def _call(obj, args_key: str = "arguments") -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ToolCallParseError(f"a tool call must be a JSON object with a string 'name', got {obj!r:.80}")
    args = _arguments(obj.get(args_key, obj.get("arguments", {})), ToolCallParseError,
                      f"tool call {obj['name']!r}: arguments")
    return ToolCall(obj["name"], args)


def _arguments(args, error: type[Exception], what: str) -> dict:
    """A call's arguments as an object: as written, or decoded from the JSON string models and OpenAI clients
    write; `error(what ...)` when they are neither."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as exc:
            raise error(f"{what} are malformed JSON ({exc})") from None
    if not isinstance(args, dict):
        raise error(f"{what} must be a JSON object, got {args!r:.80}")
    return args


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ToolCallParseError(f"tool call JSON does not parse: {exc}: {text[:80]!r}") from None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> ParsedReply | None:
    """`<tool_call>{json}</tool_call>` blocks (Hermes, Qwen); None when the reply holds no `<tool_call>`."""
    if "<tool_call>" not in text:
        return None
    if text.count("<tool_call>") != text.count("</tool_call>"):
        raise ToolCallParseError("a <tool_call> without its </tool_call> (the reply may have been cut at max_tokens)")
    calls = tuple(_call(_json(body)) for body in _HERMES.findall(text))
    return ParsedReply(text[:text.index("<tool_call>")].strip(), calls)


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3(text: str) -> ParsedReply | None:
    """Llama 3's JSON tool calls: the reply is `{"name": ..., "parameters": {...}}` (or several joined by ';'),
    optionally after `<|python_tag|>`; None when it is not (an answer)."""
    body = text.split(_PYTHON_TAG, 1)[1] if _PYTHON_TAG in text else text
    body = body.strip()
    if not (_PYTHON_TAG in text or body.startswith('{"name"') or body.startswith('{"type"')):
        return None
    decoder, calls, rest = json.JSONDecoder(), [], body
    while rest:
        try:
            obj, end = decoder.raw_decode(rest)
        except ValueError as exc:
            raise ToolCallParseError(f"tool call JSON does not parse: {exc}: {rest[:80]!r}") from None
        calls.append(_call(obj, "parameters"))
        rest = rest[end:].strip().lstrip(";").strip()
    return ParsedReply(text.split(_PYTHON_TAG, 1)[0].strip() if _PYTHON_TAG in text else "", tuple(calls))


_HARMONY_CALL = re.compile(r"to=functions\.([\w.\-]+)[^<]*(?:<\|channel\|>[^<]*)?(?:<\|constrain\|>[^<]*)?"
                           r"<\|message\|>(.*?)(?:<\|call\|>|<\|end\|>|$)", re.DOTALL)
_HARMONY_FINAL = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", re.DOTALL)


def parse_harmony(text: str) -> ParsedReply | None:
    """gpt-oss's harmony format: a message addressed `to=functions.NAME` is a call (its message the arguments
    JSON); the `final` channel is the content. None when no message is addressed to a function."""
    if "to=functions." not in text:
        return None
    calls = tuple(ToolCall(name, _call({"name": name, "arguments": _json(args.strip())}).arguments)
                  for name, args in _HARMONY_CALL.findall(text))
    if not calls:
        raise ToolCallParseError("a message addressed to=functions.<name> without <|message|> arguments")
    final = _HARMONY_FINAL.search(text)
    return ParsedReply(final.group(1).strip() if final else "", calls)


def settled_content(parser: str | None, text: str) -> str:
    """The start of a reply in progress that is its content whatever tokens follow: what a stream may send before
    the turn is complete. `text` is the reply so far, decoded without special tokens when parser is None (no tool
    parsing) and with them otherwise.

    Trailing whitespace and an incomplete UTF-8 character (U+FFFD) wait for what follows (decoding may join them
    with it). With a parser, content ends where a call may start: at the first `<` (every family's markers begin
    with one), and for llama3 a reply whose first character is `{` may be a call; a reply's leading whitespace
    waits until text follows it (a parsed reply's content is stripped)."""
    if parser is not None:
        text = text.split("<", 1)[0]
        if parser == "llama3" and text.lstrip().startswith("{"):
            return ""
    text = text.rstrip().rstrip("\ufffd").rstrip()
    return text if parser is None or text.strip() else ""


_PARSE = {"hermes": parse_hermes, "llama3": parse_llama3, "harmony": parse_harmony}


def family_of(template: str | None) -> str | None:
    """The tool-call parser a chat template's markers call for; None when it renders no tools."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|channel|>" in template:
        return "harmony"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return None


def parser_for(tokenizer, name: str = "auto"):
    """(parser name, parse function) for `name` (task.tool_parser), or by the tokenizer's chat template with
    "auto"; (None, None) when the template renders no tools in a known format ("none": tools refused)."""
    if name == "none":
        return None, None
    if name != "auto":
        if name not in _PARSE:
            raise ValueError(f"task.tool_parser must be auto, none or one of {', '.join(PARSERS)}, got {name!r}")
        return name, _PARSE[name]
    family = family_of(getattr(tokenizer, "chat_template", None))
    return (family, _PARSE[family]) if family else (None, None)


def check_tools(tools) -> list[dict]:
    """A request's `tools`, checked to be OpenAI function tools (what a chat template renders)."""
    if not isinstance(tools, list):
        raise ToolMessageError(f"tools must be a list of {{'type': 'function', 'function': {{...}}}}, got "
                               f"{type(tools).__name__}")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ToolMessageError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}, got {tool!r:.100}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolMessageError(f"tools[{i}].function.name must be a non-empty string")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise ToolMessageError(f"tools[{i}].function.parameters must be a JSON Schema object")
    return tools


def message_tool_calls(message: dict, index: int) -> list[dict] | None:
    """An assistant message's `tool_calls` as templates read them (function.arguments an object), None without."""
    calls = message.get("tool_calls")
    if calls is None or calls == []:
        return None
    if not isinstance(calls, list):
        raise ToolMessageError(f"messages[{index}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{index}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolMessageError(f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                                   f"'arguments': ...}}}}")
        args = _arguments(fn.get("arguments", "{}"), ToolMessageError, f"{where}.function.arguments")
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def check_history(messages: list) -> None:
    """Tool messages answer calls: one with a `tool_call_id` names an unanswered call of the assistant turn before
    it; one without is allowed only after an assistant turn that made no calls (a text protocol's tool result)."""
    pending: dict[str, str] | None = None  # call id -> name, of the latest assistant turn with calls
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue  # shape errors are the transcript's to report
        if m.get("role") == "assistant":
            calls = message_tool_calls(m, i)
            pending = {c["id"]: c["function"]["name"] for c in calls} if calls else None
        elif m.get("role") == "tool":
            call_id = m.get("tool_call_id")
            if call_id is None:
                if pending:
                    raise ToolMessageError(f"messages[{i}] (role tool) has no tool_call_id; the assistant turn "
                                           f"before it made calls {sorted(pending)}")
                continue
            if not pending or call_id not in pending:
                raise ToolMessageError(f"messages[{i}] (role tool) answers tool_call_id {str(call_id)[:64]!r}, which "
                                       f"matches no unanswered call of the assistant turn before it")
            del pending[call_id]
        elif pending is not None:
            pending = None  # a user turn moves on; unanswered calls stay unanswered
