"""The vLLM engine backend: a sampler rank starts one vLLM OpenAI-compatible server and drives it over HTTP.

`VLLMEngine` implements the `Engine` protocol (megarl/protocols.py). The server runs with the python of the
separate vLLM environment (megarl.sampler.vllm_env), in the sampler's environment without torchrun's variables
(sglang_engine.server_env) plus `VLLM_SERVER_DEV_MODE=1` (the pause/resume and collective_rpc routes) and megarl's
worker extension on PYTHONPATH (megarl/sampler/vllm_ext).

Who can reach it: vLLM 0.32 checks its API key on its API prefixes only, not on the dev-mode routes that pause the
engine and call into the worker. So the server listens on no port at all: `--uds` puts its HTTP server on a Unix
socket in a fresh directory only this user can enter (`SocketDir`, 0700), where vLLM's own ZeroMQ sockets go too
(VLLM_RPC_BASE_PATH), and megarl's client talks over that socket. Behind that, every call into megarl's worker
extension is signed with a key only the server's environment holds (megarl_vllm_worker.RpcGuard).

Generation: one streaming `POST /v1/completions` per request, token ids in (`prompt: [ids]`), `logprobs: 0`
(the sampled token's log-prob), `return_token_ids: true` (each chunk's new token ids). The server runs with
`--logprobs-mode processed_logprobs`: the log-prob after temperature (and top-k/top-p, which megarl refuses),
i.e. log_softmax(logits / T) over the full vocabulary, megarl's behaviour log-prob (docs/vllm.md measures
raw vs processed against transformers).

Weights: the sampler process receives each version from the learner over megarl's publish groups (the
built-in path: buckets over gloo/NCCL, StagedReceiver) and hands it to `stage_weights`, which applies it in
flight on the server:

    POST /pause?mode=keep&clear_cache=C   running requests stay in the scheduler; no engine step runs. C is
                                     sent explicitly (vLLM 0.32's default, true, resets the prefix cache with
                                     reset_running_requests=True, whatever its docstring says): false for
                                     kv_on_update=keep (their KV cache stays), true for recompute (they are
                                     preempted and re-prefilled under the new weights at /resume)
    POST /collective_rpc megarl_update   in the worker: count every request's sampled tokens, then receive the
                                     buckets (gloo group sampler <-> vLLM worker) and reload the weights
    (sampler broadcasts the buckets meanwhile)
    POST /resume                     the frozen requests continue under the new weights

Per-token versions: vLLM reports none per token, so megarl derives them from the counts `megarl_update`
returns (taken in the worker between two engine steps, before the first new weight is loaded): for each
update, the first `count` tokens of a request are older than it, the rest newer. The record of an update is
kept before /resume, so a token sampled by the new weights can never be assigned before its update is known.
The argument that this is exact is in docs/vllm.md; tests/sampler/vllm/ checks it against recomputation.

LoRA (learner.lora, `take_adapters`): a version is then the adapter tensors only (megarl.models.lora's names). The
same pause -> megarl_update -> resume carries them to the worker, which merges them into the frozen base it holds
(megarl_lora_base) and reloads: vLLM serves the merged model without `enable_lora`, so nothing is keyed by an
adapter name and versions and KV policy are exactly those of full weights (docs/lora.md says why not vLLM's LoRA).

Every HTTP call and every wait has a timeout; every error is a VLLMError naming the server URL and the call,
with the tail of the server's log.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from megarl.protocols import Completion, GenerationRequest
from megarl.sampler import sglang_engine
from megarl.sampler.request_pool import RequestPool, pinned_view
from megarl.sampler.vllm_ext import megarl_vllm_worker as ext

EXT_DIR = Path(__file__).resolve().parent / "vllm_ext"
PORTABLE_DIR = Path(__file__).resolve().parent.parent / "portable"  # torch-only modules the worker shares with megarl
WORKER_EXTENSION = "megarl_vllm_worker.MegarlWorkerExtension"
SERVED_NAME = "megarl"
# sampler.kv_on_update -> /pause's clear_cache (vLLM 0.32, v1/engine/core.py: `_finish_pause(clear_cache)` calls
# `reset_prefix_cache(reset_running_requests=True)`, which preempts every running request: num_computed_tokens = 0,
# its blocks freed, so /resume prefills prompt + output again, under the new weights). Always sent, never left to
# vLLM's default (true: keep would silently be recompute). Its docstring says the flag is ignored with mode=keep; a
# release that makes the code match it turns recompute into keep, which tests/sampler/vllm/test_vllm_engine.py's KV
# test catches (it checks the log-probs after an update against both policies' recomputation).
CLEAR_CACHE = {"keep": "false", "recompute": "true"}
MIN_HEAD_DIM = 32  # vLLM's CPU attention backend refuses smaller heads
SOCKET_NAME = "http.sock"
SUN_PATH_MAX = 107  # a Unix socket path's bytes (sockaddr_un.sun_path is 108, NUL included)
log = logging.getLogger("megarl.vllm_engine")


class VLLMError(RuntimeError):
    """A failed call to (or death of) a vLLM server; the message names the server, the call and the log tail."""


class _Client(sglang_engine.HTTPClient):
    request_id_key, timeout_key = "request_id", "sampler.vllm.request_timeout_s"

    def error(self, route: str, why: str) -> VLLMError:
        tail = self.describe()
        return VLLMError(f"{route} on vLLM server {self.url}: {why}" + (f"\n{tail}" if tail else ""))


class _Server(sglang_engine.ServerProcess):
    error_type, kind, section = VLLMError, "vLLM", "sampler.vllm"


class SocketDir:
    """A fresh directory only this user can enter (mkdtemp: mode 0700), holding the server's sockets: its HTTP
    socket (`path`) and vLLM's ZeroMQ ones. The kernel checks the directory on every connect, so processes of
    other users cannot reach the server. Removed by `remove()` (VLLMEngine.close)."""

    def __init__(self, parent: str | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="megarl-vllm-", dir=parent))
        self.path = str(self.dir / SOCKET_NAME)
        if len(self.path.encode()) > SUN_PATH_MAX:
            self.remove()
            raise ValueError(f"vLLM server socket {self.path}: longer than {SUN_PATH_MAX} bytes, the limit of a Unix "
                             f"socket path; set TMPDIR to a shorter directory")

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- pure helpers
def check_model(hf_config: dict, path: str = "") -> None:
    """vLLM on CPU needs head_dim >= 32; refuse a model with smaller heads before starting anything."""
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    if head_dim < MIN_HEAD_DIM:
        raise ValueError(f"model {path}: head_dim {head_dim} < {MIN_HEAD_DIM}, which vLLM's CPU attention refuses "
                         f"(sampler.engine=vllm); the embedded demo model has a vLLM variant "
                         f"(megarl.config.schema.VLLM_VARIANTS) that model.path=embedded:<name> picks automatically")


def server_env(env: dict, cfg_vllm, threads: int) -> dict:
    """The server's environment: the sampler's without torchrun's variables, plus vLLM dev mode and megarl's
    worker extension and the torch-only modules it uses on PYTHONPATH (nothing else of megarl: the server runs in
    the vLLM environment). `VLLMEngine.start` adds the server's keys and its socket directory."""
    out = sglang_engine.server_env(env)
    out.pop("PYTHONPATH", None)  # megarl's environment's paths must not leak into vLLM's
    for key in ("VLLM_API_KEY", ext.RPC_KEY_ENV, "VLLM_RPC_BASE_PATH"):  # never one inherited from the sampler's
        out.pop(key, None)
    out.update({"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": os.pathsep.join((str(EXT_DIR), str(PORTABLE_DIR))),
                "VLLM_CPU_KVCACHE_SPACE": str(cfg_vllm.kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "OMP_NUM_THREADS": str(threads), "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"})
    return out


def server_command(python: str | Path, model_dir: str | Path, socket_path: str, seed: int, *, max_model_len: int,
                   max_num_seqs: int, enforce_eager: bool = True, prefix_caching: bool = False,
                   extra: list[str] = ()) -> list[str]:
    """The server's command line: HTTP on the Unix socket `socket_path` only (`--uds`: vLLM then ignores host
    and port and opens no TCP listener)."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--uds", str(socket_path), "--served-model-name", SERVED_NAME, "--dtype", "float32",
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs), "--seed", str(seed),
           # megarl's behaviour log-prob: log_softmax(logits / T), what vLLM calls processed (docs/vllm.md).
           "--logprobs-mode", "processed_logprobs",
           "--worker-extension-cls", WORKER_EXTENSION,
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    if enforce_eager:
        cmd.append("--enforce-eager")
    if json.loads((Path(model_dir) / "config.json").read_text()).get("kv_lora_rank"):
        # Multi-latent attention: on a CPU with AMX tiles vLLM picks its AMX MLA backend, which packs the weights
        # for bf16 / int8 only and fails at load on the fp32 model megarl serves; its reference CPU MLA takes fp32.
        cmd += ["--attention-backend", "CPU_MLA"]
    return cmd + list(extra)


def completion_body(request: GenerationRequest, server_id: str, context_length: int) -> dict:
    sp = request.sampling
    return {"model": SERVED_NAME, "prompt": list(request.prompt_ids), "request_id": server_id, "stream": True,
            "max_tokens": sglang_engine.new_token_budget(request, context_length),
            "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k if sp.top_k > 0 else -1,
            "logprobs": 0, "return_token_ids": True, "stop_token_ids": list(request.stop_token_ids),
            "skip_special_tokens": False}


def versions_from_swaps(n: int, start_version: int, swaps: list[tuple[int, int]]) -> list[int]:
    """Per-token versions of a request with n output tokens that began under `start_version`, given the
    updates during its life in order as (new version, tokens the request had sampled at that update)."""
    versions, version, done = [], start_version, 0
    for new_version, count in swaps:
        count = min(count, n)
        if count < done:
            raise ValueError(f"token counts at updates decrease ({count} < {done}): {swaps}")
        versions += [version] * (count - done)
        version, done = new_version, count
    return versions + [version] * (n - done)


def weight_spec(model_dir: str | Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """HF name -> (shape, dtype) of the model directory's safetensors, read from their headers (no tensor loaded)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    spec = {}
    for name in files:
        with safe_open(str(model_dir / name), "pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                dtype = getattr(torch, {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}[
                    sl.get_dtype()])
                spec[key] = (torch.Size(sl.get_shape()), dtype)
    return spec


