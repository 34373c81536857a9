"""An OpenAI-compatible chat-completions endpoint on a sampler, for agent programs (127.0.0.1 only).

    POST /sessions/<session>/v1/chat/completions   (the `openai` client's base_url: .../sessions/<session>/v1)
    GET  /sessions/<session>/v1/models

One session is one training episode (megarl/rollout/agent.py gives each its base URL). This module owns
the HTTP side only -- parsing, OpenAI's response and error shapes -- and hands every request to
`handle(session, body) -> response dict`, which raises `EndpointError` for an error response.
Unsupported parameters are refused rather than ignored where ignoring them would change what the agent
gets (`stream`, `n` > 1, `tools`); sampling parameters (temperature, top_p) are the run's, since the
behaviour log-probs the learner corrects for must be the run's policy's.
"""
from __future__ import annotations

import json
import logging
import re
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

log = logging.getLogger(__name__)

_ROUTE = re.compile(r"^/sessions/([A-Za-z0-9_.-]+)/v1/(chat/completions|models)$")


class EndpointError(Exception):
    """An error response: HTTP status, OpenAI error type and code, and a message for the agent's author."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256


class ChatCompletionsEndpoint:
    def __init__(self, handle: Callable[[str, dict], dict], model_name: str, port: int = 0):
        self.handle, self.model_name = handle, model_name
        self.server = _Server(("127.0.0.1", port), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, name="megarl-openai", daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def base_url(self, session: str) -> str:
        return f"http://127.0.0.1:{self.port}/sessions/{session}/v1"

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

            def log_message(self, fmt, *args):
                log.debug("%s " + fmt, self.address_string(), *args)

            def do_GET(self):
                match = _ROUTE.match(self.path.split("?", 1)[0])
                if match is None or match.group(2) != "models":
                    return self._error(EndpointError(HTTPStatus.NOT_FOUND, f"no route GET {self.path}", code="not_found"))
                self._send(HTTPStatus.OK, {"object": "list", "data": [
                    {"id": endpoint.model_name, "object": "model", "created": 0, "owned_by": "megarl"}]})

            def do_POST(self):
                match = _ROUTE.match(self.path.split("?", 1)[0])
                if match is None or match.group(2) != "chat/completions":
                    return self._error(EndpointError(HTTPStatus.NOT_FOUND, f"no route POST {self.path}; megarl serves "
                                                     f"/sessions/<session>/v1/chat/completions", code="not_found"))
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(length) or b"{}")
                    if not isinstance(body, dict):
                        raise EndpointError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
                    self._send(HTTPStatus.OK, endpoint.handle(match.group(1), body))
                except json.JSONDecodeError as exc:
                    self._error(EndpointError(HTTPStatus.BAD_REQUEST, f"invalid JSON body: {exc}"))
                except EndpointError as exc:
                    self._error(exc)
                except Exception as exc:  # noqa: BLE001 - a bug must answer 500, not hang the agent
                    log.exception("chat completion failed")
                    self._error(EndpointError(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}",
                                              kind="server_error"))

            def _error(self, exc: EndpointError):
                self._send(exc.status, {"error": {"message": str(exc), "type": exc.kind, "param": None, "code": exc.code}})

            def _send(self, status, payload: dict):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler


def check_request(body: dict) -> list:
    """The request's messages after refusing what megarl does not serve; EndpointError otherwise."""
    if body.get("stream"):
        raise EndpointError(HTTPStatus.BAD_REQUEST, "stream=true is not supported: megarl answers each turn whole",
                            code="unsupported_parameter")
    if body.get("n", 1) != 1:
        raise EndpointError(HTTPStatus.BAD_REQUEST, "n must be 1: one session is one episode (a group's episodes "
                                                    "are separate sessions)", code="unsupported_parameter")
    if body.get("tools") or body.get("functions"):
        raise EndpointError(HTTPStatus.BAD_REQUEST, "tools/functions are not supported: the model writes its tool "
                            "calls as text and the agent parses them", code="unsupported_parameter")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EndpointError(HTTPStatus.BAD_REQUEST, "messages must be a non-empty list", code="invalid_messages")
    return messages


def completion_response(session: str, turn: int, model: str, content: str, finish_reason: str,
                        prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's chat.completion object for one model turn."""
    return {
        "id": f"chatcmpl-{session}-{turn}", "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": "length" if finish_reason == "length" else "stop", "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }
