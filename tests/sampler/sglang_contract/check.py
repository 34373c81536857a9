"""Runs megarl's SGLang client code through one SGLang release's own code; a subprocess of test_contract.py.

    python check.py MODEL_DIR RUN_DIR        (PYTHONPATH: that release's install, its deps, the repo)

Prints one JSON line {"version", "checked": [...]} when every check passed; raises otherwise.
  * requests: every body megarl sends is built into SGLang's own request type (io_struct; unknown
    fields are a TypeError), /generate bodies also pass 0.5.22+'s contract gate (api/v1/api_types.py,
    where the release has it) and the tokenizer manager's length validation (_validate_one_request)
    for prompts up to the whole context;
  * launch: megarl's `sglang.launch_server` command for every config (the GPU configs included) goes
    through SGLang's prepare_server_args (its `--config` file included), and the resolved args are what
    megarl relies on (context length, overlap schedule off, radix cache off for retract, the api key, ...);
  * auth: every route megarl calls, under SGLang's own decide_request_auth at the auth level its
    http_server.py gives the route, is allowed with the header megarl sends and refused without it;
  * routes (algo.routing_replay=r3): the launch resolves to ServerArgs.enable_return_routed_experts, the
    /generate body's return_routed_experts is GenerateReqInput's field (and passes the contract gate), and
    megarl parses routes encoded by SGLang's own detokenizer (base64 of int32 [positions, layers, top_k])
    under the meta_info key the tokenizer manager writes;
  * sequence: SGLangEngine.update_weights drives SGLang's SchedulerWeightUpdaterManager (the weight
    loading replaced by a recording stub): every call succeeds, the loads are megarl's calls in order,
    the label moves once, the session is closed and generation continued; a load failing halfway
    still leaves no open session and no pause. The same for learner.lora's partial update (only the merged
    adapted weights: megarl/learner/lora_publish.py);
  * partial load: those merged weights through SGLang's Qwen2ForCausalLM.load_weights land each in its fused
    parameter's shard, and nothing else is loaded;
  * LoRA route: /load_lora_adapter's fields, and SGLang's LoRARegistry pinning a running request to one adapter
    id (why megarl publishes merged weights instead; docs/lora.md).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import json
import sys
import types
from datetime import timedelta
from pathlib import Path

from tests.sampler.sglang_contract.sglang_env import install_stubs

install_stubs()

import sglang  # noqa: E402  (after the stubs)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sglang.srt.managers import io_struct  # noqa: E402
from sglang.srt.managers.scheduler_components import weight_updater  # noqa: E402
from sglang.srt.managers.tokenizer_manager import TokenizerManager  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

from megarl.config.load import load_config  # noqa: E402
from megarl.distributed.sglang_publish import plan_update_calls  # noqa: E402
from megarl.protocols import GenerationRequest, SamplingParams  # noqa: E402
from megarl.protocols import RouteShape  # noqa: E402
from megarl.sampler.sglang_engine import (  # noqa: E402
    ROUTED_EXPERTS_SINCE, HTTPClient, SGLangEngine, SGLangError, generate_body, parse_version, routes_from_meta,
    server_command, write_secret_args)

REPO = Path(__file__).resolve().parents[3]
API_KEY = "0123456789abcdef" * 4  # hex, as megarl's keys (sglang_engine.new_api_key)
CONTEXT = 512
# Each route megarl calls -> SGLang's request type of its body (entrypoints/http_server.py).
ROUTE_TYPES = {"/pause_generation": io_struct.PauseGenerationReqInput,
               "/continue_generation": io_struct.ContinueGenerationReqInput,
               "/begin_weight_update": io_struct.BeginWeightUpdateReqInput,
               "/end_weight_update": io_struct.EndWeightUpdateReqInput,
               "/init_weights_update_group": io_struct.InitWeightsUpdateGroupReqInput,
               "/update_weights_from_distributed": io_struct.UpdateWeightsFromDistributedReqInput}
# Every route megarl's SGLang client calls (sglang_engine.py).
MEGARL_ROUTES = [*ROUTE_TYPES, "/generate", "/flush_cache", "/server_info", "/health"]


def parse(route: str, body: dict):
    """SGLang's request object of one megarl body; TypeError on a field SGLang does not have."""
    return ROUTE_TYPES[route](**body)


