"""megarl's SGLang-compatible server: SGLang's wire format, and weights updated in flight over a real gloo group.

Every test talks HTTP to a real server process (`python -m megarl.sampler.sglang_server`); weight
updates come from a separate learner process (tests/sampler/sglang_learner.py) over SGLang's group.
"""
from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl.distributed.sglang_publish import GROUP_NAME, free_port, plan_update_calls, update_body
from megarl.sampler.model import load_pretrained
from megarl.sampler.sglang_engine import HTTPClient, ServerProcess, versions_from_spans, new_api_key, write_secret_args
from megarl.sampler.sglang_server import IMITATES
from tests.helpers import run_python
from tests.sampler import make_tiny_model
from tests.sampler.sglang_support import ENV, hf_logprobs, start_learner, token_logprobs

CONTEXT = 1024
# The long request that publishes and pauses land on: long enough that it is still decoding when they do, even with
# the test's own process descheduled for a while (at 450 tokens it once ended first in a loaded suite run).
LONG = 1000
BUCKET_BYTES = int(0.01 * 2**20)  # the learner's bucket_mb=0.01
TOL = 1e-4
LEARNER_LORA = {"rank": 4, "alpha": 8.0}  # the stand-in learner's (tests/sampler/sglang_learner.py LORA)


class Server:
    """A running server process, the HF weights it runs and the version label they carry."""

    def __init__(self, model_dir: Path, log: Path, kv_on_update: str):
        self.model_dir, self.port = model_dir, free_port("127.0.0.1")
        self.api_key = new_api_key()  # as megarl launches it: the key in a --config file
        cmd = [sys.executable, "-m", "megarl.sampler.sglang_server",
               "--config", str(write_secret_args(log.parent / "secret.yaml", self.api_key)), "--model-path", str(model_dir),
               "--port", str(self.port), "--skip-tokenizer-init", "--context-length", str(CONTEXT),
               "--max-running-requests", "8", "--weight-version", "0", "--kv-on-update", kv_on_update,
               "--dist-timeout", "60", "--disable-overlap-schedule"]
        cmd += ["--disable-radix-cache"] if kv_on_update == "recompute" else []
        self.process = ServerProcess(cmd, ENV, log, f"http://127.0.0.1:{self.port}")
        self.http = HTTPClient("127.0.0.1", self.port, 60, describe=self.process.log_tail, api_key=self.api_key)
        self.process.wait_healthy(self.http, 120)
        self.weights = load_pretrained(str(model_dir))[1]
        self.version = 0

    def stats(self) -> dict:
        """The engine's stats (megarl's server reports them as internal_states)."""
        return json.loads(self.http.get("/server_info")[1])["internal_states"][0]

    def decoded(self) -> int:
        return self.stats()["tokens_decoded"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sglang_model"), "qwen2", max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("logs") / "server.log", kv_on_update="keep")
    yield s
    s.process.stop()


# The families after Qwen2 the built-in engine serves (Mixtral: tests/sampler/test_sglang_routes.py).
FAMILIES = ("llama", "qwen3", "mistral", "phi3", "smollm3", "olmo2", "gemma3", "qwen3_moe", "glm4_moe", "gpt_oss",
            "deepseek_v3")


@pytest.fixture(scope="module", params=FAMILIES)
def family_server(request, tmp_path_factory):
    """A server of one family's tiny model (tests/sampler's makers), one at a time."""
    model = make_tiny_model(tmp_path_factory.mktemp(f"sglang_{request.param}"), request.param,
                            max_position_embeddings=CONTEXT)
    s = Server(model, tmp_path_factory.mktemp("logs") / f"{request.param}.log", kv_on_update="keep")
    yield s
    s.process.stop()


def post(server: Server, route: str, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", route, json.dumps(body), server.http.headers)
    resp = conn.getresponse()
    return resp.status, resp.read()


def generate(server: Server, body: dict) -> tuple[int, dict]:
    status, data = post(server, "/generate", body)
    return status, json.loads(data)


def open_stream(server: Server, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/generate", json.dumps({**body, "stream": True}), server.http.headers)
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    return conn, resp


def raw_stream(server: Server, body: dict) -> list[bytes]:
    return [line for line in open_stream(server, body)[1].read().split(b"\n") if line]


def stream_chunks(server: Server, body: dict) -> list[dict]:
    lines = raw_stream(server, body)
    assert lines[-1] == b"data: [DONE]" and all(line.startswith(b"data: ") for line in lines)
    return [json.loads(line[6:]) for line in lines[:-1]]


def wait_for(condition, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.002)


def start_long_request(server: Server, max_new_tokens: int = LONG) -> tuple[threading.Thread, dict]:
    """A sampled request of max_new_tokens streaming on a thread; returns once it has produced tokens."""
    result, before = {}, server.decoded()
    body = {"rid": f"long-{time.time()}", "input_ids": [1, 5, 9, 2], "return_logprob": True, "stream": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    thread = threading.Thread(target=lambda: result.update(chunks=list(server.http.stream("/generate", body))))
    thread.start()
    wait_for(lambda: server.decoded() >= before + 10, "the long request to decode")  # nothing else runs
    return thread, result


def lora_version(server: Server, adapter_dir: Path) -> tuple[dict, dict]:
    """learner.lora: (what the version sends: the adapted weights as *peft* merges the stand-in learner's adapter
    onto the checkpoint's base, in the learner's publish order; the weights the server then runs: those, and every
    other weight as it was)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megarl.config.schema import LoraConfig
    from megarl.models.lora import adapter_spec
    from megarl.portable.lora_merge import merged_spec

    base = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().state_dict()
    spec = merged_spec(adapter_spec(load_pretrained(str(server.model_dir))[0], LoraConfig(**LEARNER_LORA)))
    sent = {name: merged[name] for name, _, _ in spec}
    return sent, {**server.weights, **sent}


def publish_in_flight(server: Server, tmp_path: Path, pause_mode: str, weight_format: str, lora: bool = False):
    """A learner process publishes version+1 while a long request runs: pause -> begin -> update(s) -> end
    -> continue, with SGLang's refusals checked on the way.  With `lora` the version is the stand-in learner's
    merged adapted weights only (a partial update).  Returns (the long request's final chunk, old weights, new
    weights, the calls' names)."""
    port, version = free_port("127.0.0.1"), server.version + 1
    out = tmp_path / ("adapter" if lora else "new_weights.safetensors")
    learner = start_learner(server.model_dir, out, port, 2, weight_format, version, lora=lora)
    try:
        reply = server.http.post("/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": GROUP_NAME, "backend": "gloo"})
        assert reply["success"], reply
        thread, result = start_long_request(server)
        assert server.http.post("/pause_generation", {"mode": pause_mode})["status"] == "ok"
        paused_at = server.decoded()
        # SGLang's flush while paused ignores waiting requests: a retract emptied the running batch.
        assert server.http.get("/flush_cache")[0] == (200 if pause_mode == "retract" else 400)
        sent, new = lora_version(server, out) if lora else (load_file(out),) * 2  # written before the learner joined
        calls = plan_update_calls([(n, tuple(t.shape), t.dtype) for n, t in sent.items()], weight_format, BUCKET_BYTES)
        # SGLang >= 0.5.21: no update outside a begin/end_weight_update session, one session at a time.
        status, reply = post(server, "/update_weights_from_distributed", update_body(calls[0], weight_format,
                                                                                    GROUP_NAME, None))
        assert status == 400 and b"must run between begin_weight_update() and end_weight_update()" in reply
        assert post(server, "/end_weight_update", {})[0] == 400
        assert server.http.post("/begin_weight_update", {})["success"]
        assert post(server, "/begin_weight_update", {})[0] == 400
        for i, call in enumerate(calls):
            label = str(version) if i == len(calls) - 1 else None
            reply = server.http.post("/update_weights_from_distributed",
                                     update_body(call, weight_format, GROUP_NAME, label))
            assert reply["success"], reply
        assert server.decoded() == paused_at  # nothing ran while paused
        assert server.http.post("/end_weight_update", {})["success"]
        assert json.loads(server.http.get("/model_info")[1])["weight_version"] == str(version)
        server.http.post("/continue_generation", {})
        thread.join(60)
        assert learner.wait(60) == 0, learner.stdout.read()
        assert server.http.post("/destroy_weights_update_group", {"group_name": GROUP_NAME})["success"]
    finally:
        learner.kill()
    old, server.weights, server.version = server.weights, new, version
    return result["chunks"][-1], old, new, [n for call in calls for n, _, _ in call]


def test_request_spanning_an_update_finishes_with_both_versions_and_new_weights_logprobs(server, tmp_path):
    """pause in_place: the running request keeps its KV cache and continues under the new weights."""
    final, old, new, _ = publish_in_flight(server, tmp_path, "in_place", "flattened_bucket")
    check_spanning_in_place(server, final, old, new)


def test_each_family_serves_a_request_spanning_an_update_with_both_versions(family_server, tmp_path):
    """As the test above, for every family after Qwen2: the learner's publish of the family's HF-named tensors (an
    MoE's per-expert ones, gpt-oss's fused experts) lands in flight, and the spanning request's log-probs are
    transformers' for that family: the old weights' before, the new weights' over the kept KV after."""
    final, old, new, _ = publish_in_flight(family_server, tmp_path, "in_place", "flattened_bucket")
    check_spanning_in_place(family_server, final, old, new)


def test_a_lora_version_is_a_partial_update_of_merged_weights_landing_in_flight(server, tmp_path):
    """learner.lora on SGLang: the version carries only the adapted weights, merged by the learner's own code
    (lora_publish.MergedLoraSource, in the stand-in learner). The server takes the partial name list, keeps every
    other weight, and the request spanning the update has exact per-token versions against *peft's* merge of the
    adapter (before: the old weights; after: the merged ones over the kept KV). A request after the update runs
    the merged weights to fp32 noise (the lag-0 gap)."""
    from megarl.config.schema import LoraConfig
    from megarl.models.lora import adapter_spec

    final, old, new, names = publish_in_flight(server, tmp_path, "in_place", "flattened_bucket", lora=True)
    hf_config = load_pretrained(str(server.model_dir))[0]
    adapted = [n for n, _, _ in adapter_spec(hf_config, LoraConfig(**LEARNER_LORA)) if n.endswith(".lora_A.weight")]
    assert names == [n.replace(".lora_A.weight", ".weight") for n in adapted]  # only the targets, in publish order
    sent_bytes = sum(new[n].numel() * 4 for n in names)
    full_bytes = sum(t.numel() * 4 for t in new.values())
    assert sent_bytes < full_bytes
    assert any((new[n] - old[n]).abs().max() > 1e-2 for n in names)
    check_spanning_in_place(server, final, old, new)
    status, out = generate(server, {"rid": "after-lora", "input_ids": [3, 8, 1], "return_logprob": True,
                                    "sampling_params": {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True}})
    assert status == 200 and out["meta_info"]["weight_version"] == str(server.version)
    ids = [3, 8, 1] + out["output_ids"]
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
    gap = (token_logprobs(hf_logprobs(server.model_dir, new, ids)[0], ids, 3) - got).abs().max().item()
    print(f"\nlora on sglang: {len(names)} merged weights, {sent_bytes} B per publish (full model {full_bytes} B); "
          f"lag-0 gap {gap:.1e}")
    assert gap < TOL


def check_spanning_in_place(server: Server, final: dict, old: dict, new: dict) -> None:
    """The long request crossed the update to version v paused in place: versions [v-1]*k + [v]*(n-k), the old
    weights' log-probs before, the new weights' over the old weights' KV after (and neither the old weights' nor a
    recomputed KV's)."""
    meta = final["meta_info"]
    n = len(final["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": LONG} and meta["completion_tokens"] == n == LONG
    versions = versions_from_spans(meta["weight_versions"], n)
    k = versions.count(server.version - 1)
    assert 0 < k < n and versions == [server.version - 1] * k + [server.version] * (n - k), meta["weight_versions"]
    assert meta["weight_version"] == str(server.version)

    prompt, tokens = [1, 5, 9, 2], final["output_ids"]
    logprobs = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]], dtype=torch.float64)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == tokens
    ids, p = prompt + tokens, len(prompt)
    old_lp, _ = hf_logprobs(server.model_dir, old, ids)
    assert (token_logprobs(old_lp, ids, p)[:k] - logprobs[:k]).abs().max() < TOL
    # After the update: the new weights, attending over the KV cache the old weights wrote for every
    # position fed before the swap (prompt and tokens[:k-1]); tokens[k-1] is fed by the first new step.
    _, past = hf_logprobs(server.model_dir, old, ids[:p + k - 1])
    kept_lp, _ = hf_logprobs(server.model_dir, new, ids[p + k - 1:], past=past)
    assert (token_logprobs(kept_lp, ids[p + k - 1:], 1) - logprobs[k:]).abs().max() < TOL
    stale = token_logprobs(old_lp, ids, p)[k:]
    assert (stale - logprobs[k:]).abs().max() > 1e-2  # ... not the old weights'
    fresh = token_logprobs(hf_logprobs(server.model_dir, new, ids)[0], ids, p)[k:]
    assert (fresh - logprobs[k:]).abs().max() > 1e-3  # ... and not a recomputed cache's: it was kept


def test_retract_recomputes_the_running_requests_kv_under_the_new_weights(model_dir, tmp_path):
    """pause retract (server with --kv-on-update recompute), per-tensor broadcasts: after the update
    every token's log-prob is exactly a fresh computation with the new weights."""
    server = Server(model_dir, tmp_path / "retract.log", kv_on_update="recompute")
    try:
        status, body = post(server, "/pause_generation", {"mode": "in_place"})
        assert status == 400 and b"--kv-on-update keep" in body  # one KV policy per launch
        final, _, new, _ = publish_in_flight(server, tmp_path, "retract", "per_tensor")
    finally:
        server.process.stop()
    meta = final["meta_info"]
    versions = versions_from_spans(meta["weight_versions"], len(final["output_ids"]))
    k = versions.count(0)
    assert 0 < k < len(versions)
    ids, p = [1, 5, 9, 2] + final["output_ids"], 4
    expected = token_logprobs(hf_logprobs(model_dir, new, ids)[0], ids, p)[k:]
    got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]], dtype=torch.float64)[k:]
    assert (expected - got).abs().max() < TOL


