"""SGLangEngine: the Engine protocol over an SGLang server, weights applied in flight, failures named.

The server is megarl's SGLang-compatible one (a real process); weights come from a separate learner
process over SGLang's update group; the end-to-end runs are real `megarl train` launches.
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from megarl.config.load import load_config
from megarl.distributed import lifetime
from megarl.distributed.lifetime import StopRequested
from megarl.distributed.sglang_publish import free_port
from megarl.distributed.ranks import Topology
from megarl.protocols import Engine, GenerationRequest, SamplingParams
from megarl.sampler.model import load_pretrained
from megarl.sampler.sglang_engine import (
    SUPPORTED_VERSIONS, HTTPClient, SGLangEngine, SGLangError, SGLangWeightFollower, ServerProcess,
    check_server_version, completion_from_chunks, generate_body, server_command, server_env, versions_from_spans,
    versions_from_stamps, new_api_key, write_secret_args)
from tests.helpers import REPO, run_python
from tests.sampler import make_tiny_model
from tests.sampler.sglang_support import ENV, hf_logprobs, start_learner, token_logprobs

CONTEXT = 512
TOPO = Topology(rank=1, world_size=2, num_learners=1, num_samplers=1)
ARITHMETIC = str(REPO / "configs" / "arithmetic.yaml")  # the config the think model the tests use was built for
BOOTSTRAP = Path(__file__).parent / "sglang_bootstrap.py"


def sglang_config(run_dir: Path, model_dir: Path, *overrides: str):
    return load_config(None, [f"run.dir={run_dir}", f"model.path={model_dir}", "sampler.engine=sglang",
                              f"sampler.max_seq_len={CONTEXT}", "sampler.max_running=8", *overrides])


def request(rid: str, max_new_tokens: int, stop=()) -> GenerationRequest:
    return GenerationRequest(rid, [1, 5, 9, 2], SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens),
                             tuple(stop))


def run_until_done(engine: SGLangEngine, timeout_s: float = 60) -> dict[str, object]:
    done, deadline = {}, time.monotonic() + timeout_s
    while engine.num_unfinished:
        assert time.monotonic() < deadline, "requests did not finish"
        done.update((c.request_id, c) for c in engine.step())
    return done


def decoded(engine: SGLangEngine) -> int:
    """Tokens the server's engine has decoded so far (megarl's server reports its engine stats)."""
    return json.loads(engine.client.get("/server_info")[1])["internal_states"][0]["tokens_decoded"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sglang_model"), "qwen2", max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    engine = SGLangEngine.from_config(sglang_config(tmp_path_factory.mktemp("run"), model_dir), TOPO, model_dir)
    yield engine
    engine.close()


# ---------------------------------------------------------------------------------------------- pure parts
def test_per_token_versions_come_from_spans_or_else_from_the_first_chunk_delivering_each_token():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert versions_from_spans(spans, 5) == [3, 3, 4, 4, 4]
    with pytest.raises(ValueError, match="cover 5 tokens"):
        versions_from_spans(spans, 6)
    # Cumulative chunks of 1, 3, 3 (a chunk with nothing new) and 5 tokens, the label changing after the 3rd.
    assert versions_from_stamps([(1, "3"), (3, "3"), (3, "4"), (5, "4")], 5) == [3, 3, 3, 4, 4]


def sglang_chunk(n: int, label: str, reason=None, output_ids=None) -> dict:
    """SGLang 0.5.x's default stream chunk after n tokens (10, 11, ... with log-probs -1, -2, ...):
    cumulative output_ids and output_token_logprobs, no weight_versions spans."""
    triples = [[-1.0 - i, 10 + i, None] for i in range(n)]
    return {"output_ids": [10 + i for i in range(n)] if output_ids is None else output_ids,
            "meta_info": {"id": "r", "finish_reason": reason, "weight_version": label, "completion_tokens": n,
                          "output_token_logprobs": triples}}


def test_completion_takes_token_ids_and_logprobs_from_output_token_logprobs():
    req = request("r", 3, stop=(12,))
    # No spans: each token takes the label of the first chunk delivering it; output_ids may stop-trim
    # the matched stop token.
    chunks = [sglang_chunk(1, "0"), sglang_chunk(2, "1"), sglang_chunk(3, "1", {"type": "stop", "matched": 12}, [10, 11])]
    c = completion_from_chunks(req, iter(chunks))  # read as they come
    assert (c.token_ids, c.logprobs, c.versions, c.finish_reason) == ([10, 11, 12], [-1.0, -2.0, -3.0], [0, 1, 1], "stop")
    # Chunks skipped by a slow reader change nothing but the labels' granularity.
    assert completion_from_chunks(req, chunks[1:]).versions == [1, 1, 1]
    # Incremental chunks (a server run with --incremental-streaming-output) are refused, naming the flag.
    delta = sglang_chunk(3, "0", {"type": "length", "length": 3}, output_ids=[12])
    delta["meta_info"]["output_token_logprobs"] = [[-3.0, 12, None]]
    with pytest.raises(ValueError, match="incremental-streaming-output"):
        completion_from_chunks(req, [sglang_chunk(2, "0"), delta])


def test_an_aborted_stream_gives_its_partial_output_with_finish_reason_abort():
    req = request("r", 8)
    abort = {"type": "abort", "message": None, "status_code": None, "err_type": None}
    c = completion_from_chunks(req, [sglang_chunk(1, "0"), sglang_chunk(2, "0"), sglang_chunk(3, "1", abort)])
    assert (c.token_ids, c.logprobs, c.versions, c.finish_reason) == ([10, 11, 12], [-1.0, -2.0, -3.0], [0, 0, 1], "abort")
    # SGLang's abort of a streamed request from its waiting queue sends only the last output id
    # (tokenizer_manager._handle_abort_req); the log-probs still carry every token.
    c = completion_from_chunks(req, [sglang_chunk(2, "0"), sglang_chunk(2, "0", abort, output_ids=[11])])
    assert (c.token_ids, c.finish_reason) == ([10, 11], "abort")
    assert completion_from_chunks(req, [sglang_chunk(0, "0", abort)]).token_ids == []


def test_client_reads_chunked_streams_of_cumulative_chunks_as_sglangs_uvicorn_sends_them():
    """Real SGLang streams with chunked transfer encoding, one cumulative chunk per token and no
    weight_versions spans in 0.5.x; chunk boundaries need not match SSE lines."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    def chunk(n, label, done=False):
        return b"data: " + json.dumps(sglang_chunk(n, label, {"type": "length", "length": 3} if done else None)).encode()

    body = b"\n\n".join([chunk(1, "4"), chunk(2, "4"), chunk(3, "5", done=True), b"data: [DONE]"]) + b"\n\n"

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(body), 37):  # pieces that cut lines
                piece = body[i:i + 37]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = HTTPClient("127.0.0.1", httpd.server_address[1], 10)
        chunks = list(client.stream("/generate", generate_body(request("r", 3), CONTEXT)))
    finally:
        httpd.shutdown()
    c = completion_from_chunks(request("r", 3), chunks)
    assert (c.token_ids, c.logprobs, c.versions) == ([10, 11, 12], [-1.0, -2.0, -3.0], [4, 4, 5])


