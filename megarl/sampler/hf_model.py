"""The generic model of the built-in engine: any transformers causal LM, run by transformers' own modules.

It implements the interface of megarl.sampler.model (ModelSpec, KVCache, forward_tables, WeightArena,
RuntimeWeights, forward, load_pretrained) for a model type that is not a row of megarl.models.families, so
megarl.sampler.engine keeps its scheduling, sampling, per-token versions and in-flight swaps unchanged; `choose`
picks this module or the native one (docs/models.md#the-generic-path).

* Weights: one skeleton module per spec, built from the config with its parameters on the meta device (its
  buffers, e.g. RoPE's inv_freq, real); every version is a dict of HF-named tensors (named_parameters' names, and
  a sigmoid-routed MoE's router expert bias, a buffer saved with the weights, e.g. Nemotron-H's: what the DeepSpeed
  learner publishes) that `forward` substitutes with torch.func.functional_call. Swapping
  versions is replacing the dict, as in the native engine; tied parameters stay tied (tie_weights=True).
* KV cache: the engine's slot cache, not transformers' DynamicCache or StaticCache. The engine batches rows of
  different lengths and positions in one call (continuous batching: each running request decodes at its own
  position, rows are packed and moved between slots), which DynamicCache (one length for the batch) and
  StaticCache (one cache_position for the batch) cannot hold. `SlotCache` is a transformers `Cache` whose layers
  scatter each row's new K/V at that row's positions of its slot and hand the attention [rows, kv_heads,
  attn_len, head_dim]; the forward passes a 4-D additive mask per row (causal over the row's own slot, and the
  window for sliding-window layers), which transformers uses as it is, and position_ids per row for RoPE.
  Storage is allocated per layer at its first update, in the shapes the model's attention gives (MLA's K and V
  widths may differ).
* Recurrent state (hybrid models; `layer_types` entry "linear_attention": gated DeltaNet in Qwen3-Next and Qwen3.5,
  Mamba-2 in Nemotron-H, whose config.json calls the list `layers_block_type`): `_SlotRecurrentLayer` holds each
  slot's conv state [conv_dim, kernel] and recurrent state (gated DeltaNet's [heads, k_dim, v_dim], Mamba-2's SSM
  state [heads, head_dim, state]; fp32, as transformers' torch paths compute them) behind the same `Cache` methods
  transformers' own linear-attention cache layer exposes (get/update_conv_state, get/update_recurrent_state,
  get_recurrent_states_to_keep). A call with `logit_index` is a chunk of a prefill (a new prompt, or a `recompute`
  re-prefill) at positions [begin, begin + width): the first chunk starts every row from zeros, a later one from
  the state the chunks before it left. The rows are right-padded, so each row's state is taken where the row ends
  in the chunk (logit_index + 1 tokens in, clamped to [0, width]), never after its padding: the conv state from the
  row's last `kernel` inputs, the recurrent state from the per-token states transformers computes for the padded
  tail (get_recurrent_states_to_keep); a row that ended in an earlier chunk keeps its state. A call without
  `logit_index` continues every row from its slot's state (a decode step). Blocks that hold no cache (Nemotron-H's
  "mlp" and "moe" entries) take transformers' DummyLayer.
* What it cannot run: other layers with state of their own (a `layer_types` entry other than full / sliding /
  linear attention, mlp / moe) and tensor parallelism (sampler.tp > 1); both are refused naming the key.
  It does not record MoE routes (algo.routing_replay=r3 needs a family of docs/models.md).

It costs more per token than the native forward (one module call per layer, no stacked projections, the whole
logits of a prefill): the engine says so once when it picks it.
"""
from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager

import torch
from torch.func import functional_call

from megarl.models.families import generic_path_hint, is_native
from megarl.models.moe import EXPERT_BIAS, fused_experts_on_disk, is_moe

