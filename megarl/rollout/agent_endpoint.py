"""The OpenAI-compatible chat-completions endpoint agent programs talk to (127.0.0.1 only).

    POST /sessions/<token>/v1/chat/completions   (the `openai` client's base_url: .../sessions/<token>/v1)
    GET  /sessions/<token>/v1/models

One session is one training episode (megarl/rollout/agent.py opens them). Its token is a secret
(`new_session_token`, 32 random bytes): the base URL is the credential, handed only to the agent that
runs the episode, so another local process can neither find a session nor inject a turn into it. The
token travels in the path rather than as the `openai` client's api_key (its `Authorization: Bearer`)
because every client takes a base URL and agents already pass it through unchanged.

This module owns the HTTP side only -- reading and checking a request, OpenAI's response and error
shapes, one console line per dropped connection -- and hands every request of an open session to
`handle(token, body) -> response dict` (or an `EventStream`: a `stream=true` reply as server-sent events, each
chunk written and flushed as it is produced), which raises `EndpointError` for an error response. What it
refuses before anything else runs: a body without a valid Content-Length (411, 400), over
`max_request_bytes` (413: nothing of it is parsed), a body that does not arrive within the read
timeout (408), invalid or deeply nested JSON, a huge integer literal or a lone surrogate (400), an
unknown session (404, for `/models` too).
Unsupported parameters are refused rather than ignored where ignoring them would change what the agent
gets (`n` > 1, a forced `tool_choice`, `response_format` other than text, `top_logprobs`); sampling parameters (temperature, top_p) are the run's, since the
behaviour log-probs the learner corrects for must be the run's policy's.
"""
from __future__ import annotations

import json
import logging
import re
import secrets
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable

from megarl.ratelimit import RateLimitedLine
from megarl.rollout.tool_calls import ToolCall, ToolMessageError, check_tools

log = logging.getLogger(__name__)

_ROUTE = re.compile(r"^/sessions/([^/]+)/v1/(chat/completions|models)$")
_SESSION_SEGMENT = re.compile(r"/sessions/[^/\s]+")
_DIGITS = re.compile(r"[0-9]{1,18}")
READ_TIMEOUT_S = 30.0  # a request's headers and body must arrive within this (a stalled client frees its thread)
MAX_JSON_DEPTH = 32  # a chat request nests 4 deep ({"messages": [{"content": ...}]}); deeper is refused
_DRAIN_BYTES = 64 << 20  # a refused body up to this size is read and discarded so the client sees the answer


def new_session_token() -> str:
    """An unguessable session token (256 bits, URL-safe: it is a path segment of the base URL)."""
    return secrets.token_urlsafe(32)


def max_request_bytes_for(max_seq_len: int) -> int:
    """The default body limit (task.agent_max_request_bytes = 0): 32 bytes per token of the context, at
    least 1 MiB. A request carries the whole history as JSON; English is ~4 bytes a token, JSON's \\uXXXX
    escapes of non-ASCII text up to ~12."""
    return max(1 << 20, 32 * max_seq_len)