def test_request_body_and_server_commands(tmp_path):
    body = generate_body(GenerationRequest("g/1", [1, 2], SamplingParams(top_k=0, max_new_tokens=9), (5,)), 64)
    assert body["rid"] == "g/1" and body["input_ids"] == [1, 2] and body["return_logprob"] and body["stream"]
    assert body["sampling_params"]["top_k"] == -1 and body["sampling_params"]["stop_token_ids"] == [5]
    assert body["sampling_params"]["max_new_tokens"] == 9
    # SGLang refuses prompt + max_new_tokens > context: the budget is what the context leaves.
    body = generate_body(GenerationRequest("g/2", [1] * 60, SamplingParams(max_new_tokens=9)), 64)
    assert body["sampling_params"]["max_new_tokens"] == 4
    cfg = sglang_config(tmp_path, tmp_path, "sampler.kv_on_update=recompute", "sampler.sglang.server_args=[--x]")
    builtin = server_command(cfg, "/m", 1234, seed=7)
    assert builtin[1:3] == ["-m", "megarl.sampler.sglang_server"]
    assert builtin[-3:] == ["--kv-on-update", "recompute", "--x"]
    assert {"--disable-overlap-schedule", "--disable-radix-cache"} <= set(builtin)  # exact spans; retract recomputes
    cfg = sglang_config(tmp_path, tmp_path, "sampler.sglang.server=sglang", "sampler.sglang.tp=2")
    real = server_command(cfg, "/m", 1234, seed=7)
    assert real[1:3] == ["-m", "sglang.launch_server"] and "--kv-on-update" not in real
    assert "--disable-overlap-schedule" in real and "--disable-radix-cache" not in real  # in_place keeps the cache
    for flag, value in [("--port", "1234"), ("--host", "127.0.0.1"), ("--tp-size", "2"), ("--weight-version", "0"),
                        ("--context-length", str(CONTEXT))]:
        assert real[real.index(flag) + 1] == value
    # The api key travels in an owner-only flags file, never on the command line (readable by every user); hex,
    # since SGLang's --config would make a key starting with "-" a missing value.
    assert all(len(k) == 64 and set(k) <= set("0123456789abcdef") for k in (new_api_key() for _ in range(100)))
    secret = write_secret_args(tmp_path / "s" / "secret.yaml", "the-key")
    assert os.stat(secret).st_mode & 0o777 == 0o600 and secret.read_text() == 'api-key: "the-key"\n'
    with_key = server_command(cfg, "/m", 1234, seed=7, secret_args=secret)
    assert with_key[with_key.index("--config") + 1] == str(secret) and "the-key" not in " ".join(with_key)


