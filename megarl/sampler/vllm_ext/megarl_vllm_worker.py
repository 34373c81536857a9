"""megarl's vLLM worker extension (`--worker-extension-cls megarl_vllm_worker.MegarlWorkerExtension`).

Loaded by vLLM into its worker class, inside the vLLM server's engine process, and called through the dev-mode
route `POST /collective_rpc {"method": "megarl_...", "args": [json string]}`. Imports only the standard library
and torch (vLLM is reached through the worker it is mixed into), so the server's environment needs nothing of
megarl but this directory on PYTHONPATH. megarl's sampler process imports the same module for the parts both
sides must agree on (`make_group`, `bucket_plan`, `unpack`).

Every call is signed: the sampler sends `sign_call(...)`, an envelope holding the method, its arguments (a JSON
string), a counter and HMAC-SHA256 over the three, keyed by a fresh key of this server that only its environment
holds (`MEGARL_VLLM_RPC_KEY`, set by megarl.sampler.vllm_engine; /proc/PID/environ is owner-only). `RpcGuard`
refuses (raises, before doing anything) a call without the key, with a wrong tag, for another method than the
one signed, or whose counter is not above the last accepted one (a replay). The HTTP server itself listens only
on a Unix socket in an owner-only directory (vllm_engine); the signature is the second layer, for this extension.

* `megarl_join`: joins a two-member gloo group with the sampler process (rank 0, which hosts the TCPStore).
* `megarl_update`: the in-flight weight swap. First it records how many output tokens every request the worker
  has seen has sampled (`model_runner.requests[id].output_token_ids`; a finished request's final count is kept
  when vLLM drops its state, see `_FinishedCounts`), then it receives the new weights bucket by
  bucket over the group and loads them with `model_runner.reload_weights` (vLLM's in-place reload: it restores
  the CPU layers' original parameters, loads, and repacks the CPU GEMM weights again). vLLM runs a collective_rpc
  between two engine steps and runs no step while it lasts, so every token counted was sampled by the old
  weights and every later token by the new ones: the counts are the exact per-request version boundary
  (the argument is in docs/vllm.md).
* `megarl_lora_base` (learner.lora): the worker loads the frozen base from its own checkpoint once; from then on
  every `megarl_update` carries only an adapter, which the worker merges into that base
  (W + alpha / r * B @ A, `lora_merge`, the merge megarl's built-in engine runs too) and loads through the same
  reload, counts and all. vLLM serves the merged weights as a plain model (no `enable_lora`), so an adapter
  version is applied exactly as a full-weight version is.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import re
import time

import torch
import torch.distributed as dist

try:  # the vLLM server: megarl/portable is on its PYTHONPATH (megarl.sampler.vllm_engine.server_env)
    import lora_merge
except ImportError:  # megarl's sampler process, which imports this module for the helpers both sides share
    from megarl.portable import lora_merge

def _linear_without_onednn() -> None:
    """vLLM 0.32's CPU linear layers run through oneDNN handles created from the weights at load time
    (model_executor/layers/utils.dispatch_cpu_unquantized_gemm). After `reload_weights` with different weights,
    some of those layers kept computing with the old weights (measured: fresh requests after an update were
    0.08 to 1.4 nats off transformers with the new weights, while an update with unchanged weights stayed exact).
    With oneDNN off, the layers use torch's linear over their own weight tensors, which the reload updates in
    place: then every log-prob after an update matches transformers to ~1e-6 (tests/sampler/vllm/). The
    extension module is imported when the worker is created, before the model is loaded, so this is in time."""
    try:
        import vllm._custom_ops as ops
    except ImportError:  # imported by megarl's sampler process, where vLLM is not installed
        return
    ops._supports_onednn = False


_linear_without_onednn()


def repack_cpu_experts(model: torch.nn.Module) -> None:
    """Prepack every CPU MoE layer's expert weights again after a reload.

    vLLM 0.32's CPU experts (fused_moe/experts/cpu_moe.py, CPUUnquantizedExperts) prepack w13 and w2 into their
    grouped-GEMM layout in `process_weights_after_loading`, which the unquantized MoE method
    (unquantized_fused_moe_method.py) calls on the first load only: on a weight update it copies the new weights
    into the parameters in checkpoint layout and skips the prepack, so the kernel reads unpacked weights as
    packed ones (measured: Mixtral and Qwen3-MoE 3.4-3.7 nats off the learner after an update, exact before it).
    Running the prepack on the reloaded weights restores it: every log-prob after an update matches the learner's
    to ~1e-6 (tests/sampler/vllm/test_vllm_families.py)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # megarl's sampler process, or a vLLM without CPU experts
        return
    for module in model.modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)


# vLLM 0.32 loaders that write some tensors with `param.copy_` instead of through the parameter's weight loader:
# gpt-oss's unquantized path (GptOssForCausalLM._load_weights_other) for its experts and attention sinks. In-place
# reload (`reload_weights`, layerwise) sees only what goes through weight loaders (the parameters it loads into are
# placeholders until a layer is complete), so those writes are lost and the layers keep the old weights (measured:
# gpt-oss 0.7-1.2 nats off the learner after an update, exact at lag 0). `split_direct_copies` holds them back from
# the reload and loads them afterwards with the model's own `load_weights`, into the live parameters.
DIRECT_COPY = {"GptOssForCausalLM": re.compile(r"\.(mlp\.experts\.(gate_up|down)_proj(_bias)?|self_attn\.sinks)$")}


