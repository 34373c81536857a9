"""The SGLang engine backend: a sampler rank starts one SGLang server on its GPUs and drives it over HTTP.

`SGLangEngine` implements the `Engine` protocol (megarl/protocols.py) the sampler loop drives:
`add_request` sends a streaming `/generate` (token ids in, `return_logprob`), `step()` returns the
requests that finished since the last call, each token with its behaviour log-prob and the policy
version that produced it. Weights never pass through the sampler process: `SGLangWeightFollower`
watches the learner's publish headers and makes the server receive each version over SGLang's
weight-update group (learner side: megarl/distributed/sglang_publish.py):

    /pause_generation {mode: in_place | retract}   running requests stay, their KV kept | recomputed
    /begin_weight_update                           SGLang >= 0.5.21 loads weights only inside a session
    /update_weights_from_distributed ...           once per bucket, concurrent with the learner's broadcast
    /end_weight_update                             closes the session (also on every error path)
    /flush_cache                                   only with sampler.sglang.cache_on_update=flush
    /continue_generation                           the paused requests go on under the new weights

Streams (SGLang's default, non-incremental): a chunk every `--stream-interval` tokens, each holding
every token so far (`output_ids`, `meta_info.output_token_logprobs`), finish_reason set on the last.
The client reads them as they come and keeps only the last chunk and each chunk's token count and
label, so a long stream costs memory for one chunk, not for all of them.

Per-token versions (the argument is in docs/sglang.md): the server stamps its weight-version label
on everything it returns. When meta_info carries `weight_versions` spans (newer SGLang, and megarl's
built-in server) they are the scheduler's own per-token accounting and are used as they are.
Otherwise every token takes the label of the first stream chunk that delivered it.

Routes (mixture-of-experts models under algo.routing_replay=r3): SGLang's own contract. The server is
launched with --enable-return-routed-experts, every /generate asks `return_routed_experts: true`, and a
finished request's meta_info["routed_experts"] is base64 of SGLang's int32 [prompt + completion - 1,
num_hidden_layers, num_experts_per_tok] array (state_capturer/base.py get_topk: the routes its capturer
recorded per KV slot, i.e. by the weights that computed each position); `routes_from_meta` turns it into
the sample's routes. A release without the field is refused for r3, naming it (`check_routed_experts`).

A request the server aborts (finish_reason "abort": someone paused with mode "abort", or the server
gave up on it) fails with SGLangError naming how many tokens it had: megarl never asks for aborts,
and a partial rollout must not be trained on as if it had finished.

Length budget: SGLang refuses a request whose prompt + max_new_tokens exceeds its context length
(tokenizer_manager._validate_one_request), so every request asks for
min(sampling.max_new_tokens, context - prompt) tokens; the context is sampler.max_seq_len, which
megarl passes to the server as --context-length.

The server is started with the command of `server_command` (real SGLang on GPU, or
`python -m megarl.sampler.sglang_server` on CPU) in the environment of `server_env` (the sampler's,
without torchrun's variables), bound to 127.0.0.1, logging to a file whose tail every error carries.
Once healthy, its version is read from /server_info and one outside SUPPORTED_VERSIONS is refused.
Every HTTP call has a timeout and its errors name the route and the server.
"""
from __future__ import annotations

import base64
import ctypes
import http.client
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from megarl.distributed.lifetime import StopRequested, stop_signal
from megarl.distributed.publish import header_key
from megarl.distributed.sglang_publish import GROUP_KEY, SPEC_KEY, epoch_group_key, epoch_layout, load_spec, update_body
from megarl.models import moe
from megarl.protocols import Completion, GenerationRequest, RouteShape
from megarl.sampler.request_pool import RequestPool, pinned_view

# The SGLang releases megarl drives correctly, oldest and newest (bounds explained in docs/sglang.md;
# tests/sampler/sglang_contract/ runs megarl's requests through both releases' own code).
SUPPORTED_VERSIONS = ("0.5.21", "0.5.23")
# The oldest release whose /generate returns routes as megarl reads them (return_routed_experts and
# meta_info["routed_experts"]); the contract tests check every supported release from here on has them.
ROUTED_EXPERTS_SINCE = "0.5.21"
# Variables torchrun sets for its workers. SGLang bootstraps its own torch.distributed (tcp://127.0.0.1)
# even at TP 1; under TORCHELASTIC_USE_AGENT_STORE every rank of that bootstrap becomes a client of a
# store nobody hosts and /health never answers, and the others describe the sampler's job, not the server's.
TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                 "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE")
TORCHRUN_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_")
log = logging.getLogger("megarl.sglang_engine")

HEALTH_POLL_S = 0.5
STORE_POLL_S = 0.002
LOG_TAIL_LINES = 40
PORT_ATTEMPTS = 3  # server starts on sampler.sglang.port=0, each on a port free a moment before


class SGLangError(RuntimeError):
    """A failed call to the SGLang server; the message names the route, the server and its log tail."""