IMPLS = ("auto", "native", "hf")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
RECURRENT_LAYER_TYPES = ("linear_attention",)  # gated DeltaNet (Qwen3-Next, Qwen3.5), Mamba-2 (Nemotron-H)
NO_CACHE_LAYER_TYPES = ("mlp", "moe")  # Nemotron-H lists its MLP and MoE blocks as layers of their own
_ANNOUNCED: set[str] = set()  # model types whose "slower than native" line this process printed


def choose(hf_config: dict, model_impl: str = "auto"):
    """The module implementing the engine's model for `hf_config`: megarl.sampler.model (the native forward of a
    family of docs/models.md) or this one. "auto": native for a family whose config the native forward takes,
    this module otherwise; "native" / "hf" force one (sampler.model_impl)."""
    from megarl.sampler import model as native

    if model_impl not in IMPLS:
        raise ValueError(f"sampler.model_impl={model_impl!r} must be one of {IMPLS}")
    if model_impl == "native":
        return native
    reason = "forced by sampler.model_impl=hf"
    if model_impl == "auto":
        if not is_native(hf_config):
            reason = f"model_type {hf_config.get('model_type')!r} is not a family of docs/models.md"
        else:
            try:
                native.ModelSpec.from_hf_config(hf_config)
                return native
            except ValueError as exc:
                reason = f"the native engine does not run this config ({exc})"
    key = str(hf_config.get("model_type"))
    # (gpt-oss's experts are fused on disk as in memory, so what the learners publish is what transformers' modules
    # take)
    if is_native(hf_config) and is_moe(hf_config) and not fused_experts_on_disk(hf_config):
        raise ValueError(f"the built-in engine does not run {key!r} ({reason}): megarl's learners publish a family's "
                         f"experts per expert (save_pretrained's names), its generic model takes transformers' fused "
                         f"expert tensors; docs/models.md lists what serves each family")
    if key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        print(f"megarl: built-in engine: running {key!r} through transformers' own modules "
              f"(megarl/sampler/hf_model.py; {reason}): slower than the native engine, see "
              f"docs/models.md#the-generic-path", file=sys.stderr, flush=True)
    return sys.modules[__name__]


@contextmanager
def _meta_parameters():
    """Modules built inside get their parameters on the meta device and their buffers on the CPU: a skeleton
    that costs no weight memory, whose buffers (computed in __init__) are real."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:  # (a meta one is a tie to a parameter moved already)
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


class ModelSpec:
    """The skeleton transformers model of an HF config dict and the facts the engine reads (vocab_size, layer count;
    never MoE to the engine: routes are not recorded)."""

    is_moe = False
    num_experts = top_k = 0
    tp_size = 1

    def __init__(self, cfg: dict, model, shapes: dict[str, tuple[int, ...]]):
        self.model, self.shapes = model, shapes
        self.model_type = cfg.get("model_type")
        text = model.config.get_text_config()
        self.vocab_size = int(text.vocab_size)
        self.num_layers = int(text.num_hidden_layers)
        self.layer_types = list(getattr(text, "layer_types", None) or [])
        self.sliding_window = getattr(text, "sliding_window", None)
        if not self.layer_types and self.sliding_window and getattr(text, "use_sliding_window", True):
            self.layer_types = ["sliding_attention"] * self.num_layers  # (Mistral: one window for every layer)
        self.is_hybrid = any(t in RECURRENT_LAYER_TYPES for t in self.layer_types)
        self.cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelSpec":
        """ValueError naming what transformers cannot build or this engine cannot run."""
        from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

        known = ATTENTION_LAYER_TYPES + RECURRENT_LAYER_TYPES + NO_CACHE_LAYER_TYPES
        odd = [t for t in (cfg.get("layer_types") or cfg.get("layers_block_type") or []) if t not in known]
        if odd:
            raise ValueError(f"layer_types {sorted(set(odd))}: the generic engine keeps a KV cache and gated-DeltaNet "
                             f"or Mamba-2 state only (layers: {known}); other layers with state of their own need "
                             f"sampler.engine=vllm or sglang ({generic_path_hint()})")
        try:
            # (config.json tags the floats JSON cannot hold, e.g. Nemotron-H's time_step_limit (0, inf), as
            # {"__float__": "Infinity"}; transformers decodes them when it reads the file itself)
            plain = PretrainedConfig._decode_special_floats(cfg)
            config = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in plain.items() if k != "model_type"})
            with _meta_parameters():
                model = AutoModelForCausalLM.from_config(config)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"model_type {cfg.get('model_type')!r}: transformers cannot build it as a causal LM "
                             f"({exc}) ({generic_path_hint()})") from exc
        model.eval()
        return cls(cfg, model, {name: tuple(t.shape) for name, t in version_tensors(model)})

    def shard(self, tp_size: int) -> "ModelSpec":
        if tp_size != 1:
            raise ValueError(f"sampler.tp={tp_size}: the generic engine runs whole models only (sampler.tp=1); "
                             f"tensor parallelism needs a family of docs/models.md")
        return self

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every tensor of a version (version_tensors: a tied lm_head is the embedding, not
        listed)."""
        return dict(self.shapes)

    def check_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """ValueError naming the first missing, unexpected or wrongly shaped tensor."""
        for name, shape in self.shapes.items():
            if name not in weights:
                raise ValueError(f"weights: missing tensor {name!r}")
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"weights: {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")
        for name in weights:
            if name not in self.shapes:
                raise ValueError(f"weights: unexpected tensor {name!r} for {self.model_type}")


