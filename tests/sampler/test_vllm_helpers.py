"""The vLLM engine's pure parts (no vLLM needed: runs in the main suite); the real server is tests/sampler/vllm/."""
from __future__ import annotations

import itertools
import json
import threading

import pytest
import torch

from megarl.config.load import ConfigError, load_config
from megarl.sampler import vllm_engine
from megarl.sampler.vllm_ext import megarl_vllm_worker as ext


def test_versions_from_swaps():
    f = vllm_engine.versions_from_swaps
    assert f(5, 3, []) == [3] * 5
    assert f(5, 0, [(1, 2)]) == [0, 0, 1, 1, 1]
    assert f(5, 0, [(1, 0)]) == [1] * 5  # not started at the update: every token is new
    assert f(4, 0, [(1, 4)]) == [0] * 4  # finished before it
    assert f(6, 2, [(3, 1), (4, 1), (5, 4)]) == [2, 4, 4, 4, 5, 5]
    with pytest.raises(ValueError, match="decrease"):
        f(6, 0, [(1, 3), (2, 2)])


def test_counts_by_server_id():
    counts = {"cmpl-megarl7-0-1a2b3c4d": 5, "cmpl-megarl12-0-ffffffff": 0, "other": 3}
    assert vllm_engine.counts_by_server_id(counts) == {"megarl7": 5, "megarl12": 0}


def test_bucket_plan_roundtrip():
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7), "c": torch.randn(40, 40), "d": torch.randn(2)}
    spec = [(n, list(t.shape), "float32") for n, t in tensors.items()]
    plan = ext.bucket_plan(spec, bucket_bytes=200)
    assert [[t[0] for t in b["tensors"]] for b in plan] == [["a", "b"], ["c"], ["d"]]  # big tensor alone
    for bucket in plan:
        buf = torch.cat([tensors[n].view(-1).view(torch.uint8) for n, *_ in bucket["tensors"]])
        assert buf.numel() == bucket["nbytes"]
        for name, t in ext.unpack(buf, bucket):
            assert torch.equal(t, tensors[name])


def test_server_env_and_command(tmp_path):
    from megarl.config.schema import VLLMConfig

    env = vllm_engine.server_env({"RANK": "1", "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_PORT": "1",
                                  "PYTHONPATH": "/megarl", "HOME": "/root", "VLLM_API_KEY": "inherited",
                                  ext.RPC_KEY_ENV: "inherited", "VLLM_RPC_BASE_PATH": "/tmp"}, VLLMConfig(), threads=2)
    assert "RANK" not in env and "TORCHELASTIC_USE_AGENT_STORE" not in env and "MASTER_PORT" not in env
    assert "VLLM_API_KEY" not in env and ext.RPC_KEY_ENV not in env and "VLLM_RPC_BASE_PATH" not in env
    assert env["PYTHONPATH"].split(":") == [str(vllm_engine.EXT_DIR), str(vllm_engine.PORTABLE_DIR)]
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["OMP_NUM_THREADS"] == "2" and env["HOME"] == "/root"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    cmd = vllm_engine.server_command("/env/python", tmp_path, "/run/s/http.sock", 0, max_model_len=64, max_num_seqs=8)
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert cmd[cmd.index("--uds") + 1] == "/run/s/http.sock"
    assert "--host" not in cmd and "--port" not in cmd  # no TCP listener: the dev-mode routes take no key
    assert cmd[cmd.index("--worker-extension-cls") + 1] == vllm_engine.WORKER_EXTENSION
    assert "--attention-backend" not in cmd
    # multi-latent attention: the reference CPU MLA backend, which takes the fp32 weights (AMX's packs bf16 only)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "kv_lora_rank": 512}))
    cmd = vllm_engine.server_command("/env/python", tmp_path, "/run/s/http.sock", 0, max_model_len=64, max_num_seqs=8)
    assert cmd[cmd.index("--attention-backend") + 1] == "CPU_MLA"


class _Untouchable:
    """A worker's model_runner that fails the test if a refused call reaches it."""

    def __getattr__(self, name):
        raise AssertionError(f"a refused call touched model_runner.{name}")


class _Worker(ext.MegarlWorkerExtension):
    def __init__(self):
        self.model_runner = _Untouchable()