def test_per_tensor_updates_come_in_calls_no_bigger_than_a_bucket():
    """SGLang allocates every tensor of a call before loading any: one call of the whole model would be a
    second model copy on its GPU."""
    from megarl.distributed.sglang_publish import plan_update_calls

    spec = [(f"w{i}", (100, 10), torch.float32) for i in range(10)] + [("big", (1000, 10), torch.bfloat16)]
    calls = plan_update_calls(spec, "per_tensor", bucket_bytes=8000)  # two 4000-byte tensors per call
    assert [[n for n, _, _ in c] for c in calls] == [[f"w{i}", f"w{i + 1}"] for i in range(0, 10, 2)] + [["big"]]


def test_the_learner_sets_sglangs_nccl_settings():
    from megarl.distributed.sglang_publish import set_publish_nccl_env

    env = {"NCCL_CUMEM_ENABLE": "1"}
    set_publish_nccl_env(env)
    assert env == {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}


def test_only_supported_sglang_releases_are_accepted_naming_version_and_range():
    for ok in (*SUPPORTED_VERSIONS, "0.5.22", "0.5.23.post1"):
        check_server_version(ok)
    for bad in ("0.5.20", "0.5.6", "0.5.24", "0.6.0", "0.0.0.dev0", "megarl-builtin"):
        with pytest.raises(SGLangError, match=rf"version '{bad}'; megarl supports SGLang 0\.5\.21 to 0\.5\.23"):
            check_server_version(bad, "http://x")


def test_the_server_environment_has_no_torchrun_variables():
    env = {"PATH": "/bin", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "h",
           "MASTER_PORT": "1", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "0", "ROLE_RANK": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "2",
           "CUDA_VISIBLE_DEVICES": "3", "OMP_NUM_THREADS": "1"}
    assert server_env(env) == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "3", "OMP_NUM_THREADS": "1"}


