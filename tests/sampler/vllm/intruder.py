"""A local process that is not part of the run, calling a vLLM sampler server (run by test_vllm_engine.py).

Standard library only. argv: the server's socket path, then the calls to make ("pause", "join", "update",
"update_forged", "completions"). Prints one JSON object: call -> [HTTP status, body start] or the error name of
the connection attempt (e.g. "PermissionError")."""
from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import socket
import sys


class Conn(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=60)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(self.path)


def call(path, route, body):
    conn = Conn(path)
    try:
        conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return [resp.status, resp.read()[:400].decode(errors="replace")]
    except OSError as exc:
        return type(exc).__name__
    finally:
        conn.close()


def rpc(method, arg):
    return {"method": method, "args": [arg], "timeout": 30}


def main(path, calls):
    join = {"host": "127.0.0.1", "port": 1, "rank": 1, "world_size": 2, "timeout_s": 5}
    update = {"version": 99, "buckets": [{"nbytes": 256, "tensors": [["model.norm.weight", [64], "float32", 0]]}]}
    args = json.dumps(update)
    tag = hmac.new(b"guessed", json.dumps(["megarl_update", 10 ** 9, args]).encode(), hashlib.sha256).hexdigest()
    forged = json.dumps({"method": "megarl_update", "counter": 10 ** 9, "args": args, "tag": tag})
    bodies = {"pause": ("/pause?mode=keep", {}), "join": ("/collective_rpc", rpc("megarl_join", json.dumps(join))),
              "update": ("/collective_rpc", rpc("megarl_update", args)),
              "update_forged": ("/collective_rpc", rpc("megarl_update", forged)),
              "completions": ("/v1/completions", {"model": "megarl", "prompt": [1, 2], "max_tokens": 1})}
    print(json.dumps({name: call(path, *bodies[name]) for name in calls}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