# ---------------------------------------------------------------------------------------------- requests
def check_generate(model_dir: str, run_dir: str) -> str:
    from sglang.srt import runtime_context

    # megarl's launch, on this CPU machine (SGLang resolves its defaults for the device it finds).
    args = launch_args(server_command(config(run_dir, model_dir), model_dir, 30000, seed=1) + ["--device", "cpu"])
    runtime_context.publish(args, role="tokenizer")  # the tokenizer manager reads its config from here
    gate = None
    if importlib.util.find_spec("sglang.srt.entrypoints.api_contract") is not None:  # 0.5.22+
        gate = importlib.import_module("sglang.srt.entrypoints.api_contract").generate_contract_error
    # The manager's own validation methods on the state they read (a real one needs a scheduler process).
    manager = TokenizerManager.__new__(TokenizerManager)
    vars(manager).update(context_len=CONTEXT, num_reserved_tokens=0, allow_auto_truncate=False,
                         validate_total_tokens=True, server_args=args, is_generation=True, max_req_input_len=None,
                         model_config=types.SimpleNamespace(joint_head_config=None, pointer_head=None))
    for prompt_len in (4, 300, CONTEXT - 1):
        for sampling in (SamplingParams(temperature=1.0, max_new_tokens=2048), SamplingParams(temperature=0.7,
                                                                                               max_new_tokens=8)):
            request = GenerationRequest(f"g/{prompt_len}", [7] * prompt_len, sampling, (2,))
            body = generate_body(request, CONTEXT)
            if gate is not None:
                error = gate(json.loads(json.dumps(body)))
                assert error is None, f"SGLang's contract gate refuses {body['sampling_params']}: {error}"
            obj = io_struct.GenerateReqInput(**body)
            obj.normalize_batch_and_arguments()
            TokenizerManager._validate_one_request(manager, obj, list(body["input_ids"]))
            from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSampling
            SGLangSampling(**body["sampling_params"]).verify(vocab_size=1000)
    return f"generate bodies (contract gate: {'yes' if gate else 'not in this release'}, length validation)"


# ---------------------------------------------------------------------------------------------- launch
def config(run_dir: str, model_dir: str, *overrides: str, path: str | None = None):
    base = [f"run.dir={run_dir}", f"model.path={model_dir}"]
    if path is None:
        base += ["sampler.engine=sglang", "sampler.sglang.server=sglang", f"sampler.max_seq_len={CONTEXT}"]
    return load_config(path, [*base, *overrides])


def launch_args(cmd: list[str]):
    """The ServerArgs `sglang.launch_server` resolves from megarl's command (its own prepare_server_args, which
    reads `--config`)."""
    assert cmd[1:3] == ["-m", "sglang.launch_server"], cmd
    return prepare_server_args(cmd[3:])


def check_launch(model_dir: str, run_dir: str) -> str:
    cases = [(config(run_dir, model_dir), "keep"), (config(run_dir, model_dir, "sampler.kv_on_update=recompute"),
                                                      "recompute")]
    data = Path(run_dir) / "train.jsonl"  # the GPU configs name a dataset that is not here
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    gpu = sorted((REPO / "configs").glob("gpu_*sglang*.yaml"))
    cases += [(config(run_dir, model_dir, f"task.path={data}", path=str(p)), None) for p in gpu]
    secret_args = write_secret_args(Path(run_dir) / "secret.yaml", API_KEY)
    for cfg, _ in cases:
        args = launch_args(server_command(cfg, model_dir, 30001, seed=5, secret_args=secret_args))
        assert args.api_key == API_KEY and args.admin_api_key is None  # the key from the owner-only file
        assert args.context_length == cfg.sampler.max_seq_len, (args.context_length, cfg.sampler.max_seq_len)
        assert args.disable_overlap_schedule, "exact spans need the overlap scheduler off"
        assert args.disable_radix_cache == (cfg.sampler.kv_on_update == "recompute")
        assert args.skip_tokenizer_init and args.weight_version == "0" and args.port == 30001
        assert args.tp_size == cfg.sampler.sglang.tp and args.max_running_requests == cfg.sampler.max_running
        assert not args.allow_auto_truncate
    return f"launch commands ({len(cases)} configs)"