def test_a_child_of_a_torchrun_worker_bootstraps_torch_distributed_as_sglang_does_only_with_the_clean_env(tmp_path):
    """SGLang's model runner runs init_process_group(init_method=tcp://127.0.0.1:port, world_size=tp) even at
    TP 1. From a torchrun worker's environment (TORCHELASTIC_USE_AGENT_STORE=True) that rank becomes a client
    of a store nobody hosts and times out; from server_env(...) it starts at once."""
    proc = run_python("-m", "torch.distributed.run", "--nproc-per-node=1", str(BOOTSTRAP), timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cleaned"] == "ok" and result["inherited"].startswith("failed"), result


def test_impossible_sglang_settings_are_refused_naming_the_key(tmp_path):
    from megarl.config.load import ConfigError

    for override, key in [("sampling.top_p=0.9", "sampling.top_p"), ("sampling.top_k=20", "sampling.top_k"),
                          ("sampler.sglang.tp=2", "sampler.sglang.tp"),  # the built-in server is one process
                          ("sampler.sglang.cache_on_update=drop", "sampler.sglang.cache_on_update"),
                          ("sampler.sglang.weight_format=npz", "sampler.sglang.weight_format"),
                          ("sampler.sglang.request_timeout_s=0", "sampler.sglang.request_timeout_s"),
                          ("sampler.sglang.min_new_tokens=0", "sampler.sglang.min_new_tokens"),
                          # the context is sampler.max_seq_len, which every request's budget is computed from
                          ("sampler.sglang.server_args=[--context-length,99]", "sampler.sglang.server_args")]:
        with pytest.raises(ConfigError, match=f"^{key}:"):
            sglang_config(tmp_path, tmp_path, override)
    sglang_config(tmp_path, tmp_path, "sampler.sglang.server=sglang", "sampler.sglang.tp=2")  # fine with SGLang


def test_a_model_real_sglang_would_load_wrongly_is_refused_before_its_server_starts(tmp_path):
    """sampler.sglang.server=sglang: a tied Mixtral or Qwen3-MoE (SGLang's classes leave lm_head unwritten) and a
    DeepSeek-V3 config.json without the fields SGLang builds it from are refused naming the field (what SGLang does
    with each: tests/sampler/sglang_contract/test_family_loads.py); the built-in server takes them."""
    for kind, field in [("mixtral", "tie_word_embeddings"), ("qwen3_moe", "tie_word_embeddings"),
                        ("deepseek_v3", "moe_layer_freq")]:
        model = make_tiny_model(tmp_path / kind, kind)
        with pytest.raises(ValueError, match=f"sampler.sglang.server=sglang: .*{field}"):
            SGLangEngine.from_config(sglang_config(tmp_path / "run", model, "sampler.sglang.server=sglang"), TOPO,
                                     model)


# ---------------------------------------------------------------------------------------------- against a server
def test_generates_with_behaviour_logprobs_of_the_served_weights(engine, model_dir):
    assert isinstance(engine, Engine) and engine.version == 0
    for i in range(12):  # more than max_running=8: the rest queue on the client
        engine.add_request(request(f"a/{i}", 20))
    done = run_until_done(engine)
    assert sorted(done) == sorted(f"a/{i}" for i in range(12)) and engine.num_unfinished == 0
    weights = load_pretrained(str(model_dir))[1]
    for c in done.values():
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions) == 20 or c.finish_reason == "stop"
        assert c.versions == [0] * len(c.token_ids)
        lp, _ = hf_logprobs(model_dir, weights, c.prompt_ids + c.token_ids)
        assert (token_logprobs(lp, c.prompt_ids + c.token_ids, 4) - torch.tensor(c.logprobs)).abs().max() < 1e-4
    assert engine.stats()["tokens_decoded"] == sum(len(c.token_ids) for c in done.values())


def test_requests_get_the_length_budget_the_context_leaves(engine):
    """The server refuses prompt + max_new_tokens > --context-length (as SGLang): megarl asks for what fits."""
    long = GenerationRequest("long", [3] * 500, SamplingParams(temperature=1.0, max_new_tokens=1000))
    engine.add_request(long)
    c = run_until_done(engine)["long"]
    assert len(c.token_ids) == CONTEXT - 500 or c.finish_reason == "stop"
    with pytest.raises(ValueError, match=r"leaves 0 of sampler.max_seq_len=512, fewer than "
                                         r"sampler.sglang.min_new_tokens=1"):
        engine.add_request(GenerationRequest("full", [3] * CONTEXT, SamplingParams(max_new_tokens=4)))