def version_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What one weight version of `model` holds: its named_parameters, and its router expert biases (buffers that
    checkpoints hold and the router reads, never trained; the DeepSpeed learner publishes them beside the
    parameters)."""
    return list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n.endswith(EXPERT_BIAS[0])]


class _SlotLayer:
    """One layer's K and V of every slot, [slots, kv_heads, max_seq_len, head_dim] each, allocated at the first
    update in the shapes and dtype the attention gives. `update` is what transformers' attention calls."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: "KVCache"):
        self.owner, self.keys, self.values = owner, None, None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        o = self.owner
        if self.keys is None:
            self.keys, self.values = (torch.zeros((o.num_slots, s.shape[1], o.max_seq_len, s.shape[3]), dtype=s.dtype,
                                                  device=s.device) for s in (key_states, value_states))
        rows = slice(o.slot_start, o.slot_start + key_states.shape[0])
        for store, new in ((self.keys, key_states), (self.values, value_states)):
            index = o.positions[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3])
            store[rows].scatter_(2, index, new.to(store.dtype))  # a view: the writes land in the cache
        return self.keys[rows, :, :o.attn_len], self.values[rows, :, :o.attn_len]

    def get_seq_length(self) -> int:
        return 0  # (the forward passes position_ids and a 4-D mask: nothing reads a cache length)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.attn_len, 0

    def get_max_length(self) -> int:
        return self.owner.max_seq_len


def _linear_attention_mixin():
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return LinearAttentionCacheLayerMixin


