"""The built-in torch sampler engine: continuous batching, per-token behaviour log-probs, in-flight swaps.

This module owns scheduling and sampling; the model math and KV-cache layout live in
`megarl.sampler.model` (the native forward of the families of docs/models.md) or, for any other transformers
causal LM, `megarl.sampler.hf_model` (transformers' own modules over a per-slot KV cache, with the same interface;
`hf_model.choose` picks one, `model_impl` forces it).  `BuiltinEngine` implements the `Engine` protocol (megarl/protocols.py).

How a step runs (`step()`):
  1. staged weights, if any, become the current weights (a dict-reference swap at the step boundary;
     with kv_on_update="recompute" the running sequences are re-prefilled under the new weights);
  2. waiting requests are admitted into free slots and prefilled (in chunks of `prefill_chunk` positions: a long
     prompt's attention is [chunk, length], not [length, length]); the prefill's last logits sample each one's
     first completion token;
  3. one batched decode step for every running request (each has its own length and position);
  4. finished requests are returned, and the survivors are packed back to the front slots.

Per-slot state lives in preallocated device tensors (tokens, behaviour log-probs, positions, sampling
parameters), so the decode step has no Python loop over sequences; Python only touches a sequence when
it is admitted, finishes, or a swap starts a new version.  Lengths and versions are tracked on the host
(every decode step appends exactly one token to every running sequence, so a length is a base plus
the engine's decode-step count, and a version changes only at a swap): an ordinary decode step reads
nothing back from the device but the stop-token check.  Running sequences always occupy slots [0, n):
the model's forward then works on a view of the cache instead of gathering it.

On the paged KV layout (`kv_layout="paged"`) a request is admitted only when the block pool can reserve its
longest sequence; its blocks are taken as it grows (checked only at the decode step when some request crosses into
a new block) and returned when it ends, so no request runs out of cache mid-run; one that does not fit waits.

Between steps, on the stepping thread, a server can also look at and end requests before they finish
(megarl/sampler/sglang_server.py streams and aborts with them): `progress()` reads the output so far
of running requests (a gather of just the asked-for tokens), and `cancel()` removes running or queued
requests and returns their partial output as completions with finish_reason "abort".  Neither adds
work to a step.

Mixture-of-experts models: every position the engine computes -- a prompt's prefill, each decode step's
input token, a `recompute` re-prefill -- writes the experts its routers chose into the slot's route
buffer (uint8, or int16 past 255 experts; allocated only for an MoE model), so a finished request's
routes are those of the weights that computed each position (a re-prefill overwrites them).  A
completion carries them as `Completion.routes` [prompt + completion - 1, MoE layers, top_k] (a GLM-4.5's or
DeepSeek-V3's dense first layers have none).

Tensor parallelism: with `tp_group` (t ranks) the engine holds only its rank's weight slices
(`megarl.models.tp_shard`) and its share of the KV heads; the forward sums partial products over the
group and every rank computes the same logits.  Every rank must then run the same steps with the same
requests and apply the same weight version at the same step boundary: `step(apply_staged=False)` and
`apply_staged(version)` give that control to `megarl.sampler.tensor_parallel`, which drives the ranks.
Staged versions are kept by version (a rank's receiver may stage v+1 before the group applies v).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import torch

from megarl.models import moe, tp_shard
from megarl.protocols import Completion, GenerationRequest
from megarl.sampler import hf_model
from megarl.sampler.kv_blocks import blocks_for
from megarl.sampler.model import RuntimeWeights, WeightArena

KV_POLICIES = ("keep", "recompute")
# Staged versions held at once: under tensor parallelism a rank's receiver can stage v+1 before the
# group applies v, so v must survive it; a third drops the oldest (each is a full copy of the weights).
MAX_STAGED = 2
# Arenas of replaced versions kept for the next ones (see BuiltinEngine._spare): one is what a receiver
# that waits for the engine to move past a version before it reuses that version's storage needs.
SPARE_ARENAS = 1
# Prompt tokens per row in one prefill forward (sampler.prefill_chunk): a longer prompt is prefilled in chunks of
# this many positions, each attending to the cache the earlier ones wrote, so a prefill's attention scores and mask
# are [rows, heads, chunk, length] instead of [rows, heads, length, length] (at 32k tokens, 2 GiB of fp32 scores
# per head in one pass; 128 MiB in 2048-token chunks).
DEFAULT_PREFILL_CHUNK = 2048
# The KV cache's layout (sampler.kv_layout): "contiguous" preallocates max_seq_len positions per slot, "paged" holds
# a pool of blocks shared by the slots (megarl.sampler.model.PagedKVCache; docs/sampler.md#long-contexts).
KV_LAYOUTS = ("contiguous", "paged")
# Positions per block of the paged layout (sampler.kv_block_size): a request wastes at most one block less one
# position; a decode step runs one small matmul per (row, block, KV head), so smaller blocks mean more of them.
DEFAULT_KV_BLOCK_SIZE = 32


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generator: torch.Generator,
    *,
    any_random: bool = True,
    any_truncation: bool = True,
    any_greedy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens [B], behaviour log-probs [B]).

    logits: float [B, V]; temperature/top_p: float [B]; top_k: long [B] (0 = off).  Temperature 0 is
    greedy.  The log-prob is log_softmax(logits / temperature) over the full vocabulary (temperature 1
    for greedy rows) — top-k/top-p truncation only shapes the sampling distribution (docs/CONTRACTS.md).
    any_random / any_truncation / any_greedy say whether any row samples (temperature > 0), truncates
    (top-k or top-p, sampled rows) or is greedy; they let the caller skip work no row needs and must be
    true whenever a row needs it (the defaults are always correct).
    """
    if any_greedy:
        greedy = temperature <= 0
        temperature = temperature.masked_fill(greedy, 1.0)
    logp = torch.log_softmax(logits / temperature[:, None], dim=-1)
    if not any_random:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = _inverse_cdf((_truncate(logp, top_p, top_k) if any_truncation else logp).exp(), generator)
        if any_greedy:
            tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def _inverse_cdf(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row from unnormalised weights [B, V]: the first index whose running sum exceeds u * total.

    One uniform per row instead of one random number per vocabulary entry (the exponential race or
    torch.multinomial): on CPU the generator costs ~30 ns a number, which at V = 264 was the single
    most expensive kernel of a decode step.  The running sum is in fp64 so that every token's share of
    it (its sampling probability) is exact to ~1e-16 even over a 150k vocabulary; in fp32 tokens below
    ~1e-7 would be rounded away.  u * total < total, so the index lands on a token of non-zero weight.
    """
    cdf = weights.double().cumsum(dim=-1)
    u = torch.rand(cdf.shape[0], 1, dtype=cdf.dtype, device=cdf.device, generator=generator) * cdf[:, -1:]
    # clamp: only NaN weights (a diverged model) could land past the end; keep the index in range.
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)


def _truncate(logp: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Set log-probs outside each row's top-k, then outside its top-p nucleus, to -inf.

    As HF's logits processors: top-p is measured on the distribution renormalised after top-k, and the
    most likely token is always kept.
    """
    vocab = logp.shape[-1]
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logp.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    sorted_logp = sorted_logp.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logp, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logp = sorted_logp.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logp, float("-inf")).scatter(1, order, sorted_logp)