def test_follower_applies_a_published_version_in_flight(engine, model_dir, tmp_path):
    """Learner process -> SGLang update group -> server, driven by SGLangWeightFollower from the store
    headers; requests running across the update come back with both versions, none restarted."""
    store_port = free_port("127.0.0.1")
    store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    learner = start_learner(model_dir, tmp_path / "w.safetensors", free_port("127.0.0.1"), 2, "flattened_bucket", 1,
                            store_port=store_port)
    published, stop = [], threading.Event()
    follower = SGLangWeightFollower(engine, store, rank_offset=1, on_published=lambda v, e: published.append((v, e)),
                                    should_stop=stop.is_set).start()
    try:
        deadline = time.monotonic() + 60
        while engine.group_name is None:  # joined the learner's group
            assert follower.error is None and time.monotonic() < deadline, follower.error
            time.sleep(0.01)
        before = decoded(engine)
        for i in range(4):
            engine.add_request(request(f"b/{i}", 480))
        while decoded(engine) < before + 40:  # they are all decoding
            assert time.monotonic() < deadline
            time.sleep(0.002)
        store.set("test/go", "1")
        done = run_until_done(engine)
        while not published:
            assert follower.error is None and time.monotonic() < deadline, follower.error
            time.sleep(0.01)
        assert learner.wait(60) == 0, learner.stdout.read()
    finally:
        stop.set()
        follower.join(10)
        learner.kill()
    assert follower.error is None
    assert published == [(1, {"retired": {"1": 1}})] and engine.version == 1 and engine.stats()["swaps"] == 1
    spanning = [c for c in done.values() if set(c.versions) == {0, 1}]
    assert spanning, [c.versions.count(0) for c in done.values()]
    for c in done.values():
        assert len(c.token_ids) == 480 and c.versions == sorted(c.versions)  # whole, versions never decrease


def test_a_multi_chunk_stream_assembles_as_the_single_response(engine):
    """From the server: a greedy request streamed as many cumulative chunks gives the same Completion as
    its last chunk alone and as the non-streamed response; without weight_versions spans (SGLang 0.5.x)
    the chunks' labels give the same versions."""
    r = GenerationRequest("m", [1, 5, 9, 2], SamplingParams(temperature=0.0, max_new_tokens=200))
    body = generate_body(r, CONTEXT)
    body["sampling_params"]["ignore_eos"] = True
    chunks = list(engine.client.stream("/generate", body))
    assert len(chunks) > 10
    streamed = completion_from_chunks(r, chunks)
    assert len(streamed.token_ids) == 200 and streamed.versions == [engine.version] * 200
    assert completion_from_chunks(r, chunks[-1:]) == streamed
    assert completion_from_chunks(r, [engine.client.post("/generate", {**body, "stream": False})]) == streamed
    unspanned = [{**c, "meta_info": {k: v for k, v in c["meta_info"].items() if k != "weight_versions"}} for c in chunks]
    assert completion_from_chunks(r, unspanned) == streamed


def test_a_request_the_server_aborts_fails_naming_its_partial_output(engine):
    """megarl never pauses with mode abort; a request someone else aborts is an error, not a rollout.

    The request is first frozen mid-decode by the engine's own pause mode, so it cannot run to its end before the
    abort (under load, a test thread can sleep through all its tokens); should it end before that pause, the next
    attempt has a new request."""
    for attempt in range(3):
        before = decoded(engine)
        engine.add_request(request(f"x{attempt}", 480))
        deadline = time.monotonic() + 30
        while decoded(engine) < before + 10:
            assert time.monotonic() < deadline, "the request never started decoding"
            time.sleep(0.002)
        engine.client.post("/pause_generation", {"mode": engine.pause_mode})
        if decoded(engine) < before + 480:  # paused before its last token: it is running, frozen
            break
        engine.client.post("/continue_generation", {})
        run_until_done(engine)
    else:
        pytest.fail("each of 3 requests ran to its end before the pause")
    engine.client.post("/pause_generation", {"mode": "abort"})
    engine.client.post("/continue_generation", {})
    with pytest.raises(SGLangError, match=rf"request x{attempt} was aborted by the server after \d+ tokens"):
        run_until_done(engine)
    assert engine.num_unfinished == 0


# ---------------------------------------------------------------------------------------------- failures
def test_a_server_that_fails_to_start_raises_with_its_log_tail(tmp_path):
    cfg = sglang_config(tmp_path, tmp_path / "no_model", "sampler.sglang.startup_timeout_s=60")
    start = time.monotonic()
    with pytest.raises(SGLangError, match="exited with code 1") as err:
        SGLangEngine.from_config(cfg, TOPO, tmp_path / "no_model")
    assert "last " in str(err.value) and "no_model" in str(err.value) and time.monotonic() - start < 60


