"""An SGLang-compatible HTTP server around the built-in engine, so the SGLang client runs for real on CPU.

    python -m megarl.sampler.sglang_server --model-path DIR [--host 127.0.0.1] [--port 30000] ...

SGLang itself cannot run on the CPU machines megarl is tested on. This server speaks the subset of
SGLang's native HTTP API that megarl's SGLang engine uses, as release IMITATES (0.5.23) serves it —
same routes, request and response fields, status codes (sources in docs/sglang.md) — over
`BuiltinEngine`, and joins SGLang's weight-update group the way SGLang does, so `SGLangEngine` and the
learner's `SGLangPublisher` are tested against a real server process and a real gloo group.
/server_info reports `version` = IMITATES (and `megarl_builtin: true`).

Routes: GET /health, /health_generate, /model_info, /server_info (and the deprecated /get_server_info);
POST /generate (input_ids; sampling_params; return_logprob; return_routed_experts and routed_experts_start_len;
stream as SSE `data: {...}` + `data: [DONE]`),
/pause_generation {mode: abort|in_place|retract}, /continue_generation, /flush_cache,
/init_weights_update_group, /begin_weight_update, /update_weights_from_distributed (per tensor, or
load_format "flattened_bucket"), /end_weight_update, /destroy_weights_update_group. An update may name any
subset of the model's weights, as SGLang's loaders take one (learner.lora's merged adapted weights); the weights
it does not name keep their values.

What it enforces as SGLang IMITATES does (tests/sampler/sglang_contract/ checks megarl against that
release's own code): an update outside a begin/end_weight_update session fails (HTTP 400,
success=false, SGLang's message), a second begin or an end without begin too; a prompt of
>= --context-length tokens, or prompt + max_new_tokens > --context-length, is refused with SGLang's
message (HTTP 400, or a stream's `data: {"error": ...}` chunk); /flush_cache while paused ignores
requests waiting (SGLang's is_fully_idle(ignore_waiting=paused)), so it succeeds after a retract
and is refused while requests are paused in place; unknown sampling params are refused (0.5.22+'s
contract gate). The launch needs --disable-overlap-schedule (the spans here are exact, which SGLang's
are only without the overlap scheduler) and, with --kv-on-update recompute, --disable-radix-cache
(SGLang's retract reuses the prompt's KV from the radix cache otherwise).

Routes (mixture-of-experts models, launched with --enable-return-routed-experts as SGLang is): a request
with `return_routed_experts: true` gets, in its finished output's meta_info, `routed_experts` = base64 of
the int32 [seqlen - 1 - routed_experts_start_len, num_hidden_layers, top_k] routes of positions
[routed_experts_start_len, seqlen - 1) -- SGLang's get_topk layout -- from the engine's route records
(`BuiltinEngine`: the weights that computed each position). Without the launch flag, or for a dense
model, the field is absent, as SGLang's (no capturer); a start outside [0, prompt tokens] is refused
with SGLang's message.

Authentication, as SGLang's `--api-key` (utils/auth.py, no admin key): with a key, every route but
/health*, /ready* and /metrics* needs `Authorization: Bearer <key>`, else 401 {"error": "Unauthorized"}
before the body is read. `--config FILE` reads flags from a YAML mapping as SGLang does (command-line flags
win), which is how megarl passes the key: a command line is readable by every user of the machine.

Streams are SGLang's default (non-incremental) ones: a chunk every `--stream-interval` tokens (or the
request's sampling param `stream_interval`; the first token always), each cumulative — `output_ids`,
`meta_info.output_token_logprobs` and `text` (none with --skip-tokenizer-init) hold every token so far,
`finish_reason` is null until the last chunk — then `data: [DONE]`. A chunk a slow reader missed is
skipped: the next one has it all (SGLang's sources: docs/sglang.md, "Streams, aborts and disconnects").
An abort (pause mode "abort", or the client hanging up) ends a request with the tokens it has, and
finish_reason {"type": "abort", ...}.

Threads: HTTP handlers never touch the engine. One engine thread owns `BuiltinEngine` (its public API
only) and runs: admit queued requests, stage received weights, `step()`, read the new tokens of
streamed requests (`progress`), deliver finished ones, end aborted ones (`cancel`). Handlers talk to it
through `EngineLoop`, whose condition variable guards the shared state.

Where it differs from SGLang:
  * meta_info always carries `weight_versions` spans (newer SGLang's per-token accounting), computed
    exactly from the engine's per-token versions, so a client never has to infer them;
  * pause "in_place" keeps every running request's KV cache (the engine's kv_on_update=keep) and
    "retract" recomputes it under the weights current at continue (kv_on_update=recompute); the engine
    has one policy, chosen at launch with --kv-on-update, and the other mode is refused;
  * /pause_generation returns once the engine has stopped at a step boundary (SGLang returns once the
    request is queued to its scheduler);
  * a stream's first chunk holds two tokens: an engine step prefills a new request and decodes it once
    (SGLang's prefill step ends with a chunk of one);
  * a client that hangs up is noticed within DISCONNECT_POLL_S (or at the next chunk write) and its
    request aborted at the next step boundary (SGLang aborts it 2 s after the response ends,
    TokenizerManager.create_abort_task); the abort of a queued request has no special message;
  * there is no prefix cache: /flush_cache only reports whether SGLang would have flushed (idle or not);
  * an update naming a weight the model does not have is refused (HTTP 400); SGLang's Qwen2 loader skips it with a
    warning.
"""
from __future__ import annotations