class EndpointError(Exception):
    """An error response: HTTP status, OpenAI error type and code, and a message for the agent's author."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, address, handler, disconnected: RateLimitedLine):
        super().__init__(address, handler)
        self.disconnected = disconnected

    def handle_error(self, request, client_address):
        # socketserver prints a full traceback for any error that escapes a handler; a client that went
        # away is routine (an agent timed out or was killed) and gets one line.
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            self.disconnected(f"agent endpoint: a client disconnected ({type(exc).__name__})")
        else:
            log.error("agent endpoint: request from %s failed", client_address[0], exc_info=exc)


class ChatCompletionsEndpoint:
    def __init__(self, handle: Callable[[str, dict], dict | EventStream], is_open: Callable[[str], bool], model_name: str,
                 max_request_bytes: int, port: int = 0, read_timeout_s: float = READ_TIMEOUT_S):
        self.handle, self.is_open, self.model_name = handle, is_open, model_name
        self.max_request_bytes, self.read_timeout_s = max_request_bytes, read_timeout_s
        self.disconnected = RateLimitedLine()
        self.server = _Server(("127.0.0.1", port), self._handler(), self.disconnected)
        self.thread = threading.Thread(target=self.server.serve_forever, name="megarl-openai", daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def base_url(self, token: str) -> str:
        return f"http://127.0.0.1:{self.port}/sessions/{token}/v1"

    def start(self) -> "ChatCompletionsEndpoint":
        self.thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"
            timeout = endpoint.read_timeout_s  # every recv of the request line, headers and body

            def log_message(self, fmt, *args):
                log.debug("%s %s", self.address_string(), _redact(fmt % args))

            def do_GET(self):
                self._answer(self._models)

            def do_POST(self):
                self._answer(self._chat_completion)

            def _answer(self, respond: Callable[[], dict | EventStream]) -> None:
                self.body_pending = True  # unread (a refused request's body is drained after the answer)
                try:
                    status, payload = HTTPStatus.OK, respond()
                except ConnectionError as exc:
                    endpoint.disconnected(f"agent endpoint: a client disconnected while sending its request "
                                          f"({type(exc).__name__})")
                    return
                except EndpointError as exc:
                    status, payload = exc.status, _error_payload(exc)
                except Exception as exc:  # noqa: BLE001 - a bug must answer 500, not hang the agent
                    log.exception("agent endpoint: %s %s failed", self.command, _route_name(self.path))
                    status, payload = HTTPStatus.INTERNAL_SERVER_ERROR, _error_payload(
                        EndpointError(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}",
                                      kind="server_error"))
                try:
                    self._send(status, payload)
                    if self.body_pending:
                        self._drain()
                except (ConnectionError, TimeoutError) as exc:
                    endpoint.disconnected(f"agent endpoint: a client disconnected before its answer "
                                          f"({type(exc).__name__})")

            def _session(self, method: str) -> str:
                match = _ROUTE.match(self.path.split("?", 1)[0])
                if match is None or match.group(2) != method:
                    raise EndpointError(HTTPStatus.NOT_FOUND, f"no route {self.command} {_route_name(self.path)}; "
                                        f"megarl serves /sessions/<token>/v1/chat/completions and .../models",
                                        code="not_found")
                if not endpoint.is_open(match.group(1)):
                    raise EndpointError(HTTPStatus.NOT_FOUND, "no open session at this URL (its episode ended, or "
                                        "the URL is not one megarl handed out)", code="session_not_found")
                return match.group(1)

            def _models(self) -> dict:
                self._session("models")
                return {"object": "list", "data": [
                    {"id": endpoint.model_name, "object": "model", "created": 0, "owned_by": "megarl"}]}

            def _chat_completion(self) -> dict | EventStream:
                token = self._session("chat/completions")
                return endpoint.handle(token, parse_json_object(self._read_body()))

            def _read_body(self) -> bytes:
                """The body, checked against Content-Length and the size limit before any of it is read."""
                raw = self.headers.get("Content-Length")
                if raw is None:
                    raise EndpointError(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required",
                                        code="length_required")
                raw = raw.strip()
                if not raw.isascii() or not raw.isdigit():
                    raise EndpointError(HTTPStatus.BAD_REQUEST, f"Content-Length must be a non-negative integer, "
                                                                f"got {raw[:40]!r}", code="invalid_content_length")
                length = int(raw) if _DIGITS.fullmatch(raw) else None  # None: 19+ digits, over any limit
                if length is None or length > endpoint.max_request_bytes:
                    raise EndpointError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the request body of {raw[:40]} bytes "
                                        f"is over this endpoint's limit of {endpoint.max_request_bytes} bytes "
                                        f"(task.agent_max_request_bytes)", code="request_too_large")
                deadline, chunks, left = time.monotonic() + endpoint.read_timeout_s, [], length
                try:
                    while left:
                        if time.monotonic() > deadline:
                            raise TimeoutError
                        chunk = self.rfile.read1(min(left, 1 << 16))
                        if not chunk:
                            raise EndpointError(HTTPStatus.BAD_REQUEST, f"the body ended after {length - left} of "
                                                f"its {length} bytes (Content-Length)", code="incomplete_body")
                        chunks.append(chunk)
                        left -= len(chunk)
                except TimeoutError as exc:
                    self.body_pending = False  # a stalled client is not waited for twice
                    raise EndpointError(HTTPStatus.REQUEST_TIMEOUT, f"the body did not arrive within "
                                        f"{endpoint.read_timeout_s:g}s ({length - left} of {length} bytes)",
                                        code="request_timeout") from exc
                self.body_pending = False
                return b"".join(chunks)

            def _drain(self) -> None:
                """Read and discard a refused body (bounded in bytes and time) before closing: closing a socket
                with unread data resets it, and the client would see a broken connection, not the answer."""
                left = min(_content_length(self.headers) or 0, _DRAIN_BYTES)
                deadline = time.monotonic() + endpoint.read_timeout_s
                try:
                    self.connection.shutdown(socket.SHUT_WR)
                    while left > 0 and time.monotonic() < deadline:
                        chunk = self.rfile.read1(min(left, 1 << 16))
                        if not chunk:
                            break
                        left -= len(chunk)
                except OSError:
                    pass  # the client went away: nothing left to drain

            def _send(self, status, payload: dict | EventStream):
                if isinstance(payload, EventStream):
                    self._send_events(payload)
                    return
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()

            def _send_events(self, stream: EventStream) -> None:
                """Each chunk written and flushed as the stream yields it; the body ends when the connection
                closes (HTTP/1.0, no Content-Length). A client that went away raises ConnectionError here
                (checked before every write: on loopback the first write after a close succeeds) and the stream
                is closed as disconnected; an EndpointError from the stream becomes an `error` event, which the
                `openai` client raises as an APIError."""
                disconnected = True
                try:
                    self.send_response(HTTPStatus.OK)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Cache-Control", "no-cache")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.flush()
                    try:
                        for chunk in stream.chunks:
                            self._event(json.dumps(chunk).encode())
                    except EndpointError as exc:
                        last = json.dumps(_error_payload(exc)).encode()
                    else:
                        last = b"[DONE]"
                    # Closed before the last event: a client that sends its next turn as soon as it reads the end
                    # finds the session free (the turn is recorded; the last event carries nothing it depends on).
                    stream.close(False)
                    self._event(last)
                    disconnected = False
                finally:
                    stream.close(disconnected)

            def _event(self, data: bytes) -> None:
                if _peer_closed(self.connection):
                    raise ConnectionResetError("the client closed the connection mid-stream")
                self.wfile.write(b"data: " + data + b"\n\n")
                self.wfile.flush()

        return Handler


def _peer_closed(connection: socket.socket) -> bool:
    """Whether the client closed its end: the socket reads as end-of-file (its request was read whole, so
    nothing else is due from it)."""
    try:
        readable, _, _ = select.select([connection], [], [], 0)
        return bool(readable) and connection.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def _content_length(headers) -> int | None:
    raw = (headers.get("Content-Length") or "").strip()
    return int(raw) if _DIGITS.fullmatch(raw) else None


def _redact(text: str) -> str:
    """Text as it may be printed: a session token is a credential and never reaches a log or a message."""
    return _SESSION_SEGMENT.sub("/sessions/<token>", text)


def _route_name(path: str) -> str:
    return _redact(path.split("?", 1)[0])[:200]


def _error_payload(exc: EndpointError) -> dict:
    return {"error": {"message": str(exc), "type": exc.kind, "param": None, "code": exc.code}}


def parse_json_object(data: bytes) -> dict:
    """A request body as a JSON object; 400 for anything else, including nesting over MAX_JSON_DEPTH."""
    try:
        body = json.loads(data)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, and an int over Python's 4,300-digit limit
        raise EndpointError(HTTPStatus.BAD_REQUEST, f"invalid JSON body: {exc}"[:300], code="invalid_json") from exc
    except RecursionError as exc:  # the parser's own recursion guard: nesting deeper than Python's stack allows
        raise EndpointError(HTTPStatus.BAD_REQUEST, f"JSON nested deeper than {MAX_JSON_DEPTH} levels",
                            code="invalid_json") from exc
    if json_depth(body) > MAX_JSON_DEPTH:  # before anything (repr, templates) recurses into it
        raise EndpointError(HTTPStatus.BAD_REQUEST, f"JSON nested deeper than {MAX_JSON_DEPTH} levels",
                            code="invalid_json")
    if not isinstance(body, dict):
        raise EndpointError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object", code="invalid_json")
    _refuse_lone_surrogates(body)
    return body


def _refuse_lone_surrogates(value) -> None:
    """400 for a string (or key) holding a lone UTF-16 surrogate: JSON's `\\ud800` escape parses into one, and
    no tokenizer or UTF-8 encoder downstream accepts it. Iterative, as json_depth."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise EndpointError(HTTPStatus.BAD_REQUEST, f"a string holds a lone surrogate "
                                    f"(U+{ord(item[exc.start]):04X} at offset {exc.start}), which is not valid "
                                    f"Unicode text", code="invalid_json") from None