def test_a_port_taken_before_the_server_binds_it_is_replaced_by_another(model_dir, tmp_path, monkeypatch, capsys):
    """sampler.sglang.port=0 picks a port that was free a moment ago; another process may bind it first. The
    server exits with EADDRINUSE and is started again on another port, which the engine then talks to."""
    import socket

    from megarl.distributed import sglang_publish

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    picks = iter([taken_port])
    real_free_port = sglang_publish.free_port
    monkeypatch.setattr(sglang_publish, "free_port", lambda host: next(picks, None) or real_free_port(host))
    try:
        engine = SGLangEngine.from_config(sglang_config(tmp_path, model_dir), TOPO, model_dir)
    finally:
        taken.close()
    try:
        assert engine.client.port != taken_port
        assert (f"port {taken_port} was taken before the server bound it; starting it on another (attempt 2 of 3)"
                in capsys.readouterr().out)
        assert "address already in use" in (tmp_path / "sglang" / "sampler0.log").read_text().lower()
        engine.add_request(request("after", 3))
        assert len(run_until_done(engine, 30)["after"].token_ids) == 3
    finally:
        engine.close()


def test_a_server_that_never_answers_health_times_out_with_its_log_tail(tmp_path):
    server = ServerProcess([sys.executable, "-c", "print('stuck', flush=True); import time; time.sleep(60)"], ENV,
                           tmp_path / "stuck.log", "http://127.0.0.1:9")
    try:
        with pytest.raises(SGLangError, match=r"did not answer GET /health within .*=2s[\s\S]*stuck"):
            server.wait_healthy(HTTPClient("127.0.0.1", 9, 1), timeout_s=2)
    finally:
        server.stop()
    assert server.proc.poll() is not None


def test_a_stop_signal_while_a_server_starts_ends_the_wait_at_once_naming_the_server(tmp_path, monkeypatch):
    server = ServerProcess([sys.executable, "-c", "import time; time.sleep(60)"], ENV, tmp_path / "starting.log",
                           "http://127.0.0.1:9")
    monkeypatch.setattr(lifetime, "_received", (signal.SIGTERM, time.monotonic()))  # as install_stop_handlers records
    try:  # the server never answers: waited out, the start-up timeout would raise SGLangError instead
        with pytest.raises(StopRequested, match=r"^stopped by SIGTERM while waiting for the SGLang server "
                                                r"http://127.0.0.1:9 to answer GET /health$"):
            server.wait_healthy(HTTPClient("127.0.0.1", 9, 1), timeout_s=60)
    finally:
        server.stop()


def test_a_server_hanging_in_an_update_fails_within_the_request_timeout(model_dir, tmp_path):
    cfg = sglang_config(tmp_path, model_dir, "sampler.sglang.request_timeout_s=3",
                        "sampler.sglang.server_args=[--debug-hang-on-update]")
    engine = SGLangEngine.from_config(cfg, TOPO, model_dir)
    try:
        start = time.monotonic()
        with pytest.raises(SGLangError, match=r"/update_weights_from_distributed on SGLang server http://127\.0\.0\.1:"
                                              r"\d+: no answer within 3s[\s\S]*never returns"):
            engine.update_weights(1, "per_tensor", [[("model.norm.weight", (64,), torch.float32)]])
        assert time.monotonic() - start < 10
        # The failed update left no open session and no paused server behind.
        assert engine.client.post("/begin_weight_update", {})["success"]
        assert engine.client.post("/end_weight_update", {})["success"]
        engine.add_request(request("after", 3))
        assert len(run_until_done(engine, 30)["after"].token_ids) == 3
    finally:
        engine.close()