import argparse
import base64
import hmac
import json
import logging
import os
import select
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterator

import yaml

log = logging.getLogger("megarl.sglang_server")

HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT default
DISCONNECT_POLL_S = 0.5  # a handler waiting for output checks this often whether its client hung up
PAUSE_MODES = ("abort", "in_place", "retract")
# SGLang sampling params accepted and ignored: they change text post-processing, not tokens.
IGNORED_SAMPLING_PARAMS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
SAMPLING_PARAMS = {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos",
                   "stream_interval"}
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
IMITATES = "0.5.23"  # the SGLang release whose behaviour this server reproduces (docs/sglang.md)
# Routes SGLang serves without its --api-key (probes and Prometheus), matched by prefix as it does.
UNAUTHENTICATED_PREFIXES = ("/health", "/ready", "/metrics")


class BadRequest(ValueError):
    """A request SGLang would answer with HTTP 400 {"error": {"message": ...}}."""


@dataclass
class _Request:
    rid: str
    prompt_ids: list[int]
    sampling: object  # megarl.protocols.SamplingParams
    stop_ids: tuple[int, ...]
    return_logprob: bool
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    stream: bool = False
    stream_interval: int = 1
    created: float = field(default_factory=time.perf_counter)
    # Written by the engine thread under EngineLoop.cond: the output so far (streamed requests) or at the
    # end, the tokens a chunk may show (`published`, advanced every stream_interval tokens) and the
    # weight-version label when it last advanced (SGLang stamps each output with the label of the moment).
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # engine versions
    published: int = 0
    label: str = ""
    finish: dict | None = None  # SGLang's finish_reason, once finished
    routes: object = None  # numpy [seqlen - 1, layers, top_k] of the finished request (MoE), else None
    error: str | None = None
    changed: threading.Event = field(default_factory=threading.Event)  # published, finish or error moved
    done: threading.Event = field(default_factory=threading.Event)  # finished or failed


def parse_sampling(params: dict, eos_ids: tuple[int, ...]):
    """SGLang `sampling_params` -> (SamplingParams, stop token ids); BadRequest on anything unsupported."""
    from megarl.protocols import SamplingParams

    unknown = set(params) - SAMPLING_PARAMS - IGNORED_SAMPLING_PARAMS
    if unknown:
        raise BadRequest(f"sampling params {sorted(unknown)} are not supported by megarl's built-in SGLang server")
    top_k = int(params.get("top_k", -1))
    sampling = SamplingParams(temperature=float(params.get("temperature", 1.0)), top_p=float(params.get("top_p", 1.0)),
                              top_k=0 if top_k == -1 else top_k,  # SGLang: -1 = off; megarl: 0 = off
                              max_new_tokens=int(params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)))
    stops = tuple(int(t) for t in params.get("stop_token_ids") or ())
    if not params.get("ignore_eos", False):  # SGLang also stops at the model's EOS unless told not to
        stops += tuple(t for t in eos_ids if t not in stops)
    return sampling, stops


def check_length(prompt_len: int, max_new_tokens: int, context_len: int) -> None:
    """SGLang's length refusal (tokenizer_manager._validate_one_request without --allow-auto-truncate)."""
    if prompt_len >= context_len:
        raise BadRequest(f"The input ({prompt_len} tokens) is longer than the model's context length "
                         f"({context_len} tokens).")
    if prompt_len + max_new_tokens > context_len:
        raise BadRequest(f"Requested token count exceeds the model's maximum context length of {context_len} "
                         f"tokens. You requested a total of {prompt_len + max_new_tokens} tokens: {prompt_len} "
                         f"tokens from the input messages and {max_new_tokens} tokens for the completion. Please "
                         f"reduce the number of tokens in the input messages or the completion to fit within the "
                         f"limit.")