# ---------------------------------------------------------------------------------------------- versions
def versions_from_spans(spans: list[dict], n: int) -> list[int]:
    """meta_info["weight_versions"] ([{version, start, end}], contiguous from 0) -> one int version per token."""
    versions: list[int] = []
    for span in spans:
        if span["start"] != len(versions):
            raise ValueError(f"weight_versions spans are not contiguous: {spans}")
        versions += [int(span["version"])] * (span["end"] - span["start"])
    if len(versions) != n:
        raise ValueError(f"weight_versions spans cover {len(versions)} tokens, the output has {n}: {spans}")
    return versions


def versions_from_stamps(stamps: list[tuple[int, str]], n: int) -> list[int]:
    """[(output tokens delivered so far, weight_version label of that chunk)] in stream order -> per-token
    versions: each token takes the label of the first chunk that delivered it."""
    versions: list[int] = []
    for count, label in stamps:
        versions += [int(label)] * (count - len(versions))
    if len(versions) != n:
        raise ValueError(f"the stream delivered {len(versions)} tokens before its last chunk, the output has {n}")
    return versions


def routes_from_meta(meta: dict, request: GenerationRequest, num_tokens: int, shape: RouteShape) -> np.ndarray:
    """A finished request's routes from SGLang's meta_info["routed_experts"] (module docstring), in the
    sample's dtype; ValueError when absent or of another size than the sequence's positions."""
    encoded = meta.get("routed_experts")
    if encoded is None:
        raise ValueError("meta_info has no routed_experts (is the server running with "
                         "--enable-return-routed-experts, and the model a mixture of experts?)")
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    rows = len(request.prompt_ids) + num_tokens - 1
    if flat.size != rows * shape.layers * shape.top_k:
        raise ValueError(f"routed_experts holds {flat.size} indices, expected {rows} positions x {shape.layers} "
                         f"layers x top-{shape.top_k} = {rows * shape.layers * shape.top_k}")
    return flat.reshape(rows, shape.layers, shape.top_k).astype(moe.routes_dtype({"num_experts": shape.num_experts}))


def completion_from_chunks(request: GenerationRequest, chunks: Iterable[dict],
                           route_shape: RouteShape | None = None) -> Completion:
    """Build the Completion of one /generate stream (SGLang's cumulative chunks, the last one finished),
    reading the chunks as they come.  An aborted stream gives finish_reason "abort" and the tokens it had.

    The token ids are those of `output_token_logprobs` ([logprob, token_id, text] triples): every
    sampled token, the matched stop token included, whatever the server's stop trimming does to
    `output_ids` (and an abort of a streamed request queued in SGLang's waiting queue sends only the
    last output id, tokenizer_manager._handle_abort_req).  With `route_shape` the finished request's
    routes are read too (`routes_from_meta`)."""
    stamps, final = [], None  # (tokens delivered, label) of every chunk; the last chunk
    for chunk in chunks:
        meta = chunk["meta_info"]
        stamps.append((len(meta["output_token_logprobs"]), meta["weight_version"]))
        final = chunk
    if final is None:
        raise ValueError(f"request {request.request_id}: the stream had no chunks")
    meta = final["meta_info"]
    reason = meta.get("finish_reason") or {}
    if reason.get("type") not in ("stop", "length", "abort"):
        raise ValueError(f"request {request.request_id}: the last chunk has finish_reason {reason}")
    triples = meta["output_token_logprobs"]
    token_ids = [int(t) for _, t, _ in triples]
    if meta.get("completion_tokens", len(token_ids)) != len(token_ids):
        raise ValueError(f"request {request.request_id}: completion_tokens={meta['completion_tokens']} but "
                         f"{len(token_ids)} output_token_logprobs (megarl reads SGLang's default cumulative "
                         f"chunks: is the server running with --incremental-streaming-output?)")
    if reason["type"] != "abort" and final["output_ids"] != token_ids[:len(final["output_ids"])]:
        raise ValueError(f"request {request.request_id}: output_ids {final['output_ids']} disagree with the "
                         f"token ids of output_token_logprobs {token_ids}")
    if meta.get("weight_versions"):
        versions = versions_from_spans(meta["weight_versions"], len(token_ids))
    else:
        versions = versions_from_stamps(stamps, len(token_ids))
    routes = None
    if route_shape is not None and reason["type"] != "abort":
        routes = routes_from_meta(meta, request, len(token_ids), route_shape)
    return Completion(request_id=request.request_id, prompt_ids=list(request.prompt_ids), token_ids=token_ids,
                      logprobs=[float(lp) for lp, _, _ in triples], versions=versions,
                      finish_reason=reason["type"], routes=routes)


def new_token_budget(request: GenerationRequest, context_length: int) -> int:
    """max_new_tokens of one request: what it asks for, within what the context leaves after its prompt
    (SGLang refuses prompt + max_new_tokens > context_length instead of truncating)."""
    return min(request.sampling.max_new_tokens, context_length - len(request.prompt_ids))