def json_depth(value) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        depth = max(depth, level)
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return depth


@dataclass(frozen=True)
class ChatRequest:
    """What megarl reads of a chat-completions body (check_request)."""
    messages: list
    tools: list | None = None  # OpenAI function tools: rendered by the chat template, replies parsed for calls
    parse_calls: bool = False  # tools given and tool_choice is not "none"
    stream: bool = False  # answer as server-sent events
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    logprobs: bool = False  # return each sampled token's behaviour log-prob


def check_request(body: dict) -> ChatRequest:
    """The request as megarl serves it, after refusing what it does not; EndpointError otherwise."""
    def unsupported(message: str):
        return EndpointError(HTTPStatus.BAD_REQUEST, message, code="unsupported_parameter")

    if body.get("n") not in (None, 1):
        raise unsupported("n must be 1: a session is one episode and one sample, and n samples of one turn would "
                          "branch it into n samples outside the learner's groups; run n sessions (algo.group_size "
                          "episodes of a prompt already are n samples of each turn)")
    if body.get("functions") or body.get("function_call"):
        raise unsupported("functions/function_call (OpenAI's deprecated form) are not supported: use tools")
    if body.get("top_logprobs"):
        raise unsupported("top_logprobs is not supported: logprobs=true returns each sampled token's log-prob")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type", "text") != "text"):
        raise unsupported("response_format must be text: constrained decoding would change the sampled policy "
                          "whose log-probs are trained")
    tools, choice = body.get("tools") or None, body.get("tool_choice", "auto")
    if tools is not None:
        try:
            check_tools(tools)
        except ToolMessageError as exc:
            raise EndpointError(HTTPStatus.BAD_REQUEST, str(exc), code="invalid_tools") from None
    if choice not in ("auto", "none", None):
        raise unsupported(f"tool_choice must be auto or none, got {json.dumps(choice)[:80]}: forcing a call would "
                          f"need constrained decoding, which changes the sampled policy whose log-probs are trained")
    stream = body.get("stream") or False
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise EndpointError(HTTPStatus.BAD_REQUEST, "stream must be a boolean and stream_options an object",
                            code="invalid_request")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EndpointError(HTTPStatus.BAD_REQUEST, "messages must be a non-empty list", code="invalid_messages")
    return ChatRequest(messages, tools, tools is not None and choice != "none", stream,
                       bool(options.get("include_usage")), body.get("logprobs") is True)