# ---------------------------------------------------------------------------------------------- auth
def route_auth_levels(http_server_source: str) -> dict[str, str]:
    """Route -> the AuthLevel name of its endpoint in SGLang's http_server.py (`@auth_level(AuthLevel.X)`
    beside `@app.get/post/api_route(route)`; NORMAL without one), read from the source: importing the
    module needs the FastAPI stack this environment does not install."""
    levels = {}
    for node in ast.walk(ast.parse(http_server_source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        routes, level = [], "NORMAL"
        for dec in node.decorator_list:
            if not isinstance(dec, ast.Call):
                continue
            if isinstance(dec.func, ast.Attribute) and dec.func.attr in ("get", "post", "put", "api_route"):
                routes += [a.value for a in dec.args[:1] if isinstance(a, ast.Constant)]
            elif isinstance(dec.func, ast.Name) and dec.func.id == "auth_level":
                level = dec.args[0].attr
        levels.update(dict.fromkeys(routes, level))
    return levels


def check_auth(model_dir: str, run_dir: str) -> str:
    """Every route megarl calls, under SGLang's own auth decision (utils/auth.py decide_request_auth) with the
    api_key megarl launches it with and no admin key: allowed with the header megarl's client sends, refused
    without it or with another key (the probes excepted), and none is ADMIN_FORCE (403 whatever the key)."""
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    levels = route_auth_levels((Path(sglang.__file__).parent / "srt/entrypoints/http_server.py").read_text())
    header = HTTPClient("127.0.0.1", 1, 1.0, api_key=API_KEY).headers["Authorization"]
    for route in MEGARL_ROUTES:
        assert route in levels, f"SGLang {sglang.__version__} serves no {route}"
        level = AuthLevel[levels[route]]
        assert level != AuthLevel.ADMIN_FORCE, route
        decide = functools.partial(decide_request_auth, method="POST", path=route, api_key=API_KEY,
                                   admin_api_key=None, auth_level=level)
        assert decide(authorization_header=header).allowed, route
        open_probe = route.startswith(("/health", "/ready", "/metrics"))
        for other in (None, "Bearer " + API_KEY[::-1], API_KEY):
            assert decide(authorization_header=other).allowed == open_probe, (route, other)
    return f"auth ({len(MEGARL_ROUTES)} routes, api_key)"


# ---------------------------------------------------------------------------------------------- routes
def check_routes(model_dir: str, run_dir: str) -> str:
    import inspect

    import numpy as np
    import pybase64

    assert parse_version(sglang.__version__) >= parse_version(ROUTED_EXPERTS_SINCE), sglang.__version__
    args = launch_args(server_command(config(run_dir, model_dir, "algo.routing_replay=r3"), model_dir, 30002, seed=1))
    assert args.enable_return_routed_experts, "r3 launches SGLang with its route capture on"
    off = launch_args(server_command(config(run_dir, model_dir), model_dir, 30002, seed=1))
    assert not off.enable_return_routed_experts
    request = GenerationRequest("r", [7] * 5, SamplingParams(temperature=1.0, max_new_tokens=3), (2,))
    body = generate_body(request, CONTEXT, routed_experts=True)
    if importlib.util.find_spec("sglang.srt.entrypoints.api_contract") is not None:  # 0.5.22+
        error = importlib.import_module("sglang.srt.entrypoints.api_contract").generate_contract_error(body)
        assert error is None, f"SGLang's contract gate refuses return_routed_experts: {error}"
    obj = io_struct.GenerateReqInput(**body)
    assert obj.return_routed_experts is True and obj.routed_experts_start_len == 0  # routes from position 0
    # The response: with --skip-tokenizer-init (megarl's launch) the tokenizer manager itself base64-encodes the
    # capturer's int32 [seqlen - 1, layers, top_k] tensor into meta_info (its output handler needs a running
    # scheduler, so its source is held to that and the encoding is repeated here with SGLang's pybase64).
    handler = inspect.getsource(TokenizerManager._handle_batch_output)
    assert 'meta_info["routed_experts"] = val' in handler and "b64encode(val.numpy().tobytes())" in handler
    shape = RouteShape(layers=3, top_k=2, num_experts=8)
    rows = torch.randint(0, 8, (5 + 3 - 1, 3, 2), dtype=torch.int32)
    encoded = pybase64.b64encode(rows.numpy().tobytes()).decode("utf-8")
    routes = routes_from_meta({"routed_experts": encoded}, request, 3, shape)
    assert routes.dtype == np.uint8 and (routes == rows.numpy()).all()
    return "routes (launch flag, request field, response encoding)"


# ---------------------------------------------------------------------------------------------- sequence
class RecordingWorker:
    """Stands in for the TP worker and model runner: records what SGLang's manager asks it to load."""

    def __init__(self, fail_at: int | None = None):
        self.received, self.loaded, self.fail_at = [], [], fail_at
        self.model_runner = types.SimpleNamespace(weight_updater=self)
        self.sessions = 0

    def init_weights_update_group(self, req):
        return True, "Succeeded to initialize custom process group."

    def receive_weights_from_distributed(self, names, dtypes, shapes, group_name, load_format):
        if self.fail_at is not None and len(self.received) == self.fail_at:
            raise RuntimeError("broadcast timed out (injected)")
        self.received.append((list(names), list(dtypes), [list(s) for s in shapes], load_format))
        return names

    def weight_update_runners(self):
        return [("target", types.SimpleNamespace(weight_updater=self))]

    def load_weights_from_distributed(self, weights):
        self.loaded.append(list(weights))
        return True, "Succeeded to update parameter online."

    def begin_weight_update(self):
        self.sessions += 1

    def end_weight_update(self, run_post_load=True):
        pass


class SchedulerRoutes:
    """What SGLang's HTTP server and scheduler do with megarl's control calls, in process: the body is
    parsed into SGLang's request type, the weight-update routes go to SchedulerWeightUpdaterManager
    (HTTP 400 when its reply says success=False, as http_server.py); pause/continue set the flag."""

    def __init__(self, worker: RecordingWorker, tp_cpu_group):
        self.worker, self.paused, self.labels, self.calls = worker, False, [], []
        scheduler = types.SimpleNamespace(record_weight_version_change=lambda new_version: self.labels.append(
            new_version), _engine_paused=False)
        kwargs = dict(tp_worker=worker, draft_worker=None, memory_saver_adapter=None,
                      flush_cache=lambda empty_cache=True: False, is_fully_idle=lambda **kw: False, scheduler=scheduler)
        if any(f.name == "tp_cpu_group" and f.init for f in dataclasses.fields(weight_updater.SchedulerWeightUpdaterManager)):
            kwargs["tp_cpu_group"] = tp_cpu_group  # 0.5.21: a constructor field; later: from the runtime context
        else:
            weight_updater.get_parallel = lambda: types.SimpleNamespace(tp_group=types.SimpleNamespace(
                cpu_group=tp_cpu_group))
        self.manager = weight_updater.SchedulerWeightUpdaterManager(**kwargs)
        self.url = "in-process SGLang " + sglang.__version__

    def error(self, route, why):
        return SGLangError(f"{route} on {self.url}: {why}")

    def post(self, route: str, body: dict | None = None, timeout_s=None) -> dict:
        self.calls.append(route)
        req = parse(route, body or {})
        if route == "/pause_generation":
            self.paused = True
            return {"message": "Generation paused successfully.", "status": "ok"}
        if route == "/continue_generation":
            self.paused = False
            return {"message": "Generation continued successfully.", "status": "ok"}
        handler = {"/begin_weight_update": self.manager.begin_weight_update,
                   "/end_weight_update": self.manager.end_weight_update,
                   "/init_weights_update_group": self.manager.init_weights_update_group,
                   "/update_weights_from_distributed": self.manager.update_weights_from_distributed}[route]
        out = handler(req)
        reply = {"success": out.success, "message": out.message}
        if not out.success:
            raise self.error(route, f"HTTP 400: {json.dumps(reply)}")
        return reply

    def get(self, route, timeout_s=None):
        raise AssertionError(f"megarl sent GET {route} during a weight update (cache_on_update=keep)")


def lora_merged_spec(model_dir: str):
    """learner.lora on SGLang: what a version carries, the merged adapted weights of every projection
    (megarl/learner/lora_publish.py), for the contract model."""
    from megarl.config.schema import LoraConfig
    from megarl.models.lora import adapter_spec
    from megarl.portable.lora_merge import merged_spec

    return merged_spec(adapter_spec(json.loads((Path(model_dir) / "config.json").read_text()), LoraConfig(rank=4)))


def check_sequence(model_dir: str, run_dir: str) -> str:
    """Full weights, and learner.lora's partial update (the merged adapted weights only): the manager takes a
    partial name list exactly as a full one (nothing in it checks that every weight came)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    full = [("model.embed_tokens.weight", (1000, 64), torch.float32), ("model.norm.weight", (64,), torch.float32),
            ("lm_head.weight", (1000, 64), torch.bfloat16)]
    lora = lora_merged_spec(model_dir)
    lora_bytes = sum(torch.Size(s).numel() * 4 for _, s, _ in lora)
    checked = 0
    for weight_format, spec, bucket_bytes in [(f, *case) for f in ("flattened_bucket", "per_tensor")
                                              for case in ((full, 300_000), (lora, lora_bytes // 3))]:
        calls = plan_update_calls(spec, weight_format, bucket_bytes=bucket_bytes)
        assert len(calls) > 1, "several calls per version: the session must span them all"
        worker = RecordingWorker()
        routes = SchedulerRoutes(worker, dist.group.WORLD)
        engine = SGLangEngine(routes, max_running=1, context_length=CONTEXT, pause_mode="in_place")
        engine.join_update_group({"host": "127.0.0.1", "port": 1, "world_size": 2, "group_name": "g",
                                  "backend": "nccl"}, rank_offset=1)
        for version in (1, 2):
            engine.update_weights(version, weight_format, calls)
            assert routes.manager._session is None and not routes.paused
        assert [r[0] for r in worker.received] == [[n for n, _, _ in c] for c in calls] * 2
        assert {r[3] for r in worker.received} == {"flattened_bucket" if weight_format == "flattened_bucket" else None}
        # record_weight_version_change runs after every successful load; only the last call carries the label.
        assert routes.labels == [None] * (len(calls) - 1) + ["1"] + [None] * (len(calls) - 1) + ["2"], routes.labels
        assert worker.sessions == 2 and engine.version == 2
        # A load failing halfway: the error propagates, and the server is left in no session, not paused.
        failing = SchedulerRoutes(RecordingWorker(fail_at=1), dist.group.WORLD)
        engine = SGLangEngine(failing, max_running=1, context_length=CONTEXT, pause_mode="retract")
        engine.group_name = "g"
        try:
            engine.update_weights(1, weight_format, calls)
            raise AssertionError("a failed load did not raise")
        except SGLangError as exc:
            assert "Failed to receive weights" in str(exc) or "injected" in str(exc), exc
        assert failing.manager._session is None and not failing.paused, failing.calls
        assert failing.calls[-2:] == ["/end_weight_update", "/continue_generation"], failing.calls
        checked += 1
    dist.destroy_process_group()
    return f"weight-update sequences ({checked} cases: 2 formats x full / LoRA-merged, SchedulerWeightUpdaterManager)"


# ---------------------------------------------------------------------------------------------- LoRA
def check_partial_load(model_dir: str, run_dir: str) -> str:
    """learner.lora: SGLang's Qwen2 loader takes the merged adapted weights alone. Qwen2ForCausalLM.load_weights
    (its default, legacy path: SGLANG_ENABLE_WEIGHT_LOADER_V2 is off) loads name by name: each HF projection goes
    to its shard of SGLang's fused parameter (q/k/v -> qkv_proj "q"/"k"/"v", gate/up -> gate_up_proj 0/1) or to
    its own (o_proj, down_proj), and no parameter it was not given is touched. Run on a Qwen2ForCausalLM holding
    SGLang's parameter names, whose weight_loaders record their calls, in place of its layers (SGLang's real layers
    need its GPU runtime to build)."""
    from sglang.srt.environ import envs
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM

    assert not envs.SGLANG_ENABLE_WEIGHT_LOADER_V2.get(), "re-check the partial update against the v2 loader"
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    fused = {"q_proj": ("self_attn.qkv_proj", "q"), "k_proj": ("self_attn.qkv_proj", "k"),
             "v_proj": ("self_attn.qkv_proj", "v"), "o_proj": ("self_attn.o_proj", None),
             "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
             "down_proj": ("mlp.down_proj", None)}
    calls = []

    class Served(Qwen2ForCausalLM):  # SGLang's loader methods over its parameter names, without its layers
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.model = torch.nn.Module()  # (no start_layer: one pipeline stage)
            self.config = types.SimpleNamespace(tie_word_embeddings=hf_config.get("tie_word_embeddings", False))
            names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
            for i in range(hf_config["num_hidden_layers"]):
                names += [f"model.layers.{i}.{m}.weight" for m in ("input_layernorm", "post_attention_layernorm",
                                                                   "self_attn.qkv_proj", "self_attn.o_proj",
                                                                   "mlp.gate_up_proj", "mlp.down_proj")]
                names.append(f"model.layers.{i}.self_attn.qkv_proj.bias")
            self.params = torch.nn.ParameterDict()
            for name in names:
                param = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
                param.weight_loader = functools.partial(lambda n, p, w, shard=None: calls.append((n, shard, w)), name)
                self.params[name.replace(".", "/")] = param

        def named_parameters(self, *args, **kwargs):
            return [(k.replace("/", "."), p) for k, p in self.params.items()]

    merged = [(name, torch.full(shape, float(i))) for i, (name, shape, _) in enumerate(lora_merged_spec(model_dir))]
    Served().load_weights(merged)
    expected = []
    for name, tensor in merged:
        layer, target = name.split(".")[2], name.split(".")[-2]
        expected.append((f"model.layers.{layer}.{fused[target][0]}.weight", fused[target][1], tensor))
    assert [(n, s) for n, s, _ in calls] == [(n, s) for n, s, _ in expected], calls
    assert all(got is sent for (_, _, got), (_, _, sent) in zip(calls, expected))  # what megarl sent, as sent
    return f"partial update ({len(merged)} merged weights through Qwen2ForCausalLM.load_weights; nothing else loaded)"


def check_lora_route(model_dir: str, run_dir: str) -> str:
    """Why megarl does not use SGLang's own adapters for learner.lora (docs/lora.md), held to SGLang's code:
    /load_lora_adapter (LoadLoRAAdapterReqInput) loads an adapter from a path under a name; a request names one
    (GenerateReqInput.lora_path) and TokenizerManager._resolve_lora_path pins it for its whole life to that name's
    adapter id (LoRARegistry.acquire, released when it finishes); a second load under a live name is refused,
    unloading waits for the requests pinned to it, and a reloaded name gets a new id, which Req concatenates into
    the radix cache's extra_key. So a running request cannot move to the next version, as Pipeline RL needs."""
    import asyncio
    import inspect

    import msgspec
    from sglang.srt.lora.lora_registry import LoRARef, LoRARegistry
    from sglang.srt.managers.schedule_batch import Req

    route = {f.name: f.required for f in msgspec.structs.fields(io_struct.LoadLoRAAdapterReqInput)}
    assert route.get("lora_name") and route.get("lora_path") and not route.get("pinned", True), route
    assert "lora_path" in {f.name for f in dataclasses.fields(io_struct.GenerateReqInput)}
    assert "obj.lora_id = await self.lora_registry.acquire(obj.lora_path)" in inspect.getsource(
        TokenizerManager._resolve_lora_path)
    assert "+ lora_id" in inspect.getsource(Req.__init__)  # the adapter id keys the radix cache

    async def reload_under_one_name():
        registry = LoRARegistry()
        v1 = LoRARef(lora_name="policy", lora_path="/adapters/v1")
        await registry.register(v1)
        running = await registry.acquire("policy")  # a request in flight on version 1
        assert running == v1.lora_id
        try:
            await registry.register(LoRARef(lora_name="policy", lora_path="/adapters/v2"))
            raise AssertionError("a second adapter under a live name was accepted")
        except ValueError as exc:
            assert "already exists" in str(exc)
        unload = asyncio.ensure_future(registry.wait_for_unload(await registry.unregister("policy")))
        await asyncio.sleep(0.05)
        assert not unload.done(), "version 1 went away under a running request"
        v2 = LoRARef(lora_name="policy", lora_path="/adapters/v2")
        await registry.register(v2)
        assert await registry.acquire("policy") == v2.lora_id != running  # new requests only; a new cache key
        await registry.release(running)
        await asyncio.wait_for(unload, 5)

    asyncio.run(reload_under_one_name())
    return "LoRA route (load_lora_adapter fields; a request pinned to one adapter id)"


def main() -> None:
    model_dir, run_dir = sys.argv[1:3]
    checked = [check(model_dir, run_dir)
               for check in (check_launch, check_auth, check_generate, check_routes, check_sequence,
                             check_partial_load, check_lora_route)]
    print(json.dumps({"version": sglang.__version__, "checked": checked}))


if __name__ == "__main__":
    main()