def generate_body(request: GenerationRequest, context_length: int, routed_experts: bool = False) -> dict:
    """The /generate request body (sglang io_struct GenerateReqInput, sampling_params as SGLang's SamplingParams);
    routed_experts: ask for the request's routes (GenerateReqInput.return_routed_experts, from position 0)."""
    sp = request.sampling
    body = {"rid": request.request_id, "input_ids": list(request.prompt_ids), "return_logprob": True, "stream": True,
            "sampling_params": {"temperature": sp.temperature, "top_p": sp.top_p,
                                "top_k": sp.top_k if sp.top_k > 0 else -1,  # SGLang: -1 = off
                                "max_new_tokens": new_token_budget(request, context_length),
                                "stop_token_ids": list(request.stop_token_ids), "no_stop_trim": True}}
    if routed_experts:
        body["return_routed_experts"] = True
    return body


def parse_version(text: str) -> tuple[int, int, int] | None:
    """"0.5.23", "0.5.23.post1", "0.5.24rc0" -> (0, 5, 23) / (0, 5, 23) / (0, 5, 24); None if not x.y.z..."""
    import re

    match = re.match(r"(\d+)\.(\d+)\.(\d+)", str(text))
    return tuple(int(g) for g in match.groups()) if match else None


def check_server_version(version: str, url: str = "") -> None:
    """Refuse an SGLang release outside SUPPORTED_VERSIONS, naming it and the range."""
    low, high = (parse_version(v) for v in SUPPORTED_VERSIONS)
    parsed = parse_version(version)
    if parsed is None or not low <= parsed <= high:
        raise SGLangError(f"SGLang server {url} runs version {version!r}; megarl supports SGLang "
                          f"{SUPPORTED_VERSIONS[0]} to {SUPPORTED_VERSIONS[1]} (docs/sglang.md, 'Supported versions': "
                          f"older releases lack the weight-update session or label updates wrongly, newer ones "
                          f"are not checked against megarl's requests)")


def check_routed_experts(version: str, url: str = "") -> None:
    """Refuse, for algo.routing_replay=r3, an SGLang release older than ROUTED_EXPERTS_SINCE (no
    return_routed_experts), naming it."""
    parsed = parse_version(version)
    if parsed is None or parsed < parse_version(ROUTED_EXPERTS_SINCE):
        raise SGLangError(f"SGLang server {url} runs version {version!r}, which cannot return routed experts "
                          f"(GenerateReqInput.return_routed_experts, SGLang >= {ROUTED_EXPERTS_SINCE}): "
                          f"algo.routing_replay=r3 needs them; use a newer SGLang or algo.routing_replay=off")


# config.json fields SGLang's DeepSeek-V3 class (models/deepseek_v2.py) reads, with a released DeepSeek-V3's values:
# transformers' DeepseekV3Config does not write them, so a directory it saved lacks them.
SGLANG_DEEPSEEK_V3_FIELDS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
# Families whose SGLang class holds an lm_head of its own whatever tie_word_embeddings says (nothing loads it from the
# embeddings): a tied checkpoint's publish, which has no lm_head.weight, leaves it unwritten.
SGLANG_UNTIED_ONLY = ("mixtral", "qwen3_moe")


def check_sglang_serves(hf_config: dict) -> None:
    """Refuse, naming the config.json field, a model real SGLang (0.5.21-0.5.23) would load wrongly or not at all
    (tests/sampler/sglang_contract/test_family_loads.py shows each)."""
    model_type = hf_config.get("model_type")
    if model_type in SGLANG_UNTIED_ONLY and hf_config.get("tie_word_embeddings"):
        raise ValueError(f"sampler.sglang.server=sglang: SGLang's {model_type} model never ties its lm_head to the "
                         f"embeddings, and config.json has tie_word_embeddings: true (no lm_head.weight to load), so "
                         f"it would sample from an unwritten lm_head; untie the checkpoint (lm_head.weight = the "
                         f"embedding) or use sampler.engine=builtin")
    if model_type == "deepseek_v3":
        wrong = {k: hf_config.get(k) for k, v in SGLANG_DEEPSEEK_V3_FIELDS.items() if hf_config.get(k) != v}
        if wrong:
            raise ValueError(f"sampler.sglang.server=sglang: SGLang builds DeepSeek-V3 from config.json's "
                             f"{sorted(SGLANG_DEEPSEEK_V3_FIELDS)} (a released checkpoint's: "
                             f"{SGLANG_DEEPSEEK_V3_FIELDS}), and config.json has {wrong}; set them or use "
                             f"sampler.engine=builtin")


def server_env(env: dict) -> dict:
    """The server's environment: the sampler rank's without torchrun's variables (TORCHRUN_VARS)."""
    return {k: v for k, v in env.items() if k not in TORCHRUN_VARS and not k.startswith(TORCHRUN_PREFIXES)}