def split_direct_copies(model_class: str, tensors, held: list):
    """`tensors` without those `model_class`'s loader copies directly (DIRECT_COPY), which are appended to `held`."""
    pattern = DIRECT_COPY.get(model_class)
    for name, tensor in tensors:
        if pattern is not None and pattern.search(name):
            held.append((name, tensor))
        else:
            yield name, tensor


DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def make_group(host: str, port: int, rank: int, world_size: int, timeout_s: float, store=None):
    """A gloo ProcessGroup of `world_size` members over a TCPStore at host:port (rank 0 passes the store it hosts).
    Built directly, not through torch.distributed's default group: neither side has one for this."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore("megarl-vllm-weights", store), rank, world_size, timeout)


def bucket_plan(spec: list, bucket_bytes: int) -> list[dict]:
    """[(name, shape, dtype name)] in publish order -> buckets of at most bucket_bytes (a bigger tensor alone):
    [{"nbytes": n, "tensors": [[name, shape, dtype, byte offset], ...]}]. Tensors travel as raw bytes (uint8)."""
    buckets, current, used = [], [], 0
    for name, shape, dtype in spec:
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * torch.empty((), dtype=DTYPES[dtype]).element_size()
        if current and used + nbytes > bucket_bytes:
            buckets.append({"nbytes": used, "tensors": current})
            current, used = [], 0
        current.append([name, list(shape), dtype, used])
        used += nbytes
    if current:
        buckets.append({"nbytes": used, "tensors": current})
    return buckets


def unpack(buffer: torch.Tensor, bucket: dict):
    """(name, tensor) views of one received bucket."""
    for name, shape, dtype, offset in bucket["tensors"]:
        dt = DTYPES[dtype]
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * torch.empty((), dtype=dt).element_size()
        yield name, buffer[offset:offset + nbytes].view(dt).view(shape)


def broadcast_bytes(group, buffer: torch.Tensor, timeout_s: float) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    work = group.broadcast([buffer], opts)
    if not work.wait(datetime.timedelta(seconds=timeout_s)):
        raise TimeoutError(f"weight bucket broadcast of {buffer.numel()} bytes did not finish within {timeout_s}s")


RPC_KEY_ENV = "MEGARL_VLLM_RPC_KEY"


def rpc_tag(key: bytes, method: str, counter: int, args_json: str) -> str:
    """HMAC-SHA256 over (method, counter, arguments), each length-delimited by the JSON list around them."""
    message = json.dumps([method, counter, args_json]).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign_call(key: bytes, method: str, counter: int, args: dict) -> str:
    """The one string argument of a signed `/collective_rpc` call of `method` (what `RpcGuard.open` accepts)."""
    args_json = json.dumps(args)
    return json.dumps({"method": method, "counter": counter, "args": args_json,
                       "tag": rpc_tag(key, method, counter, args_json)})


class RpcRefused(PermissionError):
    """A call to the extension that is not the sampler's: unsigned, forged, for another method, or replayed."""


class RpcGuard:
    """The worker's check of every call (module docstring): the key from the server's environment, the last
    accepted counter. Counters must strictly increase, so a recorded call cannot be sent again."""

    def __init__(self, key: str | None):
        self.key = key.encode() if key else None
        self.last = 0

    def open(self, method: str, envelope) -> dict:
        """The call's arguments if `envelope` is a valid signed call of `method`; raises RpcRefused otherwise."""
        if self.key is None:
            raise RpcRefused(f"{method}: refused: {RPC_KEY_ENV} is not set in the vLLM server's environment "
                             f"(megarl.sampler.vllm_engine.VLLMEngine.start sets it; calls cannot be checked without it)")
        try:
            e = json.loads(envelope)
            called, counter, args_json, tag = e["method"], e["counter"], e["args"], e["tag"]
            well_formed = (isinstance(called, str) and type(counter) is int and isinstance(args_json, str)
                           and isinstance(tag, str))
        except (TypeError, ValueError, KeyError):
            well_formed = False
        if not well_formed:
            raise RpcRefused(f"{method}: refused: not a signed call (megarl_vllm_worker.sign_call)")
        if not hmac.compare_digest(tag.encode(), rpc_tag(self.key, called, counter, args_json).encode()):
            raise RpcRefused(f"{method}: refused: wrong signature")
        if called != method:
            raise RpcRefused(f"{method}: refused: the call is signed for {called}")
        if counter <= self.last:
            raise RpcRefused(f"{method}: refused: counter {counter} is not above the last accepted {self.last} "
                             f"(a replayed call)")
        self.last = counter
        args = json.loads(args_json)
        if not isinstance(args, dict):
            raise RpcRefused(f"{method}: refused: its arguments are not an object")
        return args


FINISHED_KEPT = 100_000  # final counts of finished requests remembered (oldest forgotten first)