class _SlotRecurrentLayer:
    """One linear-attention layer's conv state [slots, conv_dim, kernel] and recurrent state [slots, ...] (gated
    DeltaNet's delta-rule state, Mamba-2's SSM state) of every slot, allocated at the first update in the shapes
    the layer gives. transformers' `Cache` reads `conv_states`,
    `recurrent_states` and `has_previous_state` of its layer; here they are the call's rows of the slots (views, so
    transformers' in-place decode update of the conv state lands in the cache). Built as a subclass of
    transformers' LinearAttentionCacheLayerMixin (`KVCache.__init__`), which the `Cache` methods check for."""

    is_sliding = False
    is_compileable = False
    conv_kernel_size = None

    def __init__(self, owner: "KVCache"):
        self.owner, self.conv, self.state = owner, None, None

    def _rows(self, store):
        o = self.owner
        return store[o.slot_start:o.slot_start + o.rows]

    # What transformers' Cache.get_conv_state / get_recurrent_state read: the rows' state, unless the call is a
    # prefill's first chunk (then there is no previous state and the layer starts from zeros).
    @property
    def has_previous_state(self) -> dict[int, bool]:
        return {0: self.owner.lengths is None or self.owner.begin > 0}

    @property
    def conv_states(self) -> dict[int, torch.Tensor]:
        return {0: self._rows(self.conv)}

    @property
    def recurrent_states(self) -> dict[int, torch.Tensor]:
        return {0: self._rows(self.state)}

    @property
    def record_past(self) -> bool:
        # (also what keeps transformers' one-token conv update, which would advance every row, off a one-token chunk
        # that a row ended before)
        return self.owner.lengths is not None and self.recurrent_states_to_keep > 0

    @property
    def recurrent_states_to_keep(self) -> int:
        """In a prefill chunk of right-padded rows: the states after the last `width - shortest + 1` tokens, among
        which each row's state at its own length (0 when every row runs through the chunk: the final state is every
        row's). A row with no token in the chunk keeps its state (`update_recurrent_state`)."""
        o = self.owner
        return 0 if o.lengths is None or o.shortest == o.width else o.width - max(o.shortest, 1) + 1

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size=None, **kwargs):
        """A prefill chunk's conv inputs [rows, conv_dim, T]: store each row's last `kernel` inputs up to where it
        ends in the chunk (the earlier chunks' inputs before them, zeros before position 0) and return the inputs the
        convolution runs over: the chunk's own in the first chunk (the convolution pads them itself), the stored
        state and the chunk's in a later one (transformers drops the outputs of the stored part)."""
        o = self.owner
        kernel = conv_kernel_size or self.conv_kernel_size
        self.conv_kernel_size = kernel
        if self.conv is None:
            self.conv = torch.zeros((o.num_slots, conv_states.shape[1], kernel), dtype=conv_states.dtype,
                                    device=conv_states.device)
        rows = self._rows(self.conv)
        before = rows if o.begin > 0 else torch.zeros_like(rows)
        padded = torch.cat([before.to(conv_states.dtype), conv_states], dim=2)
        index = (o.lengths[:, None] + torch.arange(kernel, device=padded.device))[:, None, :]
        rows.copy_(padded.gather(2, index.expand(-1, padded.shape[1], -1)))
        return padded if o.begin > 0 else conv_states

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs):
        """The state after the call: one tensor [rows, ...] (a decode step, or a chunk every row runs through), or the
        states after each of the last `recurrent_states_to_keep` tokens of a padded chunk (each row takes its own).
        In a prefill chunk a row that ended before it keeps the state it has."""
        o = self.owner
        if not isinstance(recurrent_states, torch.Tensor):
            stacked = torch.stack(list(recurrent_states))  # [kept, rows, ...]: the state after token width-kept+i
            pick = (o.lengths - (o.width - stacked.shape[0]) - 1).clamp(min=0)
            recurrent_states = stacked[pick, torch.arange(stacked.shape[1], device=stacked.device)]
        if self.state is None:
            self.state = torch.zeros((o.num_slots, *recurrent_states.shape[1:]), dtype=torch.float32,
                                     device=recurrent_states.device)
        rows = self._rows(self.state)
        if o.lengths is not None and o.shortest == 0:
            ended = (o.lengths == 0).view(-1, *[1] * (rows.dim() - 1))
            recurrent_states = torch.where(ended, rows, recurrent_states.to(rows.dtype))
        rows.copy_(recurrent_states)
        return rows

    def lazy_initialization(self, *args, **kwargs) -> None:
        """(storage is allocated by the updates, for every slot at once)"""

    def increase_count(self, state_idx: int) -> None:
        """(transformers counts tokens here; the engine tracks every slot's length itself)"""

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for store in (self.conv, self.state):
            if store is not None:
                store[dst] = store[src]