def test_the_worker_extension_refuses_unsigned_forged_replayed_and_misdirected_calls(monkeypatch):
    """Every megarl_* method of the worker extension checks its call's HMAC (the server's MEGARL_VLLM_RPC_KEY)
    and counter before doing anything: the plain JSON a local process could post to /collective_rpc, a tag made
    with another key, a signed call replayed or sent to another method, and any call when the server has no key
    are refused (RpcRefused) without touching the model runner; the sampler's own signed calls are accepted."""
    # /collective_rpc calls any attribute of the worker by name: the extension adds only the guarded methods.
    assert [a for a in dir(ext.MegarlWorkerExtension) if not a.startswith("__")] == [
        "megarl_counts", "megarl_join", "megarl_lora_base", "megarl_update"]
    key = "k" * 64
    monkeypatch.setenv(ext.RPC_KEY_ENV, key)
    join = {"host": "127.0.0.1", "port": 1, "rank": 1, "world_size": 2, "timeout_s": 1}
    update = {"version": 1, "buckets": [{"nbytes": 4, "tensors": [["model.norm.weight", [1], "float32", 0]]}]}
    worker = _Worker()
    for method, args in (("megarl_join", join), ("megarl_update", update), ("megarl_lora_base", {"factor": 2.0}),
                         ("megarl_counts", {})):
        call = getattr(worker, method)
        with pytest.raises(ext.RpcRefused, match="not a signed call"):
            call(json.dumps(args))  # what the attacker sent: the unsigned arguments
        with pytest.raises(ext.RpcRefused, match="wrong signature"):
            call(ext.sign_call(b"not-the-key", method, 10 ** 9, args))
        forged = json.loads(ext.sign_call(key.encode(), method, 10 ** 9, args))
        forged["args"] = json.dumps({**args, "rank": 0})  # arguments changed under a valid tag
        with pytest.raises(ext.RpcRefused, match="wrong signature"):
            call(json.dumps(forged))
        with pytest.raises(ext.RpcRefused, match="signed for megarl_other"):
            call(ext.sign_call(key.encode(), "megarl_other", 10 ** 9, args))
        for junk in ("", "[]", "{}", None, '{"method": 1, "counter": 1, "args": "{}", "tag": ""}'):
            with pytest.raises(ext.RpcRefused):
                call(junk)

    accepted = _Worker()
    accepted.model_runner = type("Runner", (), {"requests": {"r1": type("S", (), {"output_token_ids": [5, 6]})()}})()
    assert accepted.megarl_counts(ext.sign_call(key.encode(), "megarl_counts", 1, {})) == {"r1": 2}
    assert accepted.megarl_counts(ext.sign_call(key.encode(), "megarl_counts", 5, {})) == {"r1": 2}
    for counter in (5, 4):  # the same call again, or an older one
        with pytest.raises(ext.RpcRefused, match=f"counter {counter} is not above the last accepted 5"):
            accepted.megarl_counts(ext.sign_call(key.encode(), "megarl_counts", counter, {}))

    monkeypatch.delenv(ext.RPC_KEY_ENV)
    with pytest.raises(ext.RpcRefused, match=f"{ext.RPC_KEY_ENV} is not set"):
        _Worker().megarl_counts(ext.sign_call(b"", "megarl_counts", 1, {}))


def test_the_sampler_signs_its_worker_calls_with_increasing_counters():
    """VLLMEngine._rpc sends each call as sign_call(server key, method, next counter, args)."""
    sent = []

    class Client:
        def post(self, route, body, timeout_s):
            sent.append(body)
            return {"results": [{"ok": True}]}

    engine = object.__new__(vllm_engine.VLLMEngine)
    engine.client, engine._rpc_key, engine._rpc_counter = Client(), b"key", itertools.count(1)
    engine._rpc_lock = threading.Lock()
    engine._rpc("megarl_counts", {}, 5.0)
    engine._rpc("megarl_join", {"rank": 1}, 5.0)
    guard = ext.RpcGuard("key")
    assert [guard.open(b["method"], b["args"][0]) for b in sent] == [{}, {"rank": 1}]


def test_an_evaluation_view_shares_the_rpc_counter_and_leaves_the_socket(tmp_path):
    """A pinned view (an evaluation's) signs with the engine's own counter, and closing it keeps the server's
    socket directory (the engine's, removed only by the engine's close)."""
    from megarl.sampler.request_pool import RequestPool

    engine = object.__new__(vllm_engine.VLLMEngine)
    engine.requests, engine.server, engine._closed = RequestPool(1, "vllm"), None, False
    engine._rpc_counter, engine.socket_dir = itertools.count(1), vllm_engine.SocketDir(str(tmp_path))
    view = engine.pinned(max_running=1, seed=0)
    assert [next(engine._rpc_counter), next(view._rpc_counter), next(engine._rpc_counter)] == [1, 2, 3]
    view.close()
    assert engine.socket_dir.dir.is_dir()
    engine.close()
    assert not engine.socket_dir.dir.exists()