class _FinishedCounts(dict):
    """model_runner.requests, recording each request's output-token count when vLLM drops it (it pops finished
    and aborted requests at the next step, gpu_model_runner._update_states). Without this a request that finished
    before a swap and one the scheduler had not started yet would both be absent at the swap, though all of the
    first one's tokens are old-version and all of the second's new."""

    def __init__(self, live: dict, finished: dict):
        super().__init__(live)
        self.finished = finished

    def _record(self, req_id, state) -> None:
        if state is not None and hasattr(state, "output_token_ids"):
            self.finished[req_id] = len(state.output_token_ids)
            while len(self.finished) > FINISHED_KEPT:
                self.finished.pop(next(iter(self.finished)))

    def pop(self, key, *default):
        state = super().pop(key, *default)
        self._record(key, state)
        return state

    def __delitem__(self, key):
        self._record(key, self.get(key))
        super().__delitem__(key)


def _open(worker, method: str, envelope) -> dict:
    """The worker's RpcGuard (made on first use: vLLM builds the worker, the extension has no __init__) opening
    `envelope`. A function, not a method: /collective_rpc can call every method of the worker by name."""
    guard = getattr(worker, "_megarl_guard", None)
    if guard is None:
        guard = worker._megarl_guard = RpcGuard(os.environ.get(RPC_KEY_ENV))
    return guard.open(method, envelope)


def _counts(worker) -> dict:
    """request id -> output tokens sampled so far, for every request the worker has seen since megarl_join
    (finished ones with their final count); a request absent from it has sampled nothing yet."""
    counts = dict(getattr(worker, "_megarl_finished", {}))
    counts.update({rid: len(state.output_token_ids) for rid, state in worker.model_runner.requests.items()})
    return counts


class MegarlWorkerExtension:
    """Mixed into vLLM's worker class; the methods run in the worker (see module docstring). /collective_rpc
    reaches every method of the worker by name, so the class has only these, and each opens its argument with
    `_open` first: nothing runs for a call that is not the sampler's."""

    def megarl_join(self, args: str) -> dict:
        a = _open(self, "megarl_join", args)
        if not isinstance(self.model_runner.requests, _FinishedCounts):
            self._megarl_finished = {}
            self.model_runner.requests = _FinishedCounts(self.model_runner.requests, self._megarl_finished)
        self._megarl_group = make_group(a["host"], a["port"], a["rank"], a["world_size"], a["timeout_s"])
        self._megarl_timeout_s = a["timeout_s"]
        return {"joined": True, "rank": a["rank"]}

    def megarl_counts(self, args: str) -> dict:
        """`_counts` (the token counts megarl_update takes)."""
        _open(self, "megarl_counts", args)
        return _counts(self)

    def megarl_lora_base(self, args: str) -> dict:
        """learner.lora: keep the frozen base (the checkpoint vLLM loaded, read again through vLLM's own loader,
        on the model's device) and the adapter's scale alpha / r; every later update is an adapter."""
        a = _open(self, "megarl_lora_base", args)
        from vllm.model_executor.model_loader import get_model_loader

        runner = self.model_runner
        model = runner.get_model()
        device = next(model.parameters()).device
        loader = get_model_loader(runner.vllm_config.load_config)
        base = {name: t.to(device, copy=True)
                for name, t in loader.get_all_weights(runner.vllm_config.model_config, model)}
        self._megarl_lora = {"factor": float(a["factor"]), "base": base}
        return {"tensors": len(base), "bytes": sum(t.numel() * t.element_size() for t in base.values())}

    def megarl_update(self, args: str) -> dict:
        a = _open(self, "megarl_update", args)
        start = time.perf_counter()
        counts = _counts(self)  # before any new weight is loaded: these tokens are the old version's
        received = []

        def weights():
            for bucket in a["buckets"]:
                buffer = torch.empty(bucket["nbytes"], dtype=torch.uint8)
                broadcast_bytes(self._megarl_group, buffer, self._megarl_timeout_s)
                for name, tensor in unpack(buffer, bucket):
                    received.append(name)
                    yield name, tensor

        lora = getattr(self, "_megarl_lora", None)
        if lora is None:
            tensors = weights()
        else:  # an adapter (megabytes): all of it first, checked, so a bad one is refused before any layer reloads
            adapter = dict(weights())
            lora_merge.check(lora["base"], adapter)
            tensors = lora_merge.merged_weights(lora["base"], adapter, lora["factor"])
        model, held = self.model_runner.get_model(), []
        with torch.no_grad():
            self.model_runner.reload_weights(weights_iterator=split_direct_copies(type(model).__name__, tensors, held),
                                             is_checkpoint_format=True)
            if held:
                model.load_weights(held)
            repack_cpu_experts(model)
        if len(received) != sum(len(b["tensors"]) for b in a["buckets"]):
            raise RuntimeError(f"megarl_update: vLLM's reload consumed {len(received)} of "
                               f"{sum(len(b['tensors']) for b in a['buckets'])} tensors")
        return {"counts": counts, "version": a["version"], "tensors": len(received),
                "seconds": time.perf_counter() - start}