class KVCache:
    """The engine's KV cache over transformers' attention (`SlotCache` layers for `num_slots` slots of
    `max_seq_len` positions) and, for a hybrid model, each linear-attention layer's per-slot recurrent state.
    `transformers_cache()` is the object the model's forward is handed."""

    def __init__(self, spec: ModelSpec, num_slots: int, max_seq_len: int, dtype: torch.dtype, device="cpu"):
        from transformers.cache_utils import Cache, DummyLayer

        class SlotCache(Cache):
            """A transformers Cache whose layers are this KVCache's (the per-call rows set by `forward`)."""

        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.slot_start, self.positions, self.attn_len, self.rows = 0, None, max_seq_len, 0
        # A prefill chunk's per-row token counts (None in a decode step), its first position, width and fewest
        # tokens of a row (host ints).
        self.lengths, self.begin, self.width, self.shortest = None, 0, 0, 0
        recurrent = type("SlotRecurrentLayer", (_SlotRecurrentLayer, _linear_attention_mixin()), {})
        types = spec.layer_types or ["full_attention"] * spec.num_layers
        self.layers = [recurrent(self) if t in RECURRENT_LAYER_TYPES else DummyLayer() if t in NO_CACHE_LAYER_TYPES
                       else _SlotLayer(self) for t in types]
        self._cache = SlotCache(layers=self.layers)

    def transformers_cache(self):
        return self._cache

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy the first `length` positions of slots `src` into slots `dst` (used to keep slots packed)."""
        for layer in self.layers:
            if isinstance(layer, _SlotRecurrentLayer):
                layer.move_slots(src, dst)
            elif layer.keys is not None:
                layer.keys[dst, :, :length] = layer.keys[src, :, :length]
                layer.values[dst, :, :length] = layer.values[src, :, :length]


def forward_tables(spec: ModelSpec, max_seq_len: int, dtype: torch.dtype = torch.float32, device="cpu"):
    """The key positions of the masks (the model's own modules hold everything else)."""
    return torch.arange(max_seq_len, device=device)


class WeightArena:
    """The storage of one weight version: a tensor per HF name (`views`, written in place by a receiver or
    `write`); `finalize` hands them to the forward as they are (transformers' layout is the HF layout)."""

    def __init__(self, spec: ModelSpec, dtypes: dict[str, torch.dtype], device="cpu"):
        self.spec = spec
        _buffers_to(spec.model, torch.device(device))  # (the skeleton's buffers, where its weights will be)
        self.views = {name: torch.empty(shape, dtype=dtypes[name], device=device)
                      for name, shape in spec.weight_shapes().items()}

    def write(self, weights: dict[str, torch.Tensor]) -> None:
        for name, tensor in weights.items():
            self.views[name].copy_(tensor)

    def finalize(self) -> "RuntimeWeights":
        return RuntimeWeights(params=dict(self.views), arena=self)


def _buffers_to(model: torch.nn.Module, device: torch.device) -> None:
    """Move the skeleton's buffers (not its meta parameters, which have no data) to `device`."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


class RuntimeWeights:
    """One version's parameters for functional_call; `arena` as megarl.sampler.model.RuntimeWeights'."""

    def __init__(self, params: dict[str, torch.Tensor], arena: WeightArena | None):
        self.params, self.arena = params, arena
        self.embed = next(iter(params.values()))  # (the engine's tests read its storage address)

    @property
    def dtype(self) -> torch.dtype:
        return next(t.dtype for t in self.params.values() if t.is_floating_point())


def prepare_weights(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> RuntimeWeights:
    """Check an HF-named state dict against the spec and copy it into a new arena."""
    spec.check_weights(weights)
    arena = WeightArena(spec, {name: t.dtype for name, t in weights.items()}, next(iter(weights.values())).device)
    arena.write(weights)
    return arena.finalize()


def _mask(spec: ModelSpec, key_pos: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """The additive mask [B, 1, T, L] of each row's queries over its slot: key position <= query position (and,
    for sliding-window layers, > query position - window, transformers' sliding_window_overlay); a dict by layer
    type where the model's layers differ, as transformers' hybrid models take it."""
    q = positions[:, None, :, None]
    causal = key_pos <= q
    blocked = torch.finfo(dtype).min

    def additive(allowed):
        return torch.zeros(allowed.shape, dtype=dtype, device=key_pos.device).masked_fill_(~allowed, blocked)

    types = set(spec.layer_types) - set(NO_CACHE_LAYER_TYPES)
    if not types or types == {"full_attention"}:
        return additive(causal)
    masks = {"full_attention": additive(causal)}
    if "sliding_attention" in types:
        masks["sliding_attention"] = additive(causal & (key_pos > q - spec.sliding_window))
    if types & set(RECURRENT_LAYER_TYPES):
        # No padding mask for linear attention: padding sits right of each row's tokens, so it reaches neither
        # their outputs (causal) nor the state kept for the row (taken at the row's length).
        masks.update({t: None for t in RECURRENT_LAYER_TYPES})
    return masks if len(types) > 1 else masks[types.pop()]


def forward(spec: ModelSpec, weights: RuntimeWeights, tables: torch.Tensor, cache: KVCache, input_ids: torch.Tensor,
            positions: torch.Tensor, *, slot_start: int = 0, attn_len: int | None = None,
            logit_index: torch.Tensor | None = None, tp_group=None, routes=None) -> torch.Tensor:
    """megarl.sampler.model.forward's contract (rows in slots [slot_start, slot_start + B), tokens at
    `positions`, each attending to its own slot's positions <= its own), run by the transformers model.

    For a hybrid model a call with `logit_index` is a chunk of a prefill (positions [begin, begin + T), begin 0 for
    its first) in which row r has logit_index[r] + 1 tokens, clamped to [0, T] (the rest is padding; each row's
    recurrent state is kept where it ends), and a call without it continues every row from its slot's recurrent
    state, as the engine calls it. An index outside [0, T) takes the nearest token's logits."""
    if tp_group is not None and tp_group.size() > 1:
        raise ValueError("forward: the generic engine has no tensor parallelism (sampler.tp=1)")
    bsz = input_ids.shape[0]
    attn_len = cache.max_seq_len if attn_len is None else attn_len
    cache.slot_start, cache.positions, cache.attn_len, cache.rows = slot_start, positions, attn_len, bsz
    cache.lengths = None
    if spec.is_hybrid and logit_index is not None:
        cache.width = input_ids.shape[1]
        cache.lengths = (logit_index + 1).clamp(0, cache.width)
        # (host reads per prefill chunk: where it starts, how many tail states to keep)
        cache.begin, cache.shortest = int(positions[0, 0]), int(cache.lengths.min())
    mask = _mask(spec, tables[:attn_len], positions, weights.dtype)
    out = functional_call(spec.model, weights.params, args=(), strict=False, tie_weights=True, kwargs={
        "input_ids": input_ids, "position_ids": positions, "attention_mask": mask, "use_cache": True,
        spec.cache_kwarg: cache.transformers_cache()})
    logits = out.logits
    if logit_index is not None:
        return logits[torch.arange(bsz, device=logits.device), logit_index.clamp(0, logits.shape[1] - 1)]
    return logits


def load_pretrained(model_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, version_tensors' tensors) of an HF directory, loaded by transformers (its own name
    conversions included), in the checkpoint's dtype."""
    import json
    import os

    from transformers import AutoModelForCausalLM

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    return cfg, {name: t.detach() for name, t in version_tensors(model)}