_INTERNAL_ID = re.compile(r"^cmpl-(megarl\d+)-")


def counts_by_server_id(counts: dict) -> dict[str, int]:
    """The worker's counts are keyed by vLLM's internal ids, "cmpl-<request_id>-<index>-<random>"."""
    out = {}
    for internal, count in counts.items():
        match = _INTERNAL_ID.match(internal)
        if match:
            out[match.group(1)] = max(count, out.get(match.group(1), 0))
    return out


# ---------------------------------------------------------------------------------------------- engine
class _Tracked:
    __slots__ = ("request", "server_id", "start_version", "first_swap", "received")

    def __init__(self, request, server_id, start_version, first_swap):
        self.request, self.server_id = request, server_id
        self.start_version, self.first_swap, self.received = start_version, first_swap, 0


class VLLMEngine:
    """The `Engine` protocol over one vLLM server (see module docstring)."""

    def __init__(self, client: _Client, *, model_dir: str | Path, max_running: int, context_length: int,
                 server: _Server | None = None, version: int = 0, update_timeout_s: float = 120.0,
                 bucket_mb: float = 16.0, kv_on_update: str = "keep", rpc_key: str = "",
                 socket_dir: SocketDir | None = None):
        if kv_on_update not in CLEAR_CACHE:
            raise ValueError(f"kv_on_update={kv_on_update!r} must be one of {tuple(CLEAR_CACHE)}")
        self.client, self.server = client, server
        self.kv_on_update = kv_on_update
        self.context_length, self.max_running = context_length, max_running
        self.update_timeout_s, self.bucket_bytes = update_timeout_s, int(bucket_mb * 2 ** 20)
        self.model_dir = Path(model_dir)
        self._spec = weight_spec(model_dir)
        self.device = torch.device("cpu")
        self._version = version
        self._lock = threading.Lock()
        self._swaps: list[tuple[int, dict[str, int]]] = []  # (new version, server id -> tokens sampled before it)
        self._running: dict[str, _Tracked] = {}
        self._ids = iter(range(1, 1 << 62))
        self.requests = RequestPool(max_running, "vllm")  # one thread per request in flight
        self._stats = {"swaps": 0, "swap_time_s": 0.0,
                       "swap_pause_s": 0.0}
        self._group = None
        self._store = None
        self._closed = False
        # The worker extension's key (the server's MEGARL_VLLM_RPC_KEY) and the counters its calls are signed with.
        # Shared by reference with pinned views (copy.copy), so one counter signs every call to this server.
        self._rpc_key, self._rpc_counter, self._rpc_lock = rpc_key.encode(), itertools.count(1), threading.Lock()
        self.socket_dir = socket_dir

    @classmethod
    def from_config(cls, cfg, topo, model_dir: str | Path) -> "VLLMEngine":
        """Start this sampler rank's vLLM server, wait for /health, join the weight group."""
        from megarl.sampler.vllm_env import ensure_env

        vc = cfg.sampler.vllm
        with open(Path(model_dir) / "config.json") as fh:
            check_model(json.load(fh), str(model_dir))
        python, _ = ensure_env()
        sockets = SocketDir()
        cmd = server_command(python, model_dir, sockets.path, cfg.run.seed * 1000 + topo.rank,
                             max_model_len=cfg.sampler.max_seq_len, max_num_seqs=cfg.sampler.max_running,
                             enforce_eager=vc.enforce_eager, prefix_caching=vc.prefix_caching, extra=vc.server_args)
        return cls.start(cmd, server_env(os.environ, vc, cfg.sampler.threads),
                         Path(cfg.run.dir) / "vllm" / f"sampler{topo.role_rank}.log", sockets, model_dir=model_dir,
                         max_running=cfg.sampler.max_running, context_length=cfg.sampler.max_seq_len,
                         startup_timeout_s=vc.startup_timeout_s, request_timeout_s=vc.request_timeout_s,
                         update_timeout_s=cfg.publish.timeout_s, bucket_mb=cfg.publish.bucket_mb,
                         kv_on_update=cfg.sampler.kv_on_update,
                         lora=cfg.learner.lora if cfg.learner.lora.rank > 0 else None)

    @classmethod
    def start(cls, cmd, env, log_path: Path, sockets: SocketDir, *, model_dir, max_running: int,
              context_length: int, startup_timeout_s: float, request_timeout_s: float, update_timeout_s: float = 120.0,
              bucket_mb: float = 16.0, kv_on_update: str = "keep", lora=None) -> "VLLMEngine":
        """Start the server `cmd` (listening on `sockets.path`, server_command), wait for /health, join the weight
        group. The engine owns `sockets` from here on (removed by close, or here if the start fails)."""
        # Keys of this server's own, in its environment (readable by this user only, unlike its command line):
        # vLLM's API key (vLLM checks it on /v1, /v2, /inference and /cohere only) and the worker extension's.
        api_key, rpc_key = sglang_engine.new_api_key(), sglang_engine.new_api_key()
        env = {**env, "VLLM_API_KEY": api_key, ext.RPC_KEY_ENV: rpc_key, "VLLM_RPC_BASE_PATH": str(sockets.dir)}
        try:
            server = _Server(cmd, env, Path(log_path), f"unix:{sockets.path}")
        except BaseException:
            sockets.remove()
            raise
        client = _Client("", 0, request_timeout_s, describe=server.log_tail, api_key=api_key, uds=sockets.path)
        try:
            server.wait_healthy(client, startup_timeout_s)
            engine = cls(client, model_dir=model_dir, max_running=max_running, context_length=context_length,
                         server=server, update_timeout_s=update_timeout_s, bucket_mb=bucket_mb,
                         kv_on_update=kv_on_update, rpc_key=rpc_key, socket_dir=sockets)
            engine.join_weight_group()
            if lora is not None:
                engine.take_adapters(lora)
        except BaseException:
            server.stop()
            sockets.remove()
            raise
        return engine

    # ------------------------------------------------------------------ Engine protocol
    @property
    def version(self) -> int:
        return self._version

    @property
    def num_unfinished(self) -> int:
        return self.requests.unfinished

    def weight_spec(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """HF name -> (shape, dtype) of every tensor `stage_weights` takes (the model directory's; the adapter's
        after `take_adapters`)."""
        return dict(self._spec)

    def add_request(self, request: GenerationRequest) -> None:
        if self._closed:
            raise RuntimeError("VLLMEngine is closed")
        if len(request.prompt_ids) + 1 > self.context_length:
            raise ValueError(f"request {request.request_id}: a prompt of {len(request.prompt_ids)} tokens leaves no "
                             f"room in sampler.max_seq_len={self.context_length}")
        if request.sampling.top_p < 1 or request.sampling.top_k > 0:
            raise ValueError(f"request {request.request_id}: sampler.engine=vllm needs top_p=1 and top_k=0 (vLLM's "
                             f"processed log-probs fold the truncation in)")
        self.requests.submit(self._generate, request)

    def step(self) -> list[Completion]:
        """The requests finished since the last call (RequestPool.finished); raises VLLMError if the
        server died or a request failed."""
        if self.server is not None:
            self.server.check_alive()
        return self.requests.finished()

    def stats(self) -> dict:
        return dict(self._stats, **self.requests.stats(), version=self._version)

    def pinned(self, *, max_running: int, seed: int) -> "VLLMEngine":
        """An evaluation's view (request_pool.pinned_view): its requests' versions come from the update records
        it shares with this engine. `seed` is not sent: the server samples with its own generator."""
        view = pinned_view(self, max_running)
        view.socket_dir = None  # the engine's: closing the view must not remove the server's socket
        return view

    def generate(self, requests: list[GenerationRequest], timeout_s: float = 600.0) -> list[Completion]:
        """Run the given requests to the end; completions in request order (tests, benchmarks)."""
        for r in requests:
            self.add_request(r)
        done, deadline = {}, time.monotonic() + timeout_s
        while len(done) < len(requests):
            if time.monotonic() > deadline:
                raise VLLMError(f"vLLM server {self.client.url}: {len(requests) - len(done)} requests unfinished "
                                f"after {timeout_s:.0f}s")
            done.update({c.request_id: c for c in self.step()})
        return [done[r.request_id] for r in requests]

    def _generate(self, request: GenerationRequest) -> Completion:
        with self._lock:
            server_id = f"megarl{next(self._ids)}"
            tracked = _Tracked(request, server_id, self._version, len(self._swaps))
            self._running[server_id] = tracked
        route = "POST /v1/completions"
        try:
            tokens, logprobs, reason = [], [], None
            for chunk in self.client.stream("/v1/completions", completion_body(request, server_id,
                                                                                self.context_length)):
                choice = chunk["choices"][0]
                ids = choice.get("token_ids") or []
                lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
                if len(ids) != len(lps):
                    raise ValueError(f"a chunk has {len(ids)} token ids and {len(lps)} log-probs")
                tokens += [int(t) for t in ids]
                logprobs += [float(lp) for lp in lps]
                tracked.received = len(tokens)
                reason = choice.get("finish_reason") or reason
        except (KeyError, TypeError, ValueError) as exc:
            raise VLLMError(f"{route} on vLLM server {self.client.url}: unusable stream for request "
                            f"{request.request_id}: {exc!r}") from None
        finally:
            with self._lock:
                self._running.pop(server_id, None)
                swaps = [(v, counts.get(server_id, 0)) for v, counts in self._swaps[tracked.first_swap:]]
        if reason not in ("stop", "length"):
            raise VLLMError(f"{route} on vLLM server {self.client.url}: request {request.request_id} ended with "
                            f"finish_reason {reason!r} after {len(tokens)} tokens (megarl pauses with mode=keep, "
                            f"never abort: see the server log)")
        return Completion(request_id=request.request_id, prompt_ids=list(request.prompt_ids), token_ids=tokens,
                          logprobs=logprobs, versions=versions_from_swaps(len(tokens), tracked.start_version, swaps),
                          finish_reason=reason)

    # ------------------------------------------------------------------ weights
    def _rpc(self, method: str, args: dict, timeout_s: float) -> dict:
        """Call the worker extension's `method`, signed (megarl_vllm_worker.sign_call) with the next counter.
        megarl's calls to one server never overlap (start-up, then one update at a time), so they arrive in
        counter order, which the worker requires."""
        route = f"/collective_rpc {method}"
        with self._rpc_lock:
            envelope = ext.sign_call(self._rpc_key, method, next(self._rpc_counter), args)
        try:
            reply = self.client.post("/collective_rpc", {"method": method, "args": [envelope],
                                                         "timeout": timeout_s}, timeout_s=timeout_s + 10)
        except VLLMError as exc:  # the worker refused it (its error is in the reply): name the method too
            raise VLLMError(f"{method}: {exc}") from None
        results = reply.get("results")
        if not results or not isinstance(results[0], dict):
            raise self.client.error(route, f"unexpected reply {str(reply)[:500]}")
        return results[0]

    def _with_group(self, method: str, args: dict, timeout_s: float, local) -> dict:
        """Run the rpc (the worker's side of a group operation) on a thread while `local()` does this side."""
        result: dict = {}

        def call():
            try:
                result["reply"] = self._rpc(method, args, timeout_s)
            except BaseException as exc:  # re-raised below, on the caller's thread
                result["error"] = exc

        thread = threading.Thread(target=call, name=f"megarl-vllm-{method}", daemon=True)
        thread.start()
        try:
            local()
        except BaseException as exc:
            thread.join(5.0)
            if "error" in result:
                raise result["error"] from exc
            raise VLLMError(f"{method} with vLLM server {self.client.url}: this side failed: {exc!r}") from exc
        thread.join(timeout_s + 15)
        if thread.is_alive():
            raise VLLMError(f"/collective_rpc {method} on vLLM server {self.client.url}: no answer within "
                            f"{timeout_s + 15:.0f}s\n{self.client.describe()}")
        if "error" in result:
            raise result["error"]
        return result["reply"]

    def join_weight_group(self) -> None:
        """A two-member gloo group: this process (rank 0, hosting the store) and the server's worker (rank 1)."""
        import datetime

        from megarl.distributed.store_server import tcp_store_server

        timeout = self.update_timeout_s
        self._store = tcp_store_server("127.0.0.1", 0, datetime.timedelta(seconds=timeout), world_size=2)
        holder = {}

        def local():
            holder["group"] = ext.make_group("127.0.0.1", self._store.port, 0, 2, timeout, store=self._store)

        self._with_group("megarl_join", {"host": "127.0.0.1", "port": self._store.port, "rank": 1, "world_size": 2,
                                         "timeout_s": timeout}, timeout, local)
        self._group = holder["group"]

    def take_adapters(self, lora_cfg) -> dict:
        """From now on every version is an adapter of `lora_cfg`'s shape (learner.lora): `weight_spec()` becomes
        the adapter's (megarl.models.lora.adapter_spec) and the worker keeps the frozen base, read from the
        checkpoint the server loaded, and merges each adapter into it (megarl_lora_base). Returns the worker's
        reply (the base's tensor count and bytes)."""
        from megarl.models import lora

        hf_config = json.loads((self.model_dir / "config.json").read_text())
        lora.check(hf_config, lora_cfg)
        reply = self._rpc("megarl_lora_base", {"factor": lora.scale(lora_cfg)}, self.update_timeout_s)
        self._spec = {name: (torch.Size(shape), dtype) for name, shape, dtype in lora.adapter_spec(hf_config, lora_cfg)}
        return reply

    def stage_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Apply `version` on the server now, in flight (pause keep with this engine's clear_cache -> load ->
        resume; see module docstring).
        Returns once the server runs it. The server is resumed on every path, failed or not."""
        missing = set(self._spec) - set(named_tensors)
        if missing:
            raise ValueError(f"stage_weights: missing {sorted(missing)[:5]}")
        if version <= self._version:
            raise ValueError(f"stage_weights: version {version} is not newer than {self._version}")
        names = list(self._spec)  # the model directory's order
        spec = [(n, list(named_tensors[n].shape), str(named_tensors[n].dtype).removeprefix("torch.")) for n in names]
        plan = ext.bucket_plan(spec, self.bucket_bytes)
        start = time.perf_counter()
        self.client.post(f"/pause?mode=keep&clear_cache={CLEAR_CACHE[self.kv_on_update]}", {},
                         timeout_s=self.update_timeout_s)
        paused_at = time.perf_counter()
        try:
            with self._lock:
                received_at_pause = {sid: t.received for sid, t in self._running.items()}

            def send():
                for bucket in plan:
                    parts = [named_tensors[name].detach().contiguous().view(-1).view(torch.uint8)
                             for name, *_ in bucket["tensors"]]
                    ext.broadcast_bytes(self._group, torch.cat(parts), self.update_timeout_s)

            reply = self._with_group("megarl_update", {"version": version, "buckets": plan}, self.update_timeout_s,
                                     send)
            counts = counts_by_server_id(reply["counts"])
            for sid, received in received_at_pause.items():
                if received > counts.get(sid, 0):  # the client cannot have more tokens than the worker sampled
                    raise VLLMError(f"/collective_rpc megarl_update on vLLM server {self.client.url}: request {sid} "
                                    f"had {received} tokens at the client but {counts.get(sid, 0)} in the worker")
            with self._lock:  # before /resume: no new-weights token exists before its update is recorded
                self._swaps.append((version, counts))
                self._version = version
        except BaseException:
            try:  # never leave the server paused; the error already propagating is the one that explains
                self.client.post("/resume", {}, timeout_s=self.update_timeout_s)
            except VLLMError as exc:
                log.warning("after a failed weight update, /resume failed too: %s", exc)
            raise
        self.client.post("/resume", {}, timeout_s=self.update_timeout_s)
        self._stats["swaps"] += 1
        self._stats["swap_time_s"] += time.perf_counter() - start
        self._stats["swap_pause_s"] += time.perf_counter() - paused_at
        self._forget_swaps()

    def _forget_swaps(self) -> None:
        """Drop update records no running request needs any more (kept: those since the oldest running one)."""
        with self._lock:
            oldest = min((t.first_swap for t in self._running.values()), default=len(self._swaps))
            for i in range(oldest):
                self._swaps[i] = (self._swaps[i][0], {})

    def close(self) -> None:
        self._closed = True
        if self.server is not None:
            self.server.stop()
        if self.socket_dir is not None:
            self.socket_dir.remove()
        self.requests.close()