def test_socket_dir_is_owner_only_and_http_runs_over_it(tmp_path):
    """The vLLM server's socket lies in a fresh 0700 directory; megarl's HTTP client talks over the socket."""
    import http.server
    import os
    import socketserver
    import stat
    import threading

    from megarl.sampler import sglang_engine

    sockets = vllm_engine.SocketDir(str(tmp_path))
    assert stat.S_IMODE(os.stat(sockets.dir).st_mode) == 0o700 and sockets.dir.parent == tmp_path
    assert sockets.path == str(sockets.dir / "http.sock")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            out = json.dumps({"path": self.path, "body": json.loads(body),
                              "auth": self.headers.get("Authorization")}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    class Server(socketserver.UnixStreamServer):
        def get_request(self):  # BaseHTTPRequestHandler wants a (host, port) client address
            conn, _ = super().get_request()
            return conn, ("local", 0)

    server = Server(sockets.path, Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = sglang_engine.HTTPClient("", 0, 10.0, api_key="abc", uds=sockets.path)
        assert client.url == f"unix:{sockets.path}"
        assert client.post("/pause?mode=keep", {"x": 1}) == {"path": "/pause?mode=keep", "body": {"x": 1},
                                                              "auth": "Bearer abc"}
    finally:
        server.shutdown()
        server.server_close()
    sockets.remove()
    assert not sockets.dir.exists()
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    with pytest.raises(ValueError, match="longer than 107 bytes.*TMPDIR"):
        vllm_engine.SocketDir(str(deep))
    assert list(deep.iterdir()) == []  # the directory it made is gone again


def test_the_worker_extension_imports_without_megarl():
    """The server's python finds the worker extension and the LoRA merge it runs on the PYTHONPATH megarl gives it,
    with megarl itself unimportable (it is not installed in the vLLM environment)."""
    import os
    import subprocess
    import sys

    from megarl.config.schema import VLLMConfig

    env = vllm_engine.server_env(dict(os.environ), VLLMConfig(), threads=1)
    code = ("import sys; sys.modules['megarl'] = None\n"  # any `import megarl...` now raises ImportError
            "import megarl_vllm_worker as w; print(w.lora_merge.__file__)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(vllm_engine.PORTABLE_DIR / "lora_merge.py")


def test_check_model_head_dim():
    vllm_engine.check_model({"hidden_size": 64, "num_attention_heads": 2})
    with pytest.raises(ValueError, match="head_dim 16 < 32"):
        vllm_engine.check_model({"hidden_size": 64, "num_attention_heads": 4})


def test_config_picks_the_vllm_variant_and_refuses_truncation():
    cfg = load_config("configs/demo.yaml", ["sampler.engine=vllm"])
    assert cfg.model.path == "embedded:tiny-qwen2-count-hd32"
    assert load_config("configs/demo.yaml").model.path == "embedded:tiny-qwen2-count"
    with pytest.raises(ConfigError, match="sampling.top_p"):
        load_config("configs/demo.yaml", ["sampler.engine=vllm", "sampling.top_p=0.9"])
    assert load_config("configs/demo.yaml", ["sampler.engine=vllm",
                                             "sampler.kv_on_update=recompute"]).sampler.kv_on_update == "recompute"
    load_config("configs/demo.yaml", ["sampler.engine=vllm", "sampler.kv_on_update=recompute",
                                      "sampler.vllm.prefix_caching=true"])
    with pytest.raises(ConfigError, match="sampler.vllm.prefix_caching: needs sampler.kv_on_update=recompute"):
        load_config("configs/demo.yaml", ["sampler.engine=vllm", "sampler.vllm.prefix_caching=true"])
    with pytest.raises(ConfigError, match="sampler.vllm.server_args"):
        load_config("configs/demo.yaml", ["sampler.engine=vllm", "sampler.vllm.server_args=[--max-model-len=9]"])
    with pytest.raises(ConfigError, match="sampler.vllm.server_args.*--uds"):
        load_config("configs/demo.yaml", ["sampler.engine=vllm", "sampler.vllm.server_args=[--uds,/tmp/s]"])


def test_vllm_variant_has_head_dim_32():
    from megarl.embedded import registry as embedded
    from megarl.embedded import tiny

    spec = embedded.EMBEDDED_MODELS["tiny-qwen2-count-hd32"]
    cfg = tiny.build_config(**dict(spec.config))
    assert cfg.hidden_size // cfg.num_attention_heads == 32
    # its own directory (the hash covers the config), same task and recipe as the demo's model
    demo = embedded.EMBEDDED_MODELS["tiny-qwen2-count"]
    assert embedded._spec_hash(spec) != embedded._spec_hash(demo)
    assert (spec.task, spec.recipe, spec.max_new_tokens) == (demo.task, demo.recipe, demo.max_new_tokens)
