"""The agent endpoint's HTTP side against what a hostile or broken local client sends, over real sockets.

The endpoint runs in-process (a real ThreadingHTTPServer on 127.0.0.1) with a handler that records what
reached it; tests/rollout/test_agent.py drives the same endpoint through AgentRunner and the `openai` client."""
import json
import re
import socket
import struct
import threading
import time
from http import HTTPStatus

import pytest

from megarl.rollout.agent_endpoint import ChatCompletionsEndpoint, EndpointError, EventStream, new_session_token

LIMIT = 1 << 20


@pytest.fixture
def served():
    token, reached, release = new_session_token(), [], threading.Event()

    def handle(session, body):
        reached.append(body)
        if body.get("wait"):
            release.wait(10)
            return {"data": "x" * (8 << 20)}  # more than loopback buffers hold: writing to a gone client fails
        return {"ok": True}

    endpoint = ChatCompletionsEndpoint(handle, lambda session: session == token, "tiny", LIMIT,
                                       read_timeout_s=0.5).start()
    yield endpoint, token, reached, release
    release.set()
    endpoint.close()


def exchange(port: int, head: str, body: bytes = b"") -> tuple[int, dict]:
    """Send raw bytes; the answer's status and JSON payload (a 5 s client timeout: a hang fails the test)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    head_bytes, _, payload = data.partition(b"\r\n\r\n")
    return int(head_bytes.split(b" ", 2)[1]), json.loads(payload)


def post(token: str, *headers: str) -> str:
    return "\r\n".join([f"POST /sessions/{token}/v1/chat/completions HTTP/1.1", "Host: x", *headers])


def test_malformed_requests_get_a_4xx_at_once_and_never_reach_the_handler(served):
    endpoint, token, reached, _ = served
    nested = b'{"messages": ' + b"[" * 40 + b"]" * 40 + b"}"
    cases = [
        (post(token), b"", 411, "length_required"),
        (post(token, "Content-Length: -1"), b"{}", 400, "invalid_content_length"),
        (post(token, "Content-Length: abc"), b"{}", 400, "invalid_content_length"),
        (post(token, "Content-Length: " + "9" * 40), b"{}", 413, "request_too_large"),
        (post(token, f"Content-Length: {LIMIT + 1}"), b"x" * 1000, 413, "request_too_large"),
        (post(token, "Content-Length: 1"), b"{", 400, "invalid_json"),
        (post(token, "Content-Length: 2"), b"\xff\xfe", 400, "invalid_json"),
        (post(token, "Content-Length: 200000"), b"[" * 100000 + b"]" * 100000, 400, "invalid_json"),
        (post(token, f"Content-Length: {len(nested)}"), nested, 400, "invalid_json"),
        (post(token, "Content-Length: 3"), b"[1]", 400, "invalid_json"),
        (post("s0-g0.0", "Content-Length: 2"), b"{}", 404, "session_not_found"),
        (f"GET /sessions/{new_session_token()}/v1/models HTTP/1.1\r\nHost: x", b"", 404, "session_not_found"),
        (post(token, "Content-Length: 100"), b"{" * 10, 408, "request_timeout"),  # the rest never comes
    ]
    for head, body, status, code in cases:
        answer = exchange(endpoint.port, head, body)
        assert answer == (status, {"error": {"message": answer[1]["error"]["message"], "type": "invalid_request_error",
                                             "param": None, "code": code}}), head
    assert reached == []
    assert "deeper than 32" in exchange(endpoint.port, post(token, f"Content-Length: {len(nested)}"), nested)[1][
        "error"]["message"]
    assert exchange(endpoint.port, f"GET /sessions/{token}/v1/models HTTP/1.1\r\nHost: x")[0] == 200
    assert exchange(endpoint.port, post(token, "Content-Length: 2"), b"{}") == (200, {"ok": True})
    assert reached == [{}]


@pytest.mark.parametrize("body, message", [
    (b'{"messages": [], "max_tokens": ' + b"9" * 4301 + b"}", "invalid JSON body: Exceeds the limit (4300 digits)"),
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "lone surrogate (U+D800 at offset 1)"),
    (b'{"messages": [{"\\udfff": "x"}]}', "lone surrogate (U+DFFF at offset 0)"),
])
def test_a_huge_integer_or_a_lone_surrogate_is_a_400_not_a_500(served, capfd, body, message):
    endpoint, token, reached, _ = served
    status, payload = exchange(endpoint.port, post(token, f"Content-Length: {len(body)}"), body)
    assert (status, payload["error"]["code"]) == (400, "invalid_json")
    assert message in payload["error"]["message"]
    assert reached == []
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


def test_each_client_disconnect_is_one_console_line_at_most_every_30s_not_a_traceback(served, capfd):
    endpoint, token, reached, release = served
    body = b'{"wait": true}'
    deadline = time.monotonic() + 10
    for i in range(5):
        sock = socket.create_connection(("127.0.0.1", endpoint.port), timeout=5.0)
        sock.sendall(post(token, f"Content-Length: {len(body)}").encode() + b"\r\n\r\n" + body)
        while len(reached) < i + 1:  # the handler has the request
            assert time.monotonic() < deadline, "the request did not reach the handler"
            time.sleep(0.01)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset, as when an agent is killed
    release.set()
    while endpoint.disconnected.count < 5:
        assert time.monotonic() < deadline, f"{endpoint.disconnected.count} of 5 disconnects reported"
        time.sleep(0.01)
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err
    [line] = [line for line in (out + err).splitlines() if line.strip()]
    assert re.fullmatch(r"megarl: agent endpoint: a client disconnected before its answer "
                        r"\((ConnectionResetError|BrokenPipeError)\); 1 so far", line)


@pytest.mark.parametrize("fails", [False, True], ids=["done", "error"])
def test_a_stream_frees_its_session_before_its_last_event_so_the_next_turn_is_never_refused(fails):
    """An agent sends its next turn as soon as it reads a stream's end ([DONE], or an error event): the stream's
    close (which frees the episode's session) has run by then. The close is made slow, so an end written before it
    would reach the client first."""
    token, closed = new_session_token(), threading.Event()

    def chunks():
        yield {"n": 1}
        if fails:
            raise EndpointError(HTTPStatus.GATEWAY_TIMEOUT, "no completion", kind="server_error")

    def close(disconnected):
        time.sleep(0.2)
        closed.set()

    endpoint = ChatCompletionsEndpoint(lambda session, body: EventStream(chunks(), close),
                                       lambda session: session == token, "tiny", LIMIT).start()
    try:
        with socket.create_connection(("127.0.0.1", endpoint.port), timeout=5.0) as sock:
            sock.sendall(post(token, "Content-Length: 2").encode() + b"\r\n\r\n{}")
            data = b""
            while not re.search(rb"data: (\[DONE\]|\{\"error\".*)\n\n", data):
                more = sock.recv(1 << 16)
                assert more, data
                data += more
            assert closed.is_set()
    finally:
        endpoint.close()
    assert (b"[DONE]" in data) != fails