def test_generate_answers_in_sglangs_format(server):
    status, out = generate(server, {"rid": "r1", "input_ids": [3, 4], "return_logprob": True,
                                    "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}})
    assert status == 200 and set(out) == {"output_ids", "meta_info"}  # --skip-tokenizer-init: no text
    meta = out["meta_info"]
    assert meta["id"] == "r1" and meta["prompt_tokens"] == 2 and meta["completion_tokens"] == 5
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert [[t for _, t, _ in meta["output_token_logprobs"]], [x for _, _, x in meta["output_token_logprobs"]]] == \
        [out["output_ids"], [None] * 5]
    assert meta["weight_version"] == str(server.version)
    assert meta["weight_versions"] == [{"version": str(server.version), "start": 0, "end": 5}]
    # A stop token ends the request and is the last output token (finish_reason type "stop").
    stop = out["output_ids"][2]
    _, out = generate(server, {"input_ids": [3, 4], "sampling_params": {"temperature": 0, "max_new_tokens": 5,
                                                                        "stop_token_ids": [stop]}})
    assert out["output_ids"][-1] == stop and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert "output_token_logprobs" not in out["meta_info"]  # only with return_logprob


def test_stream_is_sse_data_lines_then_done(server):
    chunks = stream_chunks(server, {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 3}})
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    # A request SGLang refuses streams its error chunk, then [DONE]: a prompt that fills the context, or
    # one whose max_new_tokens would go past it (no truncation: tokenizer_manager._validate_one_request).
    lines = raw_stream(server, {"input_ids": [1] * CONTEXT, "sampling_params": {"max_new_tokens": 3}})
    assert "is longer than the model's context length" in json.loads(lines[0][6:])["error"]["message"]
    assert lines[1] == b"data: [DONE]"
    lines = raw_stream(server, {"input_ids": [1] * (CONTEXT - 3), "sampling_params": {"max_new_tokens": 4}})
    assert "exceeds the model's maximum context length" in json.loads(lines[0][6:])["error"]["message"]
    assert len(stream_chunks(server, {"input_ids": [1] * (CONTEXT - 3), "sampling_params": {
        "max_new_tokens": 3, "ignore_eos": True}})[-1]["output_ids"]) == 3  # exactly the context: fine


def test_a_long_stream_has_cumulative_chunks_ending_in_the_non_streamed_result(server):
    """SGLang's default stream: a chunk per token as they are produced, each holding every token so far
    (output_ids, output_token_logprobs, completion_tokens, spans), finish_reason only on the last; the
    last equals the non-streamed answer to the same (greedy) request."""
    body = {"input_ids": [1, 5, 9, 2], "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True}}
    chunks = stream_chunks(server, body)
    assert len(chunks) > 10  # a slow reader may miss some: the next one has everything
    previous = {"output_ids": [], "meta_info": {"output_token_logprobs": []}}
    for chunk in chunks:
        meta, n = chunk["meta_info"], len(chunk["output_ids"])
        assert n > len(previous["output_ids"]) and chunk["output_ids"][:len(previous["output_ids"])] == previous["output_ids"]
        assert meta["output_token_logprobs"][:len(previous["output_ids"])] == previous["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == chunk["output_ids"] and meta["completion_tokens"] == n
        assert versions_from_spans(meta["weight_versions"], n) == [server.version] * n
        assert (meta["finish_reason"] is None) == (chunk is not chunks[-1]) and ("e2e_latency" in meta) == (chunk is chunks[-1])
        previous = chunk
    _, whole = generate(server, body)
    del whole["meta_info"]["e2e_latency"], chunks[-1]["meta_info"]["e2e_latency"]
    assert {**whole, "meta_info": {**whole["meta_info"], "id": None}} == \
        {**chunks[-1], "meta_info": {**chunks[-1]["meta_info"], "id": None}}


def test_stream_interval_spaces_the_chunks_as_sglangs_scheduler(server):
    """stream_interval N (sampling param; unset or 0: --stream-interval): chunks at 1, 1 + N, 1 + 2N, ...
    tokens and at the end.  (The engine's first step both prefills and decodes, so the first chunk has 2 tokens.)"""
    chunks = stream_chunks(server, {"input_ids": [3, 4], "sampling_params": {
        "temperature": 0, "max_new_tokens": 100, "ignore_eos": True, "stream_interval": 16}})
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts[-1] == 100 and set(counts[:-1]) <= {2, 17, 33, 49, 65, 81, 97}, counts
    status, out = generate(server, {"input_ids": [3], "sampling_params": {"stream_interval": -1}})
    assert status == 400 and "stream_interval" in out["error"]["message"]


def test_a_client_hanging_up_aborts_its_request(server):
    """As SGLang (TokenizerManager.create_abort_task): the request of a stream whose client went away
    is aborted, not run to its end."""
    before = server.stats()
    conn, resp = open_stream(server, {"input_ids": [1, 5, 9, 2], "sampling_params": {
        "temperature": 1.0, "max_new_tokens": LONG, "ignore_eos": True}})
    assert resp.readline().startswith(b"data: {")  # it is streaming
    resp.close()  # the last reference to the socket: the connection closes
    conn.close()
    wait_for(lambda: server.stats()["requests_cancelled"] == before["requests_cancelled"] + 1, "the abort", 10)
    stats = server.stats()
    assert stats["running"] == 0 and stats["tokens_decoded"] - before["tokens_decoded"] < LONG


def test_bad_requests_get_http_400_with_a_message(server):
    status, out = generate(server, {"input_ids": [[1, 2], [3]]})
    assert status == 400 and "batch" in out["error"]["message"]
    status, out = generate(server, {"input_ids": [1], "sampling_params": {"min_p": 0.1}})
    assert status == 400 and "min_p" in out["error"]["message"]
    status, body = server.http.get("/nope")
    assert status == 404


def test_info_and_health_routes(server):
    assert server.http.get("/health")[0] == 200 and server.http.get("/health_generate")[0] == 200
    info = json.loads(server.http.get("/model_info")[1])
    assert info["model_path"] == str(server.model_dir) and info["is_generation"] is True
    assert info["weight_version"] == str(server.version)
    info = json.loads(server.http.get("/server_info")[1])
    assert info["version"] == IMITATES and info["megarl_builtin"] is True
    assert server.http.get("/get_weight_version")[0] == 404  # gone since SGLang 0.5.21


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", "Basic {key}", "bearer  {key}", "{key}"])
def test_with_an_api_key_every_route_but_the_probes_needs_the_bearer_token(server, authorization):
    """SGLang's --api-key (utils/auth.py): 401 {"error": "Unauthorized"} on every route megarl calls without
    `Bearer <key>`, /generate and the weight-update routes included; /health stays open for probes."""
    headers = {} if authorization is None else {"Authorization": authorization.format(key=server.api_key)}
    for method, route in [("POST", "/generate"), ("POST", "/pause_generation"), ("POST", "/update_weights_from_distributed"),
                          ("POST", "/init_weights_update_group"), ("GET", "/server_info"), ("GET", "/flush_cache"),
                          ("POST", "/nonexistent")]:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request(method, route, json.dumps({"input_ids": [1, 2]}) if method == "POST" else None, headers)
        resp = conn.getresponse()
        assert (resp.status, json.loads(resp.read())) == (401, {"error": "Unauthorized"}), (route, authorization)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", "/health", headers=headers)
    assert conn.getresponse().status == 200
    assert server.http.get("/server_info")[0] == 200  # megarl's client sends the key


def test_abort_ends_running_requests_with_their_output_so_far_and_flush_needs_an_idle_server(server):
    before = server.decoded()
    thread, result = start_long_request(server)
    server.http.post("/pause_generation", {"mode": "in_place"})
    produced = server.decoded() - before  # every token the long request has (nothing else ran)
    assert server.http.get("/flush_cache")[0] == 400  # SGLang: not while requests are in the running batch
    status, queued = {}, threading.Thread(target=lambda: status.update(zip(("code", "out"), generate(server, {
        "input_ids": [3], "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}))))
    queued.start()
    wait_for(lambda: server.stats()["inbox"] == 1, "the request to wait in the paused server")
    server.http.post("/pause_generation", {"mode": "abort"})
    thread.join(10)
    queued.join(10)
    *earlier, final = result["chunks"]
    meta, tokens = final["meta_info"], final["output_ids"]
    assert meta["finish_reason"]["type"] == "abort" and len(tokens) == meta["completion_tokens"] == produced < LONG
    assert tokens[:len(earlier[-1]["output_ids"])] == earlier[-1]["output_ids"]  # cumulative to the end
    assert [t for _, t, _ in meta["output_token_logprobs"]] == tokens
    assert versions_from_spans(meta["weight_versions"], produced) == [server.version] * produced
    ids = [1, 5, 9, 2] + tokens
    expected = token_logprobs(hf_logprobs(server.model_dir, server.weights, ids)[0], ids, 4)
    got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]], dtype=torch.float64)
    assert (expected - got).abs().max() < TOL
    # A non-streamed request that had not started: HTTP 200, finish_reason abort, no tokens.
    assert status["code"] == 200 and status["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert status["out"]["output_ids"] == [] == status["out"]["meta_info"]["output_token_logprobs"]
    assert server.http.get("/flush_cache")[0] == 200
    server.http.post("/continue_generation", {})
    status, out = generate(server, {"input_ids": [3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert status == 200 and out["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize("flags, says", [
    (["--disable-overlap-schedule", "--tp-size", "2"], ["--tp-size 2", "sampler.sglang.server=sglang"]),
    ([], ["--disable-overlap-schedule is required"]),
    (["--disable-overlap-schedule", "--kv-on-update", "recompute"], ["needs --disable-radix-cache"]),
])
def test_launches_sglang_would_run_differently_are_refused_clearly(flags, says):
    proc = run_python("-m", "megarl.sampler.sglang_server", "--model-path", "unused", *flags, timeout=60)
    assert proc.returncode == 2 and all(s in proc.stderr for s in says), proc.stderr