def weight_version_spans(versions: list[int], labels: dict[int, str]) -> list[dict]:
    """Per-token engine versions -> SGLang's meta_info["weight_versions"]: [{version, start, end}, ...],
    contiguous, one span per run of equal labels (python/sglang/srt/utils/weight_versions.py)."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        label = labels[v]
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": label, "start": i, "end": i + 1})
    return spans


def finish_reason(completion, why: str = "") -> dict:
    """SGLang's finish reasons (BaseFinishReason.to_json): FINISH_MATCHED_TOKEN, FINISH_LENGTH, FINISH_ABORT
    (`why`: the abort message)."""
    if completion.finish_reason == "abort":
        return {"type": "abort", "message": why, "status_code": None, "err_type": None}
    if completion.finish_reason == "stop":
        return {"type": "stop", "matched": completion.token_ids[-1]}
    return {"type": "length", "length": len(completion.token_ids)}


def stream_point_between(before: int, after: int, interval: int) -> bool:
    """Does a stream chunk fall due as a request's output grows from `before` to `after` tokens?  SGLang's
    scheduler streams when the count n satisfies n % interval == 1 (every token for interval 1), so the
    first token always goes out (scheduler_output_processor_mixin.stream_output_generation)."""
    return any(interval == 1 or n % interval == 1 for n in range(before + 1, after + 1))


class EngineLoop:
    """Owns the engine thread; every method here is called from HTTP handler threads."""

    def __init__(self, args, model_dir: str):
        from megarl.sampler.engine import BuiltinEngine
        from megarl.sampler.model import load_pretrained

        self.args = args
        hf_config, weights = load_pretrained(model_dir)
        eos = hf_config.get("eos_token_id")
        self.eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.weights = weights  # the full HF-named set the engine runs (or has staged); replaced per update
        self.engine = BuiltinEngine(hf_config, weights, version=0, max_running=args.max_running_requests,
                                    max_seq_len=args.context_length, kv_on_update=args.kv_on_update,
                                    seed=args.random_seed, device=args.device)
        self.spec = self.engine.weight_spec()
        self.routed_experts = args.enable_return_routed_experts  # answer return_routed_experts (MoE models)
        self.label = args.weight_version  # SGLang's server_args.weight_version: an opaque string
        self.labels = {0: self.label}  # engine version (int, one per staged set) -> label

        self.cond = threading.Condition()
        self.inbox: list[_Request] = []  # submitted, not yet handed to the engine
        self.live: dict[str, _Request] = {}  # handed to the engine, not finished
        self.paused: str | None = None  # pause mode while paused
        self.stopped_at_boundary = False  # the engine thread is parked (paused) between steps
        self.abort_pending = False
        self.cancels: set[str] = set()  # request ids to abort at the next step boundary (clients gone)
        self.staged_dirty = False  # self.weights changed since the engine last staged them
        self.stats = self.engine.stats()
        self.error: BaseException | None = None
        self.groups: dict[str, object] = {}
        self.thread = threading.Thread(target=self._run, name="megarl-engine-loop", daemon=True)

    # ------------------------------------------------------------------ handler side
    def submit(self, request: _Request) -> None:
        with self.cond:
            if request.rid in self.live or any(r.rid == request.rid for r in self.inbox):
                raise BadRequest(f"request id {request.rid!r} is already in flight")
            self.inbox.append(request)
            self.cond.notify_all()

    @property
    def busy(self) -> bool:
        with self.cond:
            return bool(self.inbox or self.live)

    @property
    def flushable(self) -> bool:
        """SGLang's scheduler.flush_cache condition: is_fully_idle(ignore_waiting=paused). Paused, waiting
        requests do not count, and retract has moved the running ones back to waiting."""
        with self.cond:
            if self.paused is not None:
                return self.paused == "retract" or not self.live
            return not (self.inbox or self.live)

    def pause(self, mode: str) -> None:
        """Stop the engine at its next step boundary; returns once it has stopped (abort: and aborted)."""
        if mode not in PAUSE_MODES:
            raise BadRequest(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        wanted = {"in_place": "keep", "retract": "recompute"}.get(mode)
        if wanted is not None and wanted != self.args.kv_on_update:
            raise BadRequest(f"pause mode {mode!r} needs a server started with --kv-on-update {wanted} (this one "
                             f"runs {self.args.kv_on_update}: the built-in engine has one KV policy per launch)")
        with self.cond:
            self.paused = mode
            self.abort_pending = mode == "abort"
            self.stopped_at_boundary = False
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.stopped_at_boundary or self.error is not None)
            if self.error is not None:
                raise RuntimeError(f"engine loop failed: {self.error!r}")

    def resume(self) -> None:
        with self.cond:
            self.paused = None
            self.cond.notify_all()

    def cancel(self, rid: str) -> None:
        """Abort one request at the next step boundary (paused or not), as SGLang's abort_request."""
        with self.cond:
            self.cancels.add(rid)
            self.cond.notify_all()

    def install_weights(self, received: dict, label: str | None) -> None:
        """New tensors for some names; the engine stages the merged set before its next step."""
        for name, tensor in received.items():
            if name not in self.spec:
                raise BadRequest(f"unknown parameter {name!r} (not in the model's HF state dict)")
            shape, dtype = self.spec[name]
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise BadRequest(f"{name} arrived as {list(tensor.shape)} {tensor.dtype}; "
                                 f"the model has {list(shape)} {dtype}")
        with self.cond:
            self.weights = {**self.weights, **received}
            self.staged_dirty = True
            if label is not None:
                self.label = label
            self.cond.notify_all()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        import torch

        try:
            with torch.inference_mode():
                while True:
                    if not self._prepare_step():
                        continue
                    finished = self.engine.step()
                    # Only streamed requests are read between steps, and only their new tokens.
                    streamed = {rid: len(r.token_ids) for rid, r in self.live.items() if r.stream}
                    progress = self.engine.progress(streamed) if streamed else {}
                    with self.cond:
                        self.stats = self.engine.stats()
                        for rid, new in progress.items():
                            self._extend(self.live[rid], new)
                        for completion in finished:
                            self._finish(self.live.pop(completion.request_id), completion)
        except BaseException as exc:  # noqa: BLE001 - reported by /health and to every waiting request
            log.exception("engine loop failed")
            with self.cond:
                self.error = exc
                for request in [*self.inbox, *self.live.values()]:
                    self._fail(request, f"engine loop failed: {exc!r}")
                self.cond.notify_all()

    @staticmethod
    def _fail(request: _Request, error: str) -> None:
        request.error = error
        request.done.set()
        request.changed.set()

    def _extend(self, request: _Request, new) -> None:
        """Append a streamed request's new tokens (an engine Progress); publish them when a chunk is due."""
        before = len(request.token_ids)
        request.token_ids += new.token_ids
        request.logprobs += new.logprobs
        request.versions += new.versions
        if stream_point_between(before, len(request.token_ids), request.stream_interval):
            request.published, request.label = len(request.token_ids), self.label
            request.changed.set()

    def _finish(self, request: _Request, completion, why: str = "") -> None:
        """Deliver a finished (or aborted, `why` saying by what) request: its whole output, the last chunk."""
        request.token_ids, request.logprobs, request.versions = completion.token_ids, completion.logprobs, \
            completion.versions
        request.published, request.label = len(completion.token_ids), self.label
        request.routes = completion.routes
        request.finish = finish_reason(completion, why)
        request.done.set()
        request.changed.set()

    def _prepare_step(self) -> bool:
        """Apply control state at the step boundary; True when the engine should step now."""
        with self.cond:
            if self.cancels:
                self._abort(self.cancels, "client disconnected")
                self.cancels.clear()
            if self.paused is not None:
                if self.abort_pending:
                    self._abort({*self.live, *(r.rid for r in self.inbox)}, "Aborted by /pause_generation mode abort")
                    self.abort_pending = False
                    log.info("aborted all requests (pause mode abort)")
                self.stopped_at_boundary = True
                self.cond.notify_all()
                self.cond.wait(0.5)
                return False
            if self.staged_dirty:
                self.engine.stage_weights(self.weights, self.engine.version + 1)
                self.labels[self.engine.version + 1] = self.label
                self.staged_dirty = False
            for request in self.inbox:
                try:
                    self.engine.add_request(self._engine_request(request))
                    self.live[request.rid] = request
                except ValueError as exc:
                    self._fail(request, str(exc))
            self.inbox.clear()
            if not self.live:
                self.cond.wait(0.5)
                return False
            return True

    def _engine_request(self, request: _Request):
        from megarl.protocols import GenerationRequest

        return GenerationRequest(request.rid, request.prompt_ids, request.sampling, request.stop_ids)

    def _abort(self, rids, why: str) -> None:
        """End the named requests that are still queued here or in the engine, with the output they have."""
        from megarl.protocols import Completion

        for request in [r for r in self.inbox if r.rid in rids]:
            self._finish(request, Completion(request.rid, request.prompt_ids, [], [], [], "abort"), why)
        self.inbox = [r for r in self.inbox if r.rid not in rids]
        for completion in self.engine.cancel([rid for rid in rids if rid in self.live]):
            self._finish(self.live.pop(completion.request_id), completion, why)
        self.stats = self.engine.stats()

    # ------------------------------------------------------------------ responses
    def output(self, request: _Request) -> dict:
        """The /generate output of a request as published so far (SGLang's non-incremental out_dict: every
        list cumulative; finish_reason null until the end). Call with `cond` held."""
        n = request.published
        token_ids = request.token_ids[:n]
        spans = weight_version_spans(request.versions[:n], self.labels)
        meta = {"id": request.rid, "finish_reason": request.finish, "prompt_tokens": len(request.prompt_ids),
                "weight_version": request.label or self.label, "completion_tokens": n, "cached_tokens": 0,
                "weight_versions": spans}
        if request.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(request.logprobs[:n], token_ids)]
        if request.finish is not None:
            meta["e2e_latency"] = time.perf_counter() - request.created
            if request.return_routed_experts and self.routed_experts and request.routes is not None:
                rows = request.routes[request.routed_experts_start_len:].astype("int32")
                meta["routed_experts"] = base64.b64encode(rows.tobytes()).decode("ascii")
        return {"output_ids": token_ids, "meta_info": meta}