# ---------------------------------------------------------------------------------------------- process
def server_command(cfg, model_dir: str | Path, port: int, seed: int, secret_args: Path | None = None) -> list[str]:
    """The launch command of one sampler's server: SGLang's launch_server flags, with megarl's extras for
    the built-in server (its context length, slots and KV policy follow the sampler config). `secret_args`:
    the file of flags nobody else may read (write_secret_args), passed as SGLang's `--config`."""
    sc = cfg.sampler.sglang
    common = [*(["--config", str(secret_args)] if secret_args is not None else []),
              "--model-path", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--random-seed", str(seed),
              "--weight-version", "0", "--skip-tokenizer-init",
              "--max-running-requests", str(cfg.sampler.max_running),
              # The length budget of every request is computed against this (new_token_budget).
              "--context-length", str(cfg.sampler.max_seq_len),
              # Exact per-token versions: with the overlap scheduler an in_place update records
              # len(output_ids) while the in-flight batch's result is still queued, so up to one
              # old-weights token per running request would land in the new version's span.
              "--disable-overlap-schedule"]
    if cfg.algo.routing_replay == "r3":  # SGLang's route capture (ServerArgs.enable_return_routed_experts)
        common.append("--enable-return-routed-experts")
    if cfg.sampler.kv_on_update == "recompute":
        # retract must recompute: otherwise the prompt's KV stays in the radix cache and is reused after
        # continue (a flush cannot be relied on: it is refused while any request runs).
        common.append("--disable-radix-cache")
    if sc.server == "builtin":
        return [sys.executable, "-m", "megarl.sampler.sglang_server", *common,
                "--kv-on-update", cfg.sampler.kv_on_update, *sc.server_args]
    return [sys.executable, "-m", "sglang.launch_server", *common, "--tp-size", str(sc.tp), *sc.server_args]


def new_api_key() -> str:
    """A server's key: 256 random bits in hex. Not token_urlsafe: its alphabet has "-", and SGLang's `--config`
    turns `api-key: -x...` into the arguments `--api-key -x...`, which argparse reads as a missing value (seen
    once in CI: 1 launch in 64)."""
    return secrets.token_hex(32)