def test_a_server_killed_mid_run_is_reported_by_step(model_dir, tmp_path):
    engine = SGLangEngine.from_config(sglang_config(tmp_path, model_dir), TOPO, model_dir)
    try:
        engine.add_request(request("k", 480))
        engine.server.proc.kill()
        deadline = time.monotonic() + 30
        with pytest.raises(SGLangError, match=r"exited with code -9|/generate on SGLang server"):
            while time.monotonic() < deadline:
                engine.step()
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------------- end to end
def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_megarl_train_with_sglang_samplers_runs_pipeline_rl_end_to_end(embedded_think_model_dir, tmp_path):
    run_dir, steps = tmp_path / "run", 5
    proc = run_python("-m", "megarl.cli", "train", ARITHMETIC, "sampler.engine=sglang", f"run.dir={run_dir}",
                      f"run.steps={steps}", f"model.path={embedded_think_model_dir}", timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    cfg = OmegaConf.load(run_dir / "config.yaml")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:
        assert math.isfinite(m["loss"]) and 0 <= m["lag_mean"] <= m["lag_max"] <= cfg.algo.max_lag
    assert metrics[0]["lag0/token_share"] == 1.0 and metrics[0]["lag0/logprob_gap_abs"] < 1e-4
    # Versions applied by the server, in flight: the last step's groups were sampled at version
    # >= steps - 1 - max_lag, and the swap count travels with them.
    assert metrics[-1]["sampler1/swaps"] >= max(1, steps - 1 - cfg.algo.max_lag)

    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    assert len(rollouts) == steps * cfg.algo.prompts_per_step * cfg.algo.group_size
    for r in rollouts:
        assert len(r["versions"]) == len(r["behaviour_logprobs"]) == len(r["token_ids"]) > 0
        assert r["versions"] == sorted(r["versions"]) and max(r["versions"]) <= r["trained_at_step"]
        assert r["trained_at_step"] - min(r["versions"]) <= cfg.algo.max_lag
    assert any(len(set(r["versions"])) > 1 for r in rollouts)  # some rollouts crossed an update
    # Version-0 behaviour log-probs equal HF's with the weights on disk.
    weights = load_pretrained(str(embedded_think_model_dir))[1]
    for r in [r for r in rollouts if set(r["versions"]) == {0}][:8]:
        ids = r["prompt_ids"] + r["token_ids"]
        lp, _ = hf_logprobs(embedded_think_model_dir, weights, ids)
        got = torch.tensor(r["behaviour_logprobs"], dtype=torch.float64)
        assert (token_logprobs(lp, ids, len(r["prompt_ids"])) - got).abs().max() < 1e-4
    assert "init weights update group" in (run_dir / "sglang" / "sampler0.log").read_text()


def test_sync_mode_with_retract_cache_flush_and_a_lora_policy(embedded_think_model_dir, tmp_path):
    """The baseline on SGLang samplers (one epoch per batch): the sampler is idle at every update, so each flush
    happens. The policy is a
    LoRA adapter (learner.lora): every version is only the adapted weights, merged by the learner
    (lora_publish.MergedLoraSource), and the server's log-probs of the tokens it sampled at the learner's version are
    the learner's to fp32 noise (the lag-0 gap), so what it runs is base + the learner's adapter."""
    from megarl.config.schema import LoraConfig
    from megarl.models.lora import adapter_spec
    from megarl.portable.lora_merge import merged_spec

    run_dir = tmp_path / "sync"
    proc = run_python("-m", "megarl.cli", "train", ARITHMETIC, "sampler.engine=sglang", f"run.dir={run_dir}", "run.steps=3",
                      "algo.mode=sync", "algo.sync_epochs=1", "sampler.kv_on_update=recompute",
                      "sampler.sglang.cache_on_update=flush", "learner.lora.rank=8",
                      f"model.path={embedded_think_model_dir}", timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["version"] for m in metrics] == [1, 2, 3]
    hf_config, weights = load_pretrained(str(embedded_think_model_dir))
    merged = sum(math.prod(shape) * 4 for _, shape, _ in merged_spec(adapter_spec(hf_config, LoraConfig(rank=8))))
    assert merged < sum(t.numel() * 4 for t in weights.values())
    assert {m["publish_bytes"] for m in metrics} == {merged}  # the adapted weights, nothing else
    # One epoch per batch: every token is trained at the version that sampled it (0, then merged versions 1 and 2).
    assert all(m["lag0/token_share"] == 1.0 for m in metrics)
    assert max(m["lag0/logprob_gap_abs"] for m in metrics) < 1e-4, [m["lag0/logprob_gap_abs"] for m in metrics]
    for r in read_jsonl(run_dir / "rollouts.jsonl"):
        assert set(r["versions"]) == {r["trained_at_step"]}
    log = (run_dir / "sglang" / "sampler0.log").read_text()
    assert log.count("flush_cache: flushed") >= 2 and "not flushed" not in log