def completion_response(episode_key: str, turn: int, model: str, message: dict, finish_reason: str,
                        prompt_tokens: int, completion_tokens: int, logprobs: list[dict] | None = None) -> dict:
    """OpenAI's chat.completion object for one model turn (`message`: the transcript's assistant message)."""
    out = {"role": "assistant", "content": message["content"]}
    if message.get("tool_calls"):
        out["tool_calls"] = [ToolCall(c["function"]["name"], c["function"]["arguments"]).openai(c["id"])
                             for c in message["tool_calls"]]
        out["content"] = message["content"] or None
    reason = "length" if finish_reason == "length" else "tool_calls" if out.get("tool_calls") else "stop"
    return {
        "id": f"chatcmpl-{episode_key.replace('/', '.')}-{turn}", "object": "chat.completion", "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": out, "finish_reason": reason,
                     "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def logprob_entries(tokenizer, token_ids: list[int], logprobs: list[float]) -> list[dict]:
    """OpenAI's logprobs.content entries of sampled tokens (the behaviour log-probs; no top_logprobs)."""
    return [{"token": (text := tokenizer.decode([tid], skip_special_tokens=False)), "logprob": lp,
             "bytes": list(text.encode()), "top_logprobs": []} for tid, lp in zip(token_ids, logprobs)]


def chunk(head: dict, delta: dict | None, finish_reason: str | None = None, logprobs: list[dict] | None = None,
          usage: dict | None = None) -> dict:
    """One chat.completion.chunk (`head`: id, created, model). delta None: the usage chunk, with no choices."""
    body = {key: head[key] for key in ("id", "created", "model")}
    body["object"] = "chat.completion.chunk"
    body["choices"] = [] if delta is None else [{
        "index": 0, "delta": delta, "finish_reason": finish_reason,
        "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None}}]
    if usage is not None:
        body["usage"] = usage
    return body


def closing_chunks(response: dict, include_usage: bool) -> list[dict]:
    """The chunks that end a streamed turn, from its chat.completion: the tool calls (whole, as one tool_call delta
    each; they are parsed once the turn is complete), the finish reason, and with include_usage the usage."""
    [choice] = response["choices"]
    out = []
    if choice["message"].get("tool_calls"):
        out.append(chunk(response, {"tool_calls": [dict(call, index=i)
                                                   for i, call in enumerate(choice["message"]["tool_calls"])]}))
    out.append(chunk(response, {}, choice["finish_reason"]))
    if include_usage:
        out.append(chunk(response, None, usage=response["usage"]))
    return out


class EventStream:
    """A reply sent as server-sent events (`data: <json>` lines, then `data: [DONE]`), each chunk written as
    `chunks` yields it. `close(disconnected)` is called once the stream ends (before its last event), whether or
    not it was iterated: disconnected is True when the client went away (or the write failed) before the end."""

    def __init__(self, chunks: Iterable[dict], close: Callable[[bool], None] | None = None):
        self.chunks, self._close = chunks, close

    def close(self, disconnected: bool) -> None:
        """Calls `close` the first time only."""
        close, self._close = self._close, None
        if close is not None:
            close(disconnected)