class Server:
    """The HTTP side: route table, request parsing, weight-update receive."""

    def __init__(self, args):
        self.args = args
        self.api_key = args.api_key
        self.loop = EngineLoop(args, args.model_path)
        self.tokenizer = None
        if not args.skip_tokenizer_init:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        self.get_routes = {"/health": self.health, "/health_generate": self.health_generate,
                           "/model_info": self.model_info, "/server_info": self.server_info,
                           "/get_server_info": self.server_info, "/flush_cache": self.flush_cache}
        self.post_routes = {"/generate": None, "/pause_generation": self.pause, "/continue_generation": self.resume,
                            "/flush_cache": self.flush_cache, "/init_weights_update_group": self.init_group,
                            "/destroy_weights_update_group": self.destroy_group,
                            "/begin_weight_update": self.begin_update, "/end_weight_update": self.end_update,
                            "/update_weights_from_distributed": self.update_from_distributed}
        self.session_lock = threading.Lock()
        self.session_open = False  # inside /begin_weight_update ... /end_weight_update

    # ------------------------------------------------------------------ simple routes (status, body)
    def health(self, body=None):
        return (HTTPStatus.OK, b"") if self.loop.error is None else (HTTPStatus.SERVICE_UNAVAILABLE, b"")

    def health_generate(self, body=None):
        """As SGLang: generate one token unless something is already running (then that proves health)."""
        if self.loop.error is not None:
            return HTTPStatus.SERVICE_UNAVAILABLE, b""
        if self.loop.busy:
            return HTTPStatus.OK, b""
        request = self._request({"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}},
                                rid=f"HEALTH_CHECK_{time.time()}")
        self.loop.submit(request)
        ok = request.done.wait(HEALTH_GENERATE_TIMEOUT_S) and request.error is None
        if not ok:
            self.loop.cancel(request.rid)
        return (HTTPStatus.OK, b"") if ok else (HTTPStatus.SERVICE_UNAVAILABLE, b"")

    def model_info(self, body=None):
        return HTTPStatus.OK, {"model_path": self.args.model_path, "tokenizer_path": self.args.tokenizer_path,
                               "is_generation": True, "preferred_sampling_params": None,
                               "weight_version": self.loop.label}

    def server_info(self, body=None):
        with self.loop.cond:  # the engine's stats, and the requests not yet handed to it (e.g. while paused)
            states = {**self.loop.stats, "inbox": len(self.loop.inbox)}
        return HTTPStatus.OK, {**vars(self.args), "internal_states": [states], "version": IMITATES,
                               "megarl_builtin": True}

    def flush_cache(self, body=None):
        # SGLang answers 400 when any request is running or waiting (scheduler.flush_cache); there is no
        # prefix cache here, so the idle check is all that is left of it.
        busy = not self.loop.flushable
        log.info("flush_cache: %s", "not flushed, requests are running or waiting" if busy else "flushed")
        if busy:
            return HTTPStatus.BAD_REQUEST, b"Cache flushed.\nPlease check backend logs for more details. " \
                                           b"(When there are running or waiting requests, the operation will not " \
                                           b"be performed.)\n"
        return HTTPStatus.OK, b"Cache flushed.\nPlease check backend logs for more details. (When there are " \
                              b"running or waiting requests, the operation will not be performed.)\n"

    def pause(self, body):
        self.loop.pause((body or {}).get("mode", "abort"))  # SGLang's default mode is abort
        return HTTPStatus.OK, {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, body=None):
        self.loop.resume()
        return HTTPStatus.OK, {"message": "Generation continued successfully.", "status": "ok"}

    # ------------------------------------------------------------------ weight update group
    def init_group(self, body):
        from megarl.distributed.topology import init_sglang_update_group

        name = body.get("group_name", "weight_update_group")
        rank = int(body["rank_offset"]) + 0  # + tp_rank, as SGLang's model runner; this server is one rank
        log.info("init weights update group %s: %s:%s rank %d of %d (%s)", name, body["master_address"],
                 body["master_port"], rank, body["world_size"], body.get("backend", "nccl"))
        try:
            self.loop.groups[name] = init_sglang_update_group(
                body.get("backend", "nccl"), body["master_address"], int(body["master_port"]),
                int(body["world_size"]), rank, name, self.args.dist_timeout)
        except Exception as exc:  # noqa: BLE001 - SGLang reports any failure in the body
            return HTTPStatus.BAD_REQUEST, {"success": False,
                                            "message": f"Failed to initialize custom process group: {exc}."}
        return HTTPStatus.OK, {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, body):
        """SGLang's destroy_weights_update_group: the process group itself goes too, so its name can be joined again."""
        import torch.distributed as dist

        group = self.loop.groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is None:
            return HTTPStatus.BAD_REQUEST, {"success": False, "message": "The group to be destroyed does not exist."}
        try:
            dist.destroy_process_group(group)
        except Exception as exc:  # noqa: BLE001 - SGLang reports any failure in the body
            return HTTPStatus.BAD_REQUEST, {"success": False,
                                            "message": f"Failed to destroy custom process group: {exc}."}
        return HTTPStatus.OK, {"success": True, "message": "Succeeded to destroy custom process group."}

    def begin_update(self, body=None):
        """SGLang's SchedulerWeightUpdaterManager.begin_weight_update: open the one session."""
        with self.session_lock:
            if self.session_open:
                return HTTPStatus.BAD_REQUEST, {"success": False, "message": (
                    "a weight-update session is already open; call end_weight_update() first")}
            self.session_open = True
        return HTTPStatus.OK, {"success": True, "message": "Success"}

    def end_update(self, body=None):
        with self.session_lock:
            if not self.session_open:
                return HTTPStatus.BAD_REQUEST, {"success": False, "message": (
                    "no weight-update session is open; call begin_weight_update() first")}
            self.session_open = False
        return HTTPStatus.OK, {"success": True, "message": "Success"}

    def update_from_distributed(self, body):
        """Receive tensors broadcast from group rank 0: one per name in order, or one flattened bucket."""
        import torch

        if not self.session_open:  # SGLang >= 0.5.21 (weight_updater.update_weights_from_distributed)
            return HTTPStatus.BAD_REQUEST, {"success": False, "message": (
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()")}

        if self.args.debug_hang_on_update:  # fault injection for tests: a server stuck in an update
            log.warning("--debug-hang-on-update: this update never returns")
            threading.Event().wait()
        name = body.get("group_name", "weight_update_group")
        group = self.loop.groups.get(name)
        if group is None:
            return HTTPStatus.BAD_REQUEST, {"success": False, "message": (
                f"Group {name} not in {list(self.loop.groups)}. Please call `init_weights_update_group` first.")}
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest("names, dtypes and shapes must have the same length")
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in zip(dtypes, shapes)]
        try:
            if body.get("load_format") == "flattened_bucket":
                # One byte buffer of the tensors back to back in names order (FlattenedTensorBucket).
                flat = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8)
                self._broadcast(group, flat)
                offset = 0
                for t in tensors:
                    n = t.numel() * t.element_size()
                    t.view(-1).view(torch.uint8).copy_(flat[offset:offset + n])
                    offset += n
            elif body.get("load_format") is None:
                for t in tensors:
                    self._broadcast(group, t)
            else:
                raise BadRequest(f"load_format={body['load_format']!r} is not supported (None or flattened_bucket)")
            self.loop.install_weights(dict(zip(names, tensors)), body.get("weight_version"))
        except Exception as exc:  # noqa: BLE001 - SGLang's wording: the weights are now partially updated
            return HTTPStatus.BAD_REQUEST, {"success": False, "message": (
                f"Failed to update parameter online: {exc}. The full weights of the ModelRunner are partially "
                f"updated. Please discard the whole weights.")}
        message = "Succeeded to update parameter online."
        if body.get("flush_cache", True) and not self.loop.flushable:
            # SGLang's flush_cache_after_weight_update: the update call fails (older builds assert).
            return HTTPStatus.BAD_REQUEST, {"success": False, "message": (
                "Weights were updated, but the cache was not flushed because requests are still running or "
                "queued. Retract or finish them, then call /flush_cache.")}
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {body['weight_version']}."
        return HTTPStatus.OK, {"success": True, "message": message}

    def _broadcast(self, group, tensor) -> None:
        import torch.distributed as dist
        from datetime import timedelta

        dist.broadcast(tensor, src=0, group=group, async_op=True).wait(timedelta(seconds=self.args.dist_timeout))

    # ------------------------------------------------------------------ /generate
    def _request(self, body: dict, rid: str | None = None) -> _Request:
        if body.get("text") is not None:
            raise BadRequest("text input is not supported by megarl's built-in SGLang server: send input_ids")
        ids = body.get("input_ids")
        if not ids or not isinstance(ids, list) or isinstance(ids[0], list):
            raise BadRequest("input_ids must be one non-empty list of token ids (batch requests are not supported)")
        params = body.get("sampling_params") or {}
        sampling, stops = parse_sampling(params, self.loop.eos_ids)
        check_length(len(ids), sampling.max_new_tokens, self.args.context_length)
        interval = int(params.get("stream_interval") or self.args.stream_interval)  # 0 = the server's, as SGLang
        if interval < 1:
            raise BadRequest(f"stream_interval={interval} must be >= 1")
        routes_from = int(body.get("routed_experts_start_len") or 0)
        # SGLang's messages (Scheduler.handle_generate_request)
        if body.get("return_routed_experts") and routes_from < 0:
            raise BadRequest(f"recv_req.routed_experts_start_len={routes_from} is lower than 0. "
                             "Please use a non-negative routed_experts_start_len.")
        if body.get("return_routed_experts") and routes_from > len(ids):
            raise BadRequest(f"recv_req.routed_experts_start_len={routes_from} is higher than the number of input "
                             f"tokens len(req.origin_input_ids)={len(ids)}. Please use a smaller "
                             "routed_experts_start_len.")
        return _Request(rid=rid or body.get("rid") or uuid.uuid4().hex, prompt_ids=[int(t) for t in ids],
                        sampling=sampling, stop_ids=stops, return_logprob=bool(body.get("return_logprob")),
                        return_routed_experts=bool(body.get("return_routed_experts")),
                        routed_experts_start_len=routes_from, stream=bool(body.get("stream")), stream_interval=interval)

    def generate(self, body: dict, client_gone: Callable[[], bool]) -> Iterator[dict]:
        """Submit a /generate; yield its outputs: every published chunk of a stream, else the final one only.

        Bounded by the engine (every request finishes, is aborted or fails); BadRequest when the engine
        refuses it; ConnectionAbortedError once `client_gone()` says the client hung up.  A request whose
        outputs stop being read before it finished (that error, or the caller closing the generator
        after a failed write) is aborted, as SGLang aborts the request of a client that went away."""
        request = self._request(body)
        self.loop.submit(request)
        shown = -1
        try:
            while True:
                if not request.changed.wait(DISCONNECT_POLL_S):
                    if client_gone():
                        raise ConnectionAbortedError(f"request {request.rid}: the client hung up")
                    continue
                with self.loop.cond:
                    request.changed.clear()
                    if request.error is not None:
                        raise BadRequest(request.error)
                    final = request.finish is not None
                    if not final and (not request.stream or request.published == shown):
                        continue
                    shown = request.published
                    out = self.loop.output(request)
                if self.tokenizer is not None:  # cumulative text, as the ids
                    out = {"text": self.tokenizer.decode(out["output_ids"], skip_special_tokens=True), **out}
                yield out
                if final:
                    return
        finally:
            if not request.done.is_set():
                self.loop.cancel(request.rid)


class HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 2048  # listen backlog, as uvicorn's; socketserver's 5 resets bursts of streams


def make_handler(server: Server):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection; streams end when the connection closes

        def log_message(self, fmt, *args):  # access log at debug level, not on stderr per request
            log.debug("%s " + fmt, self.address_string(), *args)

        def do_GET(self):
            if not self._authorized():
                return
            handler = server.get_routes.get(self._route())
            if handler is None:
                return self._send(HTTPStatus.NOT_FOUND, {"detail": "Not Found"})
            self._call(handler, None)

        def do_POST(self):
            if not self._authorized():
                return
            route = self._route()
            if route not in server.post_routes:
                return self._send(HTTPStatus.NOT_FOUND, {"detail": "Not Found"})
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
            except json.JSONDecodeError as exc:
                return self._send(HTTPStatus.BAD_REQUEST, {"error": {"message": f"invalid JSON body: {exc}"}})
            if route == "/generate":
                return self._generate(body)
            self._call(server.post_routes[route], body)

        def _route(self) -> str:
            return self.path.split("?", 1)[0]

        def _authorized(self) -> bool:
            """SGLang's --api-key rule (utils/auth.py decide_request_auth, no admin key: every route megarl
            calls is NORMAL or ADMIN_OPTIONAL there): with a key, every route but /health*, /ready* and /metrics*
            needs `Authorization: Bearer <key>`, checked before the body is read; 401 {"error": "Unauthorized"}."""
            if server.api_key is None or self._route().startswith(UNAUTHENTICATED_PREFIXES):
                return True
            scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), server.api_key.encode()):
                return True
            self.close_connection = True  # the body, if any, stays unread
            self._send(HTTPStatus.UNAUTHORIZED, {"error": "Unauthorized"})
            return False

        def _call(self, handler, body):
            try:
                status, payload = handler(body)
            except (BadRequest, KeyError, TypeError, ValueError) as exc:
                status, payload = HTTPStatus.BAD_REQUEST, {"error": {"message": f"{type(exc).__name__}: {exc}"}}
            self._send(status, payload)

        def _generate(self, body):
            outputs = server.generate(body, self._client_gone)
            try:
                if not body.get("stream"):
                    try:
                        *_, final = outputs  # one output: the final one
                    except (BadRequest, KeyError, TypeError, ValueError) as exc:
                        return self._send(HTTPStatus.BAD_REQUEST, {"error": {"message": str(exc)}})
                    return self._send(HTTPStatus.OK, final)
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    for out in outputs:
                        self.wfile.write(b"data: " + json.dumps(out).encode() + b"\n\n")
                except (BadRequest, KeyError, TypeError, ValueError) as exc:  # SGLang streams errors as a chunk
                    self.wfile.write(b"data: " + json.dumps({"error": {"message": str(exc)}}).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")
            except OSError as exc:  # the client hung up (noticed while waiting, or by a failed write)
                log.info("/generate: %r; its request is aborted", exc)
                outputs.close()  # aborts the request if it has not finished

        def _client_gone(self) -> bool:
            """Has the client closed its end?  (Its request is fully read, so a readable socket is EOF.)"""
            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

        def _send(self, status, payload):
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(payload, bytes) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def config_file_args(argv: list[str]) -> list[str]:
    """SGLang's `--config FILE` (utils/server_args_config_parser.py): the YAML mapping's keys become flags put
    before the command line's (which therefore win); true -> the bare flag, false -> left out."""
    if "--config" not in argv:
        return argv
    i = argv.index("--config")
    if i == len(argv) - 1:
        raise SystemExit("--config needs a YAML file")
    with open(argv[i + 1]) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"--config {argv[i + 1]}: not a YAML mapping")
    flags = []
    for key, value in data.items():
        if value is True:
            flags.append(f"--{key}")
        elif value is not False:
            flags += [f"--{key}", str(value)]
    return flags + argv[:i] + argv[i + 2:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megarl.sampler.sglang_server",
                                description="SGLang-compatible HTTP server around megarl's built-in engine")
    # SGLang launch_server flags, same names and meaning.
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--context-length", type=int, default=None, help="prompt + completion tokens per request")
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--skip-tokenizer-init", action="store_true", help="ids in, ids out; responses carry no text")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--dist-timeout", type=float, default=600.0, help="seconds; weight-update group and broadcasts")
    p.add_argument("--device", default="cpu")
    p.add_argument("--log-level", default="info")
    p.add_argument("--api-key", default=None,
                   help="every route but /health, /ready, /metrics needs `Authorization: Bearer KEY` (pass it in "
                        "a --config file: a command line is readable by every user of the machine)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="required: this server's spans are exact, as SGLang's are only without the overlap scheduler")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="required with --kv-on-update recompute: SGLang's retract reuses cached prompt KV otherwise")
    p.add_argument("--disable-cuda-graph", action="store_true", help="accepted for compatibility; no effect here")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="accepted for compatibility; no effect")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="MoE models: /generate answers return_routed_experts (SGLang's route capture)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="a stream chunk every this many tokens (tokens 1, 1 + N, 1 + 2N, ...) and at the end")
    # megarl extras.
    p.add_argument("--kv-on-update", choices=("keep", "recompute"), default="keep",
                   help="the engine's KV policy on a weight update: keep = pause mode in_place, recompute = retract")
    p.add_argument("--debug-hang-on-update", action="store_true",
                   help="fault injection: /update_weights_from_distributed never returns (tests of client timeouts)")
    args = p.parse_args(config_file_args(sys.argv[1:] if argv is None else list(argv)))
    if args.stream_interval < 1:
        p.error(f"--stream-interval {args.stream_interval} must be >= 1")
    if not args.disable_overlap_schedule:
        p.error(f"--disable-overlap-schedule is required: SGLang {IMITATES}'s overlap scheduler labels up to one "
                f"old-weights token per running request with the new version; this server imitates it without")
    if args.kv_on_update == "recompute" and not args.disable_radix_cache:
        p.error("--kv-on-update recompute (pause mode retract) needs --disable-radix-cache: SGLang keeps the "
                "prompt's KV in its radix cache and reuses it after continue otherwise")
    if args.tp_size != 1:
        p.error(f"--tp-size {args.tp_size}: megarl's built-in server runs one process; use SGLang itself for "
                f"tensor parallelism (sampler.sglang.server=sglang)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.context_length is None:
        with open(os.path.join(args.model_path, "config.json")) as f:
            args.context_length = int(json.load(f).get("max_position_embeddings", 2048))
    server = Server(args)
    server.loop.thread.start()
    httpd = HTTPServer((args.host, args.port), make_handler(server))
    log.info("megarl SGLang-compatible server for %s on http://%s:%d (weight version %s, kv_on_update=%s)",
             args.model_path, args.host, args.port, args.weight_version, args.kv_on_update)
    httpd.serve_forever()


if __name__ == "__main__":
    main()