@dataclass
class _Running:
    """The host-side record of a running request; its tokens and log-probs live in the slot tensors."""

    request: GenerationRequest
    prompt_len: int
    end_len: int  # the sequence length at which it finishes by length
    base: int  # seq_len - the engine's decode-step count (constant while it runs)
    # (completion index, version): where the tokens of each version begin; a swap appends one.
    version_starts: list[tuple[int, int]]

    def versions(self, end: int, begin: int = 0) -> list[int]:
        """The versions of completion tokens [begin, end)."""
        ends = [start for start, _ in self.version_starts[1:]] + [end]
        return [v for (start, v), stop in zip(self.version_starts, ends)
                for _ in range(max(start, begin), min(stop, end))]


@dataclass
class Progress:
    """The output so far of a running request, from completion token `start` on (see `BuiltinEngine.progress`)."""

    start: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]


class BuiltinEngine:
    """Continuous-batching torch engine over HF-named weights (see module docstring).

    With `tp_group` of size t, `weights` are this rank's slices (`tp_shard.shard_state_dict(full, t,
    rank)`, shapes of `ModelSpec.shard(t)`); `from_pretrained` cuts them from an HF directory."""

    def __init__(
        self,
        hf_config: dict,
        weights: dict[str, torch.Tensor],
        *,
        max_running: int = 32,
        max_seq_len: int = 128,
        kv_on_update: str = "keep",
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        seed: int = 0,
        version: int = 0,
        device="cpu",
        tp_group=None,
        model_impl: str = "auto",
        kv_layout: str = "contiguous",
        kv_block_size: int = DEFAULT_KV_BLOCK_SIZE,
        kv_blocks: int = 0,
    ):
        if kv_on_update not in KV_POLICIES:
            raise ValueError(f"kv_on_update={kv_on_update!r} must be one of {KV_POLICIES}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 1 (sampler.prefill_chunk)")
        if max_running < 1 or max_seq_len < 2:
            raise ValueError(f"max_running={max_running} must be >= 1 and max_seq_len={max_seq_len} >= 2")
        self.tp_size = 1 if tp_group is None else tp_group.size()
        self.tp_group = tp_group if self.tp_size > 1 else None  # a group of one: the plain forward
        # The model's forward and KV cache: the native one of a family of docs/models.md, or transformers' own
        # modules for any other causal LM (megarl.sampler.hf_model.choose; sampler.model_impl forces one).
        self._impl = hf_model.choose(hf_config, model_impl)
        self.spec = self._impl.ModelSpec.from_hf_config(hf_config).shard(self.tp_size)  # this rank's heads and MLP width
        self.device = torch.device(device)
        self.kv_on_update = kv_on_update
        self.prefill_chunk = prefill_chunk
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout={kv_layout!r} must be one of {KV_LAYOUTS} (sampler.kv_layout)")
        if kv_layout == "paged" and not hasattr(self._impl, "PagedKVCache"):
            raise ValueError("sampler.kv_layout=paged needs the native model (docs/models.md); the generic path "
                             "(sampler.model_impl=hf) has the contiguous layout only")
        if kv_block_size < 1 or kv_blocks < 0:
            raise ValueError(f"kv_block_size={kv_block_size} must be >= 1 and kv_blocks={kv_blocks} >= 0 "
                             f"(sampler.kv_block_size, sampler.kv_blocks)")
        self.kv_layout, self.kv_block_size, self.kv_blocks = kv_layout, kv_block_size, kv_blocks

        self.spec.check_weights(weights)  # names and (this rank's) shapes
        # What stage_weights validates against: every HF name with its (this rank's) shape and dtype.
        self._hf_meta = {name: (t.shape, t.dtype) for name, t in weights.items()}
        arena = self._new_arena()  # the engine's own copy, on its device
        with torch.no_grad():
            arena.write(weights)
            self._weights = arena.finalize()
        self._version = version
        self._init_state(max_running, max_seq_len, seed)

    def _init_state(self, max_running: int, max_seq_len: int, seed: int) -> None:
        """The per-engine state around the weights: KV cache, slots, queue, generator, staging, counters."""
        self.max_running = max_running
        self.max_seq_len = max_seq_len
        self._paged = self.kv_layout == "paged"
        if self._paged:  # kv_blocks 0: as many positions as the contiguous layout's (max_running x max_seq_len)
            blocks = self.kv_blocks or max_running * blocks_for(max_seq_len, self.kv_block_size)
            self._cache = self._impl.PagedKVCache(self.spec, max_running, max_seq_len, self._weights.dtype,
                                                  self.device, block_size=self.kv_block_size, num_blocks=blocks)
        else:
            self._cache = self._impl.KVCache(self.spec, max_running, max_seq_len, self._weights.dtype, self.device)
        self._block_due = 0  # paged: the decode count at which some running request needs another block
        self._tables = self._impl.forward_tables(self.spec, max_seq_len, self._weights.dtype, self.device)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)

        self._waiting: deque[GenerationRequest] = deque()
        self._running: list[_Running] = []  # index = slot
        self._decode_count = 0  # decode steps so far: a running request's seq_len is its base + this
        self._max_len = 0  # max sequence length over running slots = attention span of a decode step
        self._length_due = 0  # decode count at which the next running request finishes by length
        self._any_random = False  # does any running request sample (temperature > 0)?
        self._any_truncation = False  # ... with top-k or top-p?
        self._any_greedy = False  # does any running request decode greedily (temperature 0)?
        self._any_stops = False  # does any running request have stop tokens?

        slots, long = max_running, torch.long
        # Per-slot state; every tensor's first dim is the slot, so packing slots moves all of them.
        self._slot = {
            "tokens": torch.zeros(slots, max_seq_len, dtype=long, device=self.device),  # prompt + completion
            "logprobs": torch.zeros(slots, max_seq_len, dtype=torch.float32, device=self.device),
            "pos": torch.zeros(slots, dtype=long, device=self.device),  # position of the last token (seq_len - 1)
            "temperature": torch.zeros(slots, dtype=torch.float32, device=self.device),
            "top_p": torch.ones(slots, dtype=torch.float32, device=self.device),
            "top_k": torch.zeros(slots, dtype=long, device=self.device),
            "stop_ids": torch.full((slots, 1), -1, dtype=long, device=self.device),  # padded with -1
        }
        if self.spec.is_moe:
            # The routes of every position of every slot (see the module docstring), and one decode step's.
            route_shape = (self.spec.num_moe_layers, self.spec.top_k)
            dtype = torch.from_numpy(np.zeros(0, moe.routes_dtype({"num_experts": self.spec.num_experts}))).dtype  # uint8; int16 past 255
            self._slot["routes"] = torch.zeros(slots, max_seq_len, *route_shape, dtype=dtype, device=self.device)
            self._decode_routes = torch.zeros(slots, 1, *route_shape, dtype=dtype, device=self.device)
            self._slot_index = torch.arange(slots, device=self.device)

        # Guards _staged, _filling, _spare and _retired, the only state other threads touch; notified when a
        # version is staged.
        self._lock = threading.Condition(threading.Lock())
        self._staged: dict[int, RuntimeWeights] = {}  # version -> weights, at most MAX_STAGED
        # Arenas handed out by `staging_buffers`, by version, being filled until `stage_weights` takes them.
        self._filling: dict[int, WeightArena] = {}
        # The arena of the version a swap replaced, kept (at most SPARE_ARENAS) for the next version to be
        # written into: an engine that keeps receiving versions holds two arenas (current + next), never
        # allocates (page faults on the receiving thread) and never frees on the decode thread.
        self._spare: list[WeightArena] = []
        # Replaced weights beyond the spare (skipped versions, a pinned one), released by the next
        # `stage_weights` call rather than at the swap: freeing a version's buffers costs milliseconds
        # per 100 MB, which belongs on the staging thread.
        self._retired: list[RuntimeWeights] = []
        self._stats = {"tokens_decoded": 0, "decode_steps": 0, "prefill_tokens": 0, "requests_finished": 0,
                       "requests_cancelled": 0, "swaps": 0, "swap_time_s": 0.0, "decode_time_s": 0.0}

    @classmethod
    def from_pretrained(cls, model_dir: str, tp_group=None, model_impl: str = "auto", **kw) -> "BuiltinEngine":
        """Load config.json + model.safetensors from an HF model directory (with `tp_group`: this
        rank's slices of it)."""
        import json
        import os

        with open(os.path.join(model_dir, "config.json")) as f:
            impl = hf_model.choose(json.load(f), model_impl)
        cfg, weights = impl.load_pretrained(model_dir)
        if tp_group is not None and tp_group.size() > 1:
            impl.ModelSpec.from_hf_config(cfg).shard(tp_group.size())  # a clear error before cutting anything
            # Views of the whole tensors: the engine copies its slices into its own arena.
            weights = tp_shard.shard_state_dict(weights, tp_group.size(), tp_group.rank())
        return cls(cfg, weights, tp_group=tp_group, model_impl=model_impl, **kw)

    def reseed(self, seed: int) -> None:
        """Restart the sampling generator from `seed` (every TP rank of an engine would have to do it alike: the
        sampler loop calls it on a single-process engine, before a sync-mode batch, megarl.roles.sampler_main)."""
        if self.tp_group is not None:
            raise ValueError("reseed: a tensor-parallel engine's followers do not mirror it")
        self._generator.manual_seed(seed)

    def pinned(self, *, max_running: int, seed: int) -> "BuiltinEngine":
        """An engine over this engine's current weights and version (shared, not copied) with its own KV
        cache, slots and generator seeded with `seed`: every token it generates is of this version, since
        nothing is ever staged on it. Evaluation runs on one (megarl/eval/run.py) while this engine keeps
        its running requests and staged versions. Single-process engines only (a TP group would need its
        followers to mirror the pinned engine's steps)."""
        if self.tp_group is not None:
            raise ValueError("pinned: a tensor-parallel engine cannot pin a version (its followers do not mirror it)")
        if max_running < 1:
            raise ValueError(f"pinned: max_running={max_running} must be >= 1")
        with self._lock:  # the pinned engine runs on this version's arena as long as it lives: never recycle it
            self._weights.arena = None
        twin = object.__new__(BuiltinEngine)
        twin.tp_size, twin.tp_group, twin.spec, twin.device = 1, None, self.spec, self.device
        twin._impl = self._impl
        twin.kv_on_update, twin.prefill_chunk = self.kv_on_update, self.prefill_chunk
        twin.kv_layout, twin.kv_block_size, twin.kv_blocks = self.kv_layout, self.kv_block_size, self.kv_blocks
        twin._weights, twin._hf_meta, twin._version = self._weights, self._hf_meta, self._version
        twin._init_state(max_running, self.max_seq_len, seed)
        return twin

    # ------------------------------------------------------------------ Engine protocol
    @property
    def version(self) -> int:
        return self._version

    @property
    def num_unfinished(self) -> int:
        return len(self._waiting) + len(self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def weight_spec(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """HF name -> (shape, dtype) of every tensor `stage_weights` accepts (this TP rank's slices)."""
        return dict(self._hf_meta)

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; ValueError if it can never run (the caller counts and skips it)."""
        prompt_len, sp = len(request.prompt_ids), request.sampling
        if prompt_len == 0:
            raise ValueError(f"request {request.request_id}: empty prompt")
        if prompt_len + 1 > self.max_seq_len:
            raise ValueError(f"request {request.request_id}: prompt_len={prompt_len} + 1 new token "
                             f"exceeds max_seq_len={self.max_seq_len}")
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= self.spec.vocab_size:
            raise ValueError(f"request {request.request_id}: prompt token ids outside [0, {self.spec.vocab_size})")
        if sp.max_new_tokens < 1 or sp.temperature < 0 or not 0 < sp.top_p <= 1 or sp.top_k < 0:
            raise ValueError(f"request {request.request_id}: invalid sampling params {sp}")
        if self._paged:
            positions = self._kv_positions(prompt_len, sp.max_new_tokens)
            if self._cache.blocks_for(positions) > self._cache.allocator.num_blocks:
                raise ValueError(f"request {request.request_id}: {positions} KV positions need "
                                 f"{self._cache.blocks_for(positions)} blocks of {self.kv_block_size}, the pool "
                                 f"has {self._cache.allocator.num_blocks} (raise sampler.kv_blocks)")
        self._waiting.append(request)

    def step(self, apply_staged: bool = True) -> list[Completion]:
        """Apply the newest staged version (unless apply_staged=False: a TP group applies versions
        through `apply_staged(version)`), admit, decode; return the requests that finished."""
        with torch.inference_mode():
            if apply_staged:
                self.apply_staged()
            finished: list[Completion] = []
            if self._waiting and len(self._running) < self.max_running:
                finished += self._admit()
            if self._running:
                finished += self._decode()
        return finished

    def staging_buffers(self, version: int) -> dict[str, torch.Tensor]:
        """HF name -> a writable view (HF shape, this rank's slices) of the storage `version` will run
        from.  A receiver writes the version's tensors there and hands these views (the same tensor
        objects) to `stage_weights`, which then turns them into the forward's layout in place instead of
        copying them (`WeightArena`).  The storage is the replaced version's when there is one, so an
        engine that receives every version this way holds two versions, not three.  Safe from any
        thread; every call for the same version (one per publish part) gets the same views, until it
        is staged."""
        with self._lock:
            arena = self._filling.get(version)
            if arena is None:
                arena = self._filling[version] = self._spare.pop() if self._spare else self._new_arena()
            return dict(arena.views)

    def stage_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Validate and stage a full HF-named weight set (this TP rank's slices); it becomes current at
        the next step boundary that applies it (`step()` applies the newest).

        Safe to call from another thread.  Validation, the copy into a weight arena (skipped when the
        tensors are that version's `staging_buffers`) and its transformation into the forward's layout
        happen here, on the caller's thread, so the decode thread's swap is a reference assignment.
        Staging the same version again replaces it; a version older than the current or a staged one is
        refused; beyond MAX_STAGED versions the oldest staged one is dropped.
        """
        for name, t in named_tensors.items():
            if name not in self._hf_meta:
                raise ValueError(f"stage_weights: unexpected tensor {name!r}")
            shape, dtype = self._hf_meta[name]
            if t.shape != shape or t.dtype != dtype:
                raise ValueError(f"stage_weights: {name!r} is {tuple(t.shape)} {t.dtype}, "
                                 f"expected {tuple(shape)} {dtype}")
        for name in self._hf_meta:
            if name not in named_tensors:
                raise ValueError(f"stage_weights: missing tensor {name!r}")
        with self._lock:
            self._check_newer(version)
            retired, self._retired = self._retired, []
            arena = self._filling.pop(version, None)
            in_place = arena is not None and all(named_tensors[name] is view for name, view in arena.views.items())
            if arena is None and self._spare:
                arena = self._spare.pop()
        del retired  # freed here, on the staging thread
        if arena is None:
            arena = self._new_arena()
        with torch.no_grad():
            if not in_place:
                arena.write(named_tensors)
            staged = arena.finalize()
        with self._lock:
            self._check_newer(version)
            if version in self._staged:
                self._recycle([self._staged[version]])
            self._staged[version] = staged
            while len(self._staged) > MAX_STAGED:
                self._recycle([self._staged.pop(min(self._staged))])
            self._lock.notify_all()

    def _new_arena(self) -> WeightArena:
        return self._impl.WeightArena(self.spec, {name: dtype for name, (_, dtype) in self._hf_meta.items()}, self.device)

    def _check_newer(self, version: int) -> None:
        newest = max([self._version, *self._staged])
        if version < newest:
            raise ValueError(f"stage_weights: version {version} is older than {newest}")

    def _recycle(self, replaced: list[RuntimeWeights]) -> None:
        """Keep the arenas of replaced weights as spares (up to SPARE_ARENAS), retire the rest (under _lock)."""
        for weights in replaced:
            if weights.arena is not None and len(self._spare) < SPARE_ARENAS:
                self._spare.append(weights.arena)
            else:
                self._retired.append(weights)

    def staged_versions(self) -> list[int]:
        """The versions staged and not yet applied, oldest first."""
        with self._lock:
            return sorted(self._staged)

    def wait_staged(self, version: int, timeout_s: float, should_stop=lambda: False) -> bool:
        """Block until `version` is staged (True), `timeout_s` passes or should_stop() (False); True
        at once if it is already staged.  should_stop is polled every 0.2 s."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while version not in self._staged:
                left = deadline - time.monotonic()
                if left <= 0 or should_stop():
                    return False
                self._lock.wait(min(left, 0.2))
        return True

    def apply_staged(self, version: int | None = None) -> int | None:
        """Make a staged version current now (the step boundary: call it between steps, from the
        stepping thread): the newest one, or exactly `version`.  Returns the version applied, None
        if nothing was staged (version=None only).  Older staged versions are dropped.  KeyError
        names a `version` that is not staged."""
        with self._lock:
            if version is None:
                if not self._staged:
                    return None
                version = max(self._staged)
            elif version not in self._staged:
                raise KeyError(f"apply_staged: version {version} is not staged (staged: {sorted(self._staged)}, "
                               f"current: {self._version})")
            weights = self._staged.pop(version)
            skipped = [self._staged.pop(v) for v in [v for v in self._staged if v < version]]
            self._recycle([self._weights, *skipped])
        start = time.perf_counter()
        self._weights, self._version = weights, version
        # Every running request's next token is the new version's (a step that swaps always decodes,
        # so two swaps never land on the same token).
        for record in self._running:
            record.version_starts.append((self._seq_len(record) - record.prompt_len, self._version))
        if self.kv_on_update == "recompute" and self._running:
            with torch.inference_mode():
                self._recompute_kv()
        self._stats["swaps"] += 1
        self._stats["swap_time_s"] += time.perf_counter() - start
        return version

    # ------------------------------------------------------------------ between steps (the stepping thread only)
    def progress(self, since: Mapping[str, int] | None = None) -> dict[str, Progress]:
        """request id -> the output so far of each running request: its completion tokens from index
        `since[request_id]` on (all of them without `since`), with their behaviour log-probs and versions.

        With `since`, only the running requests it names are reported (queued ones have no output yet).
        It gathers only the reported tokens and their log-probs (two small device->host reads), so asking
        for what is new (since = tokens already seen) keeps it cheap enough to call after every step.
        Call it between steps, from the thread that calls `step()`.
        """
        wanted = [(slot, r, 0 if since is None else since[r.request.request_id])
                  for slot, r in enumerate(self._running) if since is None or r.request.request_id in since]
        if not wanted:
            return {}
        # Completion tokens [begin, end) of each reported request; end - begin is at least 0.
        ends = [self._seq_len(r) - r.prompt_len for _, r, _ in wanted]
        begins = [min(start, end) for (_, _, start), end in zip(wanted, ends)]
        width = max(end - begin for begin, end in zip(begins, ends))
        token_rows = logprob_rows = [[]] * len(wanted)
        if width:
            rows = torch.tensor([slot for slot, _, _ in wanted], device=self.device)[:, None]
            first = torch.tensor([r.prompt_len + b for (_, r, _), b in zip(wanted, begins)], device=self.device)
            cols = (first[:, None] + torch.arange(width, device=self.device)).clamp_(max=self.max_seq_len - 1)
            token_rows = self._slot["tokens"][rows, cols].tolist()
            logprob_rows = self._slot["logprobs"][rows, cols].tolist()
        return {r.request.request_id: Progress(begin, tokens[:end - begin], logprobs[:end - begin],
                                               r.versions(end, begin))
                for (_, r, _), begin, end, tokens, logprobs in zip(wanted, begins, ends, token_rows, logprob_rows)}

    def cancel(self, request_ids: Iterable[str]) -> list[Completion]:
        """End running or queued requests now, between steps; return their output so far as completions
        with finish_reason "abort" (a queued request has no tokens).  KeyError names any id that is
        neither running nor queued (finished requests are gone).  Call it from the thread that calls
        `step()`.
        """
        ids = set(request_ids)
        queued = [r for r in self._waiting if r.request_id in ids]
        slots = [slot for slot, r in enumerate(self._running) if r.request.request_id in ids]
        unknown = ids - {r.request_id for r in queued} - {self._running[slot].request.request_id for slot in slots}
        if unknown:
            raise KeyError(f"cancel: request ids {sorted(unknown)} are neither running nor queued")
        self._waiting = deque(r for r in self._waiting if r.request_id not in ids)
        completions = [Completion(r.request_id, list(r.prompt_ids), [], [], [], finish_reason="abort")
                       for r in queued]
        if slots:
            completions += self._remove(slots, ["abort"] * len(slots))
        self._stats["requests_cancelled"] += len(completions)
        return completions

    def close(self) -> None:
        """Nothing to release: the engine lives in this process (the protocol's close is for engines that
        start processes)."""

    # ------------------------------------------------------------------ conveniences
    def stats(self) -> dict:
        out = dict(self._stats, version=self._version, running=len(self._running), waiting=len(self._waiting))
        if self._paged:  # the block pool: its size, the blocks in slots, the blocks promised to running requests
            pool = self._cache.allocator
            out.update(kv_blocks=pool.num_blocks, kv_blocks_used=pool.num_blocks - pool.free,
                       kv_blocks_reserved=pool.reserved)
        return out

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Run an idle engine until the given requests finish; completions in request order."""
        if self.num_unfinished:
            raise RuntimeError("generate() needs an idle engine")
        for request in requests:
            self.add_request(request)
        done: dict[str, Completion] = {}
        while self.num_unfinished:
            for completion in self.step():
                done[completion.request_id] = completion
        return [done[r.request_id] for r in requests]

    # ------------------------------------------------------------------ internals
    def _seq_len(self, record: _Running) -> int:
        return record.base + self._decode_count

    def _kv_positions(self, prompt_len: int, max_new_tokens: int) -> int:
        """The cache positions a request can ever write: all but the last token of its longest sequence."""
        return min(prompt_len + max_new_tokens, self.max_seq_len) - 1

    def _admissible(self, count: int) -> int:
        """How many of the first `count` waiting requests the block pool can reserve for, in queue order (a request
        that does not fit waits, and the ones behind it with it, until running ones end and return blocks)."""
        unreserved = self._cache.allocator.unreserved
        for i in range(count):
            r = self._waiting[i]
            unreserved -= self._cache.blocks_for(self._kv_positions(len(r.prompt_ids), r.sampling.max_new_tokens))
            if unreserved < 0:
                return i
        return count

    def _grow_blocks(self) -> None:
        """Paged: give every running request the blocks its next decode step writes into, and note when the next
        one needs another (so an ordinary step does not loop over the requests)."""
        records = self._running
        held = self._cache.grow([(slot, self._seq_len(r)) for slot, r in enumerate(records)])
        # A request needs a new block once base + decode count exceeds the positions it holds.
        self._block_due = min(h - r.base + 1 for h, r in zip(held, records))

    def _recompute_kv(self) -> None:
        """Re-prefill every running sequence's cached prefix (all but its last token) with the new weights."""
        n, span = len(self._running), self._max_len - 1  # the last token is fed by the next decode step
        # Only the K/V writes matter; the logits at each sequence's last cached position are the cheapest ask.
        # (seq_len >= prompt_len + 1 >= 2 for a running sequence, so the index is valid.)
        self._prefill(0, self._slot["tokens"][:n, :span], self._slot["pos"][:n] - 1)

    def _prefill(self, slot_start: int, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Compute positions [0, width) of ids [B, width] into slots [slot_start, slot_start + B) and return the
        logits [B, V] at position last[b] of each row, in chunks of `prefill_chunk` positions (see
        DEFAULT_PREFILL_CHUNK): chunk c attends to the cache positions < its end, which chunks <= c wrote. A row's
        logits come from the chunk holding its `last`; positions past a row's end are padding, overwritten
        before they are attended to (forward's contract). Each chunk is told where every row ends relative to it
        (logit_index = last - begin, outside the chunk for a row that ends before or after it), which is where a
        hybrid model's recurrent state of the row stops (megarl.sampler.hf_model)."""
        bsz, width = ids.shape
        rows = slice(slot_start, slot_start + bsz)
        logits = None
        for begin in range(0, width, self.prefill_chunk):
            end = min(begin + self.prefill_chunk, width)
            positions = torch.arange(begin, end, device=self.device).expand(bsz, end - begin)
            routes = self._routes(rows, width)
            chunk = self._impl.forward(
                self.spec, self._weights, self._tables, self._cache, ids[:, begin:end], positions,
                slot_start=slot_start, attn_len=end, logit_index=last - begin,
                tp_group=self.tp_group, routes=None if routes is None else routes[:, begin:end])
            if begin == 0:
                logits = chunk
            else:
                here = (last >= begin) & (last < end)
                logits = torch.where(here[:, None], chunk, logits)
        return logits

    def _routes(self, rows: slice, width: int) -> torch.Tensor | None:
        """The route buffer of slots `rows`, positions [0, width): a view the forward writes into (MoE only).
        Positions a row computes past its sequence end (right padding) are rewritten before they count."""
        return self._slot["routes"][rows, :width] if self.spec.is_moe else None

    def _admit(self) -> list[Completion]:
        """Prefill the waiting requests that fit and sample their first tokens. Requests with the same prompt (a
        group's samples) are prefilled once: the first of each computes it, the others copy its cache slot and its
        last position's logits (each still samples its own token)."""
        start = len(self._running)
        count = min(len(self._waiting), self.max_running - start)
        if self._paged:
            count = self._admissible(count)
            if not count:
                return []
        taken = [self._waiting.popleft() for _ in range(count)]
        computed_row: dict[tuple[int, ...], int] = {}  # prompt -> the row that computes it
        computed, copies, copied_from = [], [], []
        for request in taken:
            row = computed_row.setdefault(tuple(request.prompt_ids), len(computed))
            if row == len(computed):
                computed.append(request)
            else:
                copies.append(request)
                copied_from.append(row)
        requests = computed + copies  # the computed prompts take the first slots, each copy one after them
        copied_from = torch.tensor(copied_from, dtype=torch.long, device=self.device)
        lens = [len(r.prompt_ids) for r in requests]
        width = max(lens)
        rows = slice(start, start + count)
        s = self._slot

        ids = torch.tensor([r.prompt_ids + [0] * (width - len(r.prompt_ids)) for r in requests],
                           dtype=torch.long, device=self.device)
        s["tokens"][rows, :width] = ids
        prompt_lens = torch.tensor(lens, dtype=torch.long, device=self.device)
        s["pos"][rows] = prompt_lens  # where the first completion token goes
        s["temperature"][rows] = torch.tensor([r.sampling.temperature for r in requests], device=self.device)
        s["top_p"][rows] = torch.tensor([r.sampling.top_p for r in requests], device=self.device)
        s["top_k"][rows] = torch.tensor([r.sampling.top_k for r in requests], device=self.device)
        self._set_stop_ids(rows, requests)

        self._running += [
            _Running(r, n, end_len=min(n + r.sampling.max_new_tokens, self.max_seq_len),
                     base=n + 1 - self._decode_count, version_starts=[(0, self._version)])
            for r, n in zip(requests, lens)]
        self._refresh_running_flags()
        if self._paged:  # reservations fit (_admissible); the blocks of each prompt now, the rest as it grows
            for slot, r, n in zip(range(start, start + count), requests, lens):
                self._cache.reserve(slot, self._kv_positions(n, r.sampling.max_new_tokens))
            self._cache.grow([(slot, n) for slot, n in zip(range(start, start + count), lens)])
        n_computed = len(computed)
        logits = self._prefill(start, ids[:n_computed], prompt_lens[:n_computed] - 1)
        if copies:
            copy_slots = torch.arange(start + n_computed, start + count, device=self.device)
            self._cache.move_slots(start + copied_from, copy_slots, width)
            if self.spec.is_moe:
                s["routes"][copy_slots, :width] = s["routes"][start + copied_from, :width]
            logits = torch.cat([logits, logits[copied_from]])
        tokens = self._sample_and_append(rows, logits)
        self._max_len = max(self._max_len, width + 1)
        self._stats["prefill_tokens"] += sum(lens[:n_computed])
        return self._collect_finished(rows, tokens)

    def _set_stop_ids(self, rows: slice, requests: list[GenerationRequest]) -> None:
        stops = self._slot["stop_ids"]
        width = max(len(r.stop_token_ids) for r in requests)
        if width > stops.shape[1]:  # widen once; -1 never matches a token
            pad = torch.full((stops.shape[0], width - stops.shape[1]), -1, dtype=torch.long, device=self.device)
            stops = self._slot["stop_ids"] = torch.cat([stops, pad], dim=1)
        padded = [list(r.stop_token_ids) + [-1] * (stops.shape[1] - len(r.stop_token_ids)) for r in requests]
        stops[rows] = torch.tensor(padded, dtype=torch.long, device=self.device)

    def _refresh_running_flags(self) -> None:
        """Host-side facts about the running set that let a step skip work; O(running), on changes only."""
        params = [r.request.sampling for r in self._running]
        self._any_random = any(p.temperature > 0 for p in params)
        self._any_truncation = any(p.temperature > 0 and (p.top_p < 1 or p.top_k > 0) for p in params)
        self._any_greedy = any(p.temperature <= 0 for p in params)
        self._any_stops = any(r.request.stop_token_ids for r in self._running)
        self._length_due = min((r.end_len - r.base for r in self._running), default=0)
        self._block_due = self._decode_count  # the running set changed: the next decode step checks the blocks

    def _decode(self) -> list[Completion]:
        start = time.perf_counter()
        n, s = len(self._running), self._slot
        pos = s["pos"][:n]
        ids = s["tokens"][:n].gather(1, pos[:, None])
        step_routes = self._decode_routes[:n] if self.spec.is_moe else None
        if self._paged and self._decode_count >= self._block_due:
            self._grow_blocks()
        logits = self._impl.forward(self.spec, self._weights, self._tables, self._cache, ids, pos[:, None],
                         attn_len=self._max_len, tp_group=self.tp_group, routes=step_routes)
        if step_routes is not None:  # the input token's routes, at its position
            s["routes"][self._slot_index[:n], pos] = step_routes[:, 0]
        pos += 1  # in place: each sampled token goes one position further
        tokens = self._sample_and_append(slice(0, n), logits[:, 0])
        self._decode_count += 1
        self._max_len += 1
        self._stats["decode_steps"] += 1
        self._stats["decode_time_s"] += time.perf_counter() - start
        return self._collect_finished(slice(0, n), tokens)

    def _sample_and_append(self, rows: slice, logits: torch.Tensor) -> torch.Tensor:
        """Sample the next token of slots `rows` and write it (and its log-prob) at each slot's `pos`."""
        s = self._slot
        tokens, logprobs = sample_tokens(
            logits.float(), s["temperature"][rows], s["top_p"][rows], s["top_k"][rows], self._generator,
            any_random=self._any_random, any_truncation=self._any_truncation, any_greedy=self._any_greedy)
        at = s["pos"][rows, None]
        s["tokens"][rows].scatter_(1, at, tokens[:, None])
        s["logprobs"][rows].scatter_(1, at, logprobs[:, None])
        self._stats["tokens_decoded"] += tokens.shape[0]
        return tokens

    def _collect_finished(self, rows: slice, tokens: torch.Tensor) -> list[Completion]:
        """Return the requests finished by `tokens` (just sampled for slots `rows`) and pack the survivors.

        Length is known on the host; a stop token needs one device->host read, skipped when no running
        request has stop tokens.
        """
        stopped: list[int] = []
        if self._any_stops:
            hit = (tokens[:, None] == self._slot["stop_ids"][rows]).any(dim=1)
            stopped = [rows.start + i for i in hit.nonzero().flatten().tolist()]  # the step's one sync
        by_length = []
        if self._decode_count >= self._length_due:
            by_length = [slot for slot, r in enumerate(self._running) if self._seq_len(r) >= r.end_len]
        done_slots = sorted(set(stopped) | set(by_length))
        if not done_slots:
            return []
        stopped_set = set(stopped)
        completions = self._remove(done_slots, ["stop" if slot in stopped_set else "length" for slot in done_slots])
        self._stats["requests_finished"] += len(completions)
        return completions

    def _remove(self, slots: list[int], finish_reasons: list[str]) -> list[Completion]:
        """The completions of running `slots` (ascending) with their finish reasons; frees and packs the slots."""
        index = torch.tensor(slots, device=self.device)
        token_rows, logprob_rows = self._slot["tokens"][index].tolist(), self._slot["logprobs"][index].tolist()
        route_rows = self._slot["routes"][index].cpu().numpy() if self.spec.is_moe else [None] * len(slots)
        completions = []
        for slot, reason, token_row, logprob_row, route_row in zip(slots, finish_reasons, token_rows, logprob_rows,
                                                                   route_rows):
            record = self._running[slot]
            begin, end = record.prompt_len, self._seq_len(record)
            completions.append(Completion(
                request_id=record.request.request_id,
                prompt_ids=list(record.request.prompt_ids),
                token_ids=token_row[begin:end],
                logprobs=logprob_row[begin:end],
                versions=record.versions(end - begin),
                finish_reason=reason,
                # Every position but the last token's (never an input); a copy, not a view of the batch.
                routes=None if route_row is None else route_row[:end - 1].copy(),
            ))
        self._pack_slots(set(slots))
        return completions

    def _pack_slots(self, done: set[int]) -> None:
        """Move the survivors that sit past the new end into the freed slots below it."""
        n = len(self._running)
        keep = n - len(done)
        holes = [slot for slot in sorted(done) if slot < keep]
        movers = [slot for slot in range(keep, n) if slot not in done]
        if self._paged:  # the finished requests' blocks return to the pool; the movers take their table rows along
            self._cache.release(sorted(done))
            self._cache.pack(movers, holes)
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            if not self._paged:
                self._cache.move_slots(src, dst, self._max_len)
            for t in self._slot.values():
                t[dst] = t[src]
            for h, m in zip(holes, movers):
                self._running[h] = self._running[m]
        del self._running[keep:]
        self._max_len = max((self._seq_len(r) for r in self._running), default=0)
        self._refresh_running_flags()