def write_secret_args(path: Path, api_key: str) -> Path:
    """The server's `--api-key` in a YAML flags file only this user can read (a command line is visible to
    every user of the machine in /proc); created fresh, never over an existing file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"api-key: {json.dumps(api_key)}\n")
    return path


_LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """preexec_fn: the server gets SIGTERM when the sampler process dies, even by SIGKILL (Linux).
    (libc is loaded at import: the child of a threaded process should run as little as possible.)"""
    _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    """One server process this sampler rank started: its log file, health, death and teardown."""

    # For another server kind (megarl.sampler.vllm_engine): its error, its name, its config section.
    error_type, kind, section = SGLangError, "SGLang", "sampler.sglang"

    def __init__(self, cmd: list[str], env: dict, log_path: Path, url: str):
        self.cmd, self.url, self.log_path = cmd, url, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # Owner-only: servers log their arguments at start-up, and the log names the run's requests.
        with os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            self.log_start = os.fstat(log.fileno()).st_size  # where this process's lines begin (a restart appends)
            # Its own session: stop() ends the server and everything it spawned (SGLang's scheduler and
            # detokenizer processes) with one killpg, without touching this process's group.
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                         preexec_fn=_die_with_parent if _LIBC is not None else None)

    def lost_its_port(self) -> bool:
        """It exited because its port was taken (EADDRINUSE: "[Errno 98] ... address already in use", as uvicorn
        and Python's socketserver both say it)."""
        if self.proc.poll() is None:
            return False
        try:
            with self.log_path.open("rb") as log:
                log.seek(self.log_start)
                own = log.read().decode(errors="replace")
        except OSError:
            return False
        return "address already in use" in "\n".join(own.splitlines()[-LOG_TAIL_LINES:]).lower()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError as exc:
            return f"(log {self.log_path} unreadable: {exc})"
        return f"last {len(text)} lines of {self.log_path}:\n" + "\n".join(text)

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise self.error_type(f"{self.kind} server {self.url} (pid {self.proc.pid}) exited with code {code}; "
                                  f"command: {' '.join(self.cmd)}\n{self.log_tail()}")

    def wait_healthy(self, client: "HTTPClient", timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            try:
                if client.get("/health", timeout_s=5.0)[0] == 200:
                    return
            except self.error_type:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise self.error_type(f"{self.kind} server {self.url} (pid {self.proc.pid}) did not answer GET /health "
                                      f"within {self.section}.startup_timeout_s={timeout_s:.0f}s\n{self.log_tail()}")
            if (signum := stop_signal()) is not None:  # a stop during start-up: no wait (lifetime)
                raise StopRequested(signum, f"the {self.kind} server {self.url} to answer GET /health")
            time.sleep(HEALTH_POLL_S)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout_s)
                return
            except subprocess.TimeoutExpired:
                continue


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a Unix domain socket: a server listening on a path instead of a port (vLLM's `--uds`)."""

    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class HTTPClient:
    """JSON over HTTP to one server; every call has a timeout and failures name the route and server. The server
    listens on host:port, or on the Unix socket `uds` (then host and port are unused)."""

    def __init__(self, host: str, port: int, timeout_s: float, describe=lambda: "", api_key: str | None = None,
                 uds: str | None = None):
        self.host, self.port, self.timeout_s, self.describe, self.uds = host, port, timeout_s, describe, uds
        self.url = f"unix:{uds}" if uds else f"http://{host}:{port}"
        self.headers = {"Content-Type": "application/json"}
        if api_key is not None:  # the server's --api-key: every call but /health needs it
            self.headers["Authorization"] = f"Bearer {api_key}"

    def error(self, route: str, why: str) -> SGLangError:
        tail = self.describe()
        return SGLangError(f"{route} on SGLang server {self.url}: {why}" + (f"\n{tail}" if tail else ""))

    def _open(self, method: str, route: str, body: dict | None, timeout_s: float):
        conn = (UnixHTTPConnection(self.uds, timeout_s) if self.uds
                else http.client.HTTPConnection(self.host, self.port, timeout=timeout_s))
        try:
            payload = None if body is None else json.dumps(body).encode()
            conn.request(method, route, body=payload, headers=self.headers)
            return conn, conn.getresponse()
        except TimeoutError:
            conn.close()
            raise self.error(route, f"no answer within {timeout_s:.0f}s") from None
        except OSError as exc:
            conn.close()
            raise self.error(route, f"{type(exc).__name__}: {exc}") from None

    def get(self, route: str, timeout_s: float | None = None) -> tuple[int, bytes]:
        return self._call("GET", route, None, timeout_s)

    def post(self, route: str, body: dict | None = None, timeout_s: float | None = None) -> dict:
        """POST, expecting HTTP 200 with a JSON body."""
        status, data = self._call("POST", route, body or {}, timeout_s)
        if status != 200:
            raise self.error(route, f"HTTP {status}: {data[:2000].decode(errors='replace')}")
        return json.loads(data)

    def _call(self, method, route, body, timeout_s) -> tuple[int, bytes]:
        timeout_s = timeout_s or self.timeout_s
        conn, resp = self._open(method, route, body, timeout_s)
        try:
            return resp.status, resp.read()
        except (TimeoutError, OSError) as exc:
            raise self.error(route, f"reading the answer failed after up to {timeout_s:.0f}s: {exc!r}") from None
        finally:
            conn.close()

    # What the request body names its id, and the config key of `timeout_s` (for the messages).
    request_id_key, timeout_key = "rid", "sampler.sglang.request_timeout_s"

    def stream(self, route: str, body: dict) -> Iterator[dict]:
        """POST a streaming request; yield its SSE `data: {...}` chunks as they arrive, up to `data: [DONE]`;
        every read is bounded by `timeout_s`."""
        conn, resp = self._open("POST", route, body, self.timeout_s)
        request, count = f"request {body.get(self.request_id_key)}", 0
        try:
            if resp.status != 200:
                raise self.error(route, f"{request}: HTTP {resp.status}: {resp.read()[:2000].decode(errors='replace')}")
            while True:
                line = resp.readline()
                if not line:
                    raise self.error(route, f"{request}: the stream ended without data: [DONE] after {count} "
                                            f"chunks (server died?)")
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise self.error(route, f"{request} failed: {chunk['error']}")
                count += 1
                yield chunk
        except (TimeoutError, OSError) as exc:
            raise self.error(route, f"{request}: no stream data for {self.timeout_s:.0f}s ({self.timeout_key}) "
                                    f"or connection lost after {count} chunks: {exc!r}") from None
        finally:
            conn.close()


# ---------------------------------------------------------------------------------------------- engine
class SGLangEngine:
    """The `Engine` protocol over one SGLang server (see module docstring)."""

    def __init__(self, client: HTTPClient, *, max_running: int, context_length: int, pause_mode: str = "in_place",
                 cache_on_update: str = "keep", min_new_tokens: int = 1, server: ServerProcess | None = None,
                 version: int = 0, route_shape: RouteShape | None = None):
        self.client, self.server = client, server
        self.route_shape = route_shape  # ask for and read every request's routes (algo.routing_replay=r3)
        self.context_length, self.min_new_tokens = context_length, min_new_tokens
        self.pause_mode, self.cache_on_update = pause_mode, cache_on_update
        self.max_running = max_running
        self._version = version
        self.requests = RequestPool(max_running, "sglang")  # one thread per request in flight
        self._stats = {"swaps": 0, "swap_time_s": 0.0,
                       "cache_flushes": 0, "cache_flushes_skipped": 0}
        self._closed = False
        self.group_name: str | None = None  # of the weight-update group, once joined

    @classmethod
    def from_config(cls, cfg, topo, model_dir: str | Path) -> "SGLangEngine":
        """Start this sampler rank's server (on its GPU slice, with real SGLang) and wait until it is healthy."""
        from megarl.distributed.sglang_publish import free_port
        from megarl.distributed.topology import sglang_gpu_slice

        sc = cfg.sampler.sglang
        env = server_env(os.environ)
        if sc.server == "sglang":
            check_sglang_serves(json.loads((Path(model_dir) / "config.json").read_text()))
            gpus = sglang_gpu_slice(topo.rank, int(os.environ.get("LOCAL_RANK", topo.rank)),
                                    int(os.environ.get("LOCAL_WORLD_SIZE", topo.world_size)), topo.num_learners,
                                    sc.tp, sc.gpus_per_node)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        else:
            env["OMP_NUM_THREADS"] = str(cfg.sampler.threads)
        route_shape = None
        if cfg.algo.routing_replay == "r3":
            route_shape = moe.route_shape(json.loads((Path(model_dir) / "config.json").read_text()))
        # A key of this server's own: any local process can reach 127.0.0.1, and the server's routes pause
        # generation and load weights (docs/security.md).
        api_key = new_api_key()
        log_path = Path(cfg.run.dir) / "sglang" / f"sampler{topo.role_rank}.log"
        # sampler.sglang.port=0: a port free a moment ago, which another process may bind before the server
        # does; a server that exits saying so is started again on another one.
        attempts = 1 if sc.port else PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            port = sc.port + topo.role_rank if sc.port else free_port("127.0.0.1")
            secret_args = write_secret_args(Path(cfg.run.dir) / "sglang" / f"sampler{topo.role_rank}.secret.yaml",
                                            api_key)
            cmd = server_command(cfg, model_dir, port, seed=cfg.run.seed * 1000 + topo.rank, secret_args=secret_args)
            server = ServerProcess(cmd, env, log_path, f"http://127.0.0.1:{port}")
            client = HTTPClient("127.0.0.1", port, sc.request_timeout_s, describe=server.log_tail, api_key=api_key)
            try:
                try:
                    server.wait_healthy(client, sc.startup_timeout_s)
                finally:
                    secret_args.unlink(missing_ok=True)  # read at start-up; healthy (or dead) means it was read
            except BaseException as exc:
                server.stop()
                if isinstance(exc, SGLangError) and attempt < attempts and server.lost_its_port():
                    print(f"megarl: sampler {topo.role_rank}: port {port} was taken before the server bound it; "
                          f"starting it on another (attempt {attempt + 1} of {attempts})", flush=True)
                    continue
                raise
            break
        try:
            info = client.get("/server_info")  # both supported releases serve it (/get_server_info: deprecated)
            if info[0] != 200:
                raise client.error("/server_info", f"HTTP {info[0]}: {info[1][:2000].decode(errors='replace')}")
            version = json.loads(info[1]).get("version", "(none)")
            check_server_version(version, client.url)
            if route_shape is not None:
                check_routed_experts(version, client.url)
        except BaseException:
            server.stop()
            raise
        return cls(client, max_running=cfg.sampler.max_running, context_length=cfg.sampler.max_seq_len,
                   server=server, cache_on_update=sc.cache_on_update, min_new_tokens=sc.min_new_tokens,
                   pause_mode="in_place" if cfg.sampler.kv_on_update == "keep" else "retract", route_shape=route_shape)

    # ------------------------------------------------------------------ Engine protocol
    @property
    def version(self) -> int:
        return self._version

    @property
    def num_unfinished(self) -> int:
        return self.requests.unfinished

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; ValueError if the context leaves it fewer than min_new_tokens (the sampler loop
        skips and counts such prompts before they get here)."""
        if self._closed:
            raise RuntimeError("SGLangEngine is closed")
        if self.context_length - len(request.prompt_ids) < self.min_new_tokens:
            raise ValueError(f"request {request.request_id}: a prompt of {len(request.prompt_ids)} tokens leaves "
                             f"{self.context_length - len(request.prompt_ids)} of sampler.max_seq_len="
                             f"{self.context_length}, fewer than sampler.sglang.min_new_tokens={self.min_new_tokens}")
        self.requests.submit(self._generate, request)

    def step(self) -> list[Completion]:
        """The requests finished since the last call (RequestPool.finished); raises if the server died or a
        request failed."""
        if self.server is not None:
            self.server.check_alive()
        return self.requests.finished()

    def pinned(self, *, max_running: int, seed: int) -> "SGLangEngine":
        """An evaluation's view (request_pool.pinned_view). `seed` is not sent: the server samples with its own
        generator, so a score here is of one version but not the sample-for-sample twin of `megarl eval`'s."""
        return pinned_view(self, max_running)

    def stage_weights(self, named_tensors, version: int) -> None:
        raise TypeError("SGLangEngine receives weights on the server, over SGLang's weight-update group "
                        "(SGLangWeightFollower), not through the sampler process")

    def stats(self) -> dict:
        return dict(self._stats, **self.requests.stats(), version=self._version)

    def _generate(self, request: GenerationRequest) -> Completion:
        try:
            body = generate_body(request, self.context_length, routed_experts=self.route_shape is not None)
            completion = completion_from_chunks(request, self.client.stream("/generate", body), self.route_shape)
        except (KeyError, TypeError, ValueError) as exc:
            raise SGLangError(f"/generate on SGLang server {self.client.url}: unusable response for request "
                              f"{request.request_id}: {exc!r}") from None
        if completion.finish_reason == "abort":
            raise SGLangError(f"/generate on SGLang server {self.client.url}: request {request.request_id} was "
                              f"aborted by the server after {len(completion.token_ids)} tokens (megarl pauses with "
                              f"mode {self.pause_mode!r}, never 'abort': who aborted it? see the server log)")
        return completion

    # ------------------------------------------------------------------ weight updates
    def join_update_group(self, group: dict, rank_offset: int) -> None:
        """POST /init_weights_update_group; returns once every member (learner included) has joined."""
        body = {"master_address": group["host"], "master_port": group["port"], "rank_offset": rank_offset,
                "world_size": group["world_size"], "group_name": group["group_name"], "backend": group["backend"]}
        reply = self.client.post("/init_weights_update_group", body)
        if not reply.get("success"):
            raise self.client.error("/init_weights_update_group", reply.get("message", str(reply)))
        self.group_name = group["group_name"]

    def leave_update_group(self) -> None:
        """POST /destroy_weights_update_group for the group joined last (fault.on_failure=replace: before the
        next membership epoch's); a failure is logged, not raised: the server joins the next group by its own name."""
        if self.group_name is None:
            return
        name, self.group_name = self.group_name, None
        try:
            self._checked_post("/destroy_weights_update_group", {"group_name": name})
        except SGLangError as exc:
            log.warning("leaving SGLang weight-update group %s failed: %s", name, exc)

    def update_weights(self, version: int, weight_format: str, calls: list, continue_on_failure: bool = True) -> None:
        """Apply `version` in flight: pause, open the weight-update session, receive every call's tensors,
        close the session, (flush), continue.  On any failure the session is closed and generation
        continued before the error propagates, so the server is never left paused or inside a session; with
        `continue_on_failure` False (fault.on_failure=replace) it stays paused instead: it may hold part of the
        version, and generates nothing until the next whole one (the next membership epoch's first publish)."""
        start = time.perf_counter()
        try:
            self.client.post("/pause_generation", {"mode": self.pause_mode})
            self._checked_post("/begin_weight_update", {})
            try:
                for i, call in enumerate(calls):
                    # The label changes with the last call only, once the whole version is loaded.
                    label = str(version) if i == len(calls) - 1 else None
                    self._checked_post("/update_weights_from_distributed",
                                       update_body(call, weight_format, self.group_name, label))
            except BaseException:
                self._after_failure("/end_weight_update")
                raise
            self._checked_post("/end_weight_update", {})
            if self.cache_on_update == "flush":
                # SGLang flushes only when no request runs or waits (HTTP 400 otherwise): a skip is not an error.
                status, _ = self.client.get("/flush_cache")
                self._stats["cache_flushes" if status == 200 else "cache_flushes_skipped"] += 1
        except BaseException:
            if continue_on_failure:
                self._after_failure("/continue_generation")
            raise
        self._checked_post("/continue_generation", {})
        self._version = version
        self._stats["swaps"] += 1
        self._stats["swap_time_s"] += time.perf_counter() - start

    def _checked_post(self, route: str, body: dict) -> dict:
        """POST a control call; SGLangError unless HTTP 200 and (where the reply has one) success."""
        reply = self.client.post(route, body)
        if not reply.get("success", True):
            raise self.client.error(route, reply.get("message", str(reply)))
        return reply

    def _after_failure(self, route: str) -> None:
        """Close the session / continue after a failed update; a failure here is logged, not raised: the
        error already propagating is the one that explains what went wrong."""
        try:
            self._checked_post(route, {})
        except SGLangError as exc:
            log.warning("after a failed weight update, %s failed too: %s", route, exc)

    def close(self) -> None:
        """Stop the server (its streams then fail and their threads end) and the request threads."""
        self._closed = True
        if self.server is not None:
            self.server.stop()
        self.requests.close()


class SGLangWeightFollower:
    """Sampler side of the SGLang weight sync: a thread that joins the update group, then applies every
    published version through the engine and reports it with `on_published(version, extra)`.

    Same surface as the built-in receivers (`start()`, `join()`, `error`), so the sampler loop treats both alike."""

    def __init__(self, engine: SGLangEngine, store, rank_offset: int, on_published, should_stop,
                 before_update=lambda version: None, follower=None):
        self.engine, self.store, self.rank_offset = engine, store, rank_offset
        # fault.on_failure=replace: a membership.EpochFollower whose groups are this server's weight-update groups
        # (`join_epoch`); a replacement joins no group before an epoch names it.
        self.follower = follower
        self.on_published, self.should_stop = on_published, should_stop
        # Called with the server's version before each update leaves it: evaluation holds a due version there.
        self.before_update = before_update
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="megarl-sglang-weights", daemon=True)

    @classmethod
    def from_config(cls, engine: SGLangEngine, store, cfg, topo, on_published, should_stop,
                    before_update=lambda version: None) -> "SGLangWeightFollower":
        from megarl.distributed.topology import sglang_group_layout

        _, offsets = sglang_group_layout(topo.num_samplers, cfg.sampler.sglang.tp)
        follower = None
        if cfg.fault.on_failure == "replace":
            from megarl.distributed.membership import EpochFollower, incarnation

            from megarl.distributed.membership import rejoin_timeout_s

            tp, timeout_s = cfg.sampler.sglang.tp, 2 * cfg.publish.timeout_s
            follower = EpochFollower(store, topo.rank, incarnation(),
                                     lambda epoch, rank, size: join_epoch(engine, store, epoch, rank, size, tp,
                                                                          timeout_s),
                                     rejoin_timeout_s=rejoin_timeout_s(cfg))
        return cls(engine, store, offsets[topo.role_rank], on_published, should_stop, before_update, follower)

    def start(self) -> "SGLangWeightFollower":
        self.thread.start()
        return self

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)

    def _wait_key(self, key: str) -> bool:
        """Poll until the key exists (no overall limit: a learner step may be slow); False on stop."""
        while not self.store.check([key]):
            if self.should_stop():
                return False
            time.sleep(STORE_POLL_S)
        return True

    def _next_header(self, index: int) -> int | None:
        """The index of the next publish to apply (`index`, or a newer membership epoch's first, once this server
        joined that epoch's group) once its header exists; None on stop."""
        while True:
            if self.follower is not None:
                first = self.follower.follow()  # SamplerDropped when an epoch leaves this incarnation out
                if first is not None:
                    index = first
            if self.follower is None or self.follower.group is not None:
                if self.store.check([header_key(index)]):
                    return index
            if self.should_stop():
                return None
            time.sleep(STORE_POLL_S if self.follower is None else 0.01)

    def _run(self) -> None:
        try:
            if self.follower is None or self.follower.incarnation == 0:  # the run's first group (epoch 0)
                if not self._wait_key(GROUP_KEY):
                    return
                self.engine.join_update_group(json.loads(self.store.get(GROUP_KEY)), self.rank_offset)
                if self.follower is not None:
                    self.follower.group = self.engine.group_name
            index, calls = 1, None
            while (index := self._next_header(index)) is not None:
                header = json.loads(self.store.get(header_key(index)))
                if calls is None:
                    weight_format, calls = load_spec(self.store.get(SPEC_KEY))
                self.before_update(self.engine.version)
                try:
                    self.engine.update_weights(header["version"], weight_format, calls,
                                               continue_on_failure=self.follower is None)
                except (RuntimeError, TimeoutError) as exc:
                    if self.follower is None:
                        raise
                    # A member died during this publish (the learner publishes again over a new epoch, whole): the
                    # server, paused with part of the version, waits for it. Its own death fails the sampler's step.
                    index = self.follower.wait_for_epoch(self.should_stop, self.follower.rejoin_timeout_s, exc)
                    if index is None:  # the run stops
                        return
                    continue
                self.on_published(header["version"], header.get("extra", {}))
                index += 1
        except BaseException as exc:  # surfaced to the sampler loop through `error`
            self.error = exc


def join_epoch(engine: SGLangEngine, store, epoch: int, group_rank: int, size: int, tp: int, timeout_s: float) -> str:
    """fault.on_failure=replace: make this sampler's server leave its weight-update group and join membership
    epoch `epoch`'s, as member `group_rank` of `size` (megarl.distributed.sglang_publish.epoch_layout); the
    group's name. The learner describes the group (epoch_group_key) once it recorded the epoch: waited for up to
    `timeout_s`."""
    key, deadline = epoch_group_key(epoch), time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"SGLang weight-update group of publish epoch {epoch}: not described under {key} "
                               f"within {timeout_s:.0f}s (2 * publish.timeout_s)")
        time.sleep(STORE_POLL_S)
    group = json.loads(store.get(key))
    world_size, offset = epoch_layout(group_rank, size, tp)
    if group["world_size"] != world_size:
        raise ValueError(f"publish epoch {epoch}: the learner's SGLang group has {group['world_size']} ranks, "
                         f"this member's layout {world_size}")
    engine.leave_update_group()
    engine.join_update_group(group, offset)
    return engine.group_name
