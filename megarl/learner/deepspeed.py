"""The DeepSpeed ZeRO learner: any HF causal-LM directory (transformers AutoModelForCausalLM), data
parallel over every learner rank with ZeRO stage 1, 2 or 3, one optimizer step per batch.

Owns: the DeepSpeed engine and its config (ZeRO stage, CPU offload of the optimizer state and, at
stage 3, of the parameters; HF gradient checkpointing; fp32 on CPU, bf16 on GPU), per-token log-probs
from the full-vocabulary logits, the step's gradient accumulation over micro-batches, the frozen
reference model of the KL penalty, where the learned critic (megarl.learner.critic) joins the step, the
HF-named tensors the weight publisher broadcasts (at ZeRO-3 gathered one publish bucket at a time), and
DeepSpeed's own checkpoint of engine and optimizer.
The loss, advantages and metrics are megarl.learner.step's (the megatron learner's too).

Mixture-of-experts models (Mixtral, Qwen3-MoE) train as transformers runs them, every expert data parallel:
transformers 5.x holds a layer's experts fused in memory, so what is published and exported is converted to
the per-expert names save_pretrained writes (megarl.models.moe.per_expert_tensors), and
``algo.routing_replay=r3`` forces the sampler's recorded routes at every router in every forward of the step,
the extra log-prob passes included (megarl.learner.hf_routing_replay).

A model type outside megarl.models.families (the generic path, docs/models.md#the-generic-path) trains as
transformers holds it: published and exported under its named_parameters' names (and a router expert bias buffer's,
e.g. Nemotron-H's), with no route replay and no LoRA.
A hybrid model with recurrent layers (Qwen3-Next, Qwen3.5, Nemotron-H: gated-DeltaNet or Mamba-2 "linear_attention"
layers) trains on unpacked rows whatever learner.pack_sequences says: a recurrence runs through every earlier position
of its row, so rows packed side by side (or sharing a prefix) would leak one sequence's state into the next, which no
mask stops; right padding after a row's tokens reaches none of them.

``learner.lora.rank > 0`` trains a LoRA adapter through peft on the frozen base (megarl.learner.hf_lora): only the
adapter has gradients and Adam state, a version publishes only the adapter (under the names the megatron learner
publishes, which the built-in engine's AdapterStager merges into its own copy of the base), the KL reference is the
base itself (the adapter switched off), and an export writes the merged model plus the PEFT adapter.

Process contract (the megatron learner's): construct it after ``torch.distributed`` is initialised
with a default process group that contains ONLY the learner ranks (world size = learner.dp). Every
learner rank receives the same whole ``TrainBatch`` and trains its contiguous share of the rows.
docs/learner.md#deepspeed describes the loss scaling, the publish buckets and the memory per stage.
"""
from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from megarl.algo import metrics as algo_metrics
from megarl.algo.config import CriticConfig, DistillConfig, LossConfig
from megarl.config.schema import LearnerConfig, LoraConfig
from megarl.distributed.publish import Bucket, plan_buckets
from megarl.learner import hf_lora, packing, step
from megarl.learner.hf_routing_replay import HFRouteReplayer
from megarl.learner.lr_schedule import lr_at
from megarl.models import families, lora, moe
from megarl.models.families import generic_path_hint, is_native
from megarl.protocols import TrainBatch

CHECKPOINT_TAG = "deepspeed"  # the sub-directory DeepSpeed's save_checkpoint writes in a megarl step dir


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Blocks that are layers of their own in Nemotron-H's `layers_block_type` and carry nothing across positions.
STATELESS_LAYER_TYPES = ("mlp", "moe")


def has_recurrent_layers(hf_config: dict) -> bool:
    """Whether the model has layers with recurrent state: a transformers `layer_types` entry (Nemotron-H's config.json
    calls it `layers_block_type`) that is neither attention nor a stateless block (Qwen3-Next's, Qwen3.5's and
    Nemotron-H's "linear_attention": gated DeltaNet, Mamba-2; a VLM's text model's too)."""
    text = hf_config.get("text_config") or hf_config
    kinds = text.get("layer_types") or text.get("layers_block_type") or []
    return any(t not in ATTENTION_LAYER_TYPES + STATELESS_LAYER_TYPES for t in kinds)


def deepspeed_config(cfg: LearnerConfig, on_gpu: bool, with_optimizer: bool = True) -> dict:
    """The DeepSpeed config dict of `cfg` (pure).

    managed_gradient_accumulation=False: the caller owns the boundary, so a step may have any number
    of micro-batches (token-budget micro-batches vary from step to step) and `step()` is the one
    optimizer update.  torch_adam on CPU: DeepSpeed's fused / CPU Adam would JIT-compile an op.
    """
    ds = cfg.deepspeed
    zero: dict = {"stage": ds.zero_stage,
                  # Unmanaged accumulation supports overlapped reduction only at stage 2.
                  "overlap_comm": ds.zero_stage == 2}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    config = {
        "train_micro_batch_size_per_gpu": 1,  # bookkeeping only: micro-batches are megarl's
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "zero_optimization": zero,
        "gradient_clipping": cfg.grad_clip,
        "steps_per_print": 2**31 - 1,  # megarl logs the metrics
        "wall_clock_breakdown": False,
        # bf16 with the overflow check, so a non-finite gradient skips the step as it does in fp32.
        "bf16": {"enabled": on_gpu, "check_grad_overflow": True},
    }
    if with_optimizer:
        # AdamW: megatron's adam is decoupled weight decay too.
        config["optimizer"] = {"type": "AdamW", "params": {
            "lr": cfg.lr, "betas": [cfg.adam_beta1, cfg.adam_beta2], "eps": cfg.adam_eps,
            "weight_decay": cfg.weight_decay, "torch_adam": not on_gpu}}
    return config


def _skip_shm_comm_build() -> None:
    """On CPU DeepSpeed's comm backend JIT-compiles a shared-memory all-reduce op (~60-80 s with g++ on
    a fresh machine) that only its inference path (inference_all_reduce) uses; ZeRO training reduces
    over gloo. Marking the op incompatible in DeepSpeed's own (mutable, cached) table skips the build."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


@contextmanager
def _launcher_world_is_learner_group():
    """WORLD_SIZE = the learner group's size while DeepSpeed builds an engine. zero.Init refuses a
    single-rank group when the launcher's WORLD_SIZE is larger (its guard against a size-1 group made
    by accident); megarl's learner group is the learner ranks only on purpose, while WORLD_SIZE counts
    the sampler ranks too (learner.dp=1 with one sampler: a group of 1 in a world of 2)."""
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())
    try:
        yield
    finally:
        if saved is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = saved


class _AdapterDisabled:
    """The policy engine with its LoRA adapter switched off (peft's disable_adapter), called like a model: the
    frozen base, the KL penalty's reference under learner.lora."""

    def __init__(self, engine):
        self.engine = engine

    def eval(self):
        self.engine.eval()
        return self

    def __call__(self, **inputs):
        with self.engine.module.disable_adapter():
            return self.engine(**inputs)


class DeepSpeedLearner:
    def __init__(self, model_dir: str, cfg: LearnerConfig, loss_cfg: LossConfig, temperature: float = 1.0,
                 publish_bucket_mb: float = 16.0, routing_replay: str = "off",
                 distill: DistillConfig | None = None, critic_cfg: CriticConfig | None = None):
        try:
            import deepspeed
        except ImportError as exc:
            raise ImportError("learner.backend=deepspeed needs DeepSpeed: `pip install -e \".[cpu]\"` installs it "
                              "on CPU; on GPU install the DeepSpeed built for your CUDA (`pip install deepspeed`)") from exc
        from transformers import AutoModelForCausalLM

        if not dist.is_initialized():
            raise RuntimeError("DeepSpeedLearner needs torch.distributed initialised over the learner ranks")
        if (cfg.tp, cfg.pp, cfg.cp) != (1, 1, 1) or cfg.dp != dist.get_world_size():
            raise ValueError(f"learner.backend=deepspeed is data parallel only: tp={cfg.tp} pp={cfg.pp} cp={cfg.cp} "
                             f"dp={cfg.dp} for a learner world of {dist.get_world_size()} (needs tp=pp=cp=1, dp=world; "
                             f"context parallelism is the megatron learner's)")
        self.cfg, self.loss_cfg, self.temperature = cfg, loss_cfg, temperature
        self.bucket_bytes = int(publish_bucket_mb * 2**20)
        self._version = 0
        self.on_gpu = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")
        if not self.on_gpu:
            torch.set_num_threads(cfg.threads)
            _skip_shm_comm_build()
        # Wraps the learner group torch already has (on GPU "cpu:gloo,cuda:nccl": DeepSpeed names it nccl).
        deepspeed.init_distributed(dist_backend="nccl" if "nccl" in dist.get_backend() else dist.get_backend())
        torch.manual_seed(cfg.seed)
        self.zero_stage = cfg.deepspeed.zero_stage
        with open(os.path.join(model_dir, "config.json")) as f:
            self.hf_config = json.load(f)
        # A model type outside megarl's families trains as transformers loads it (the generic path,
        # docs/models.md#the-generic-path): every parameter under its in-memory name, no route replay.
        self.generic = not is_native(self.hf_config)
        self.is_moe = not self.generic and moe.is_moe(self.hf_config)
        # transformers applies its sliding windows itself, except to the ready masks of packed rows (`_logits`):
        # one mask per layer type where the layers' windows differ (Gemma 3, gpt-oss: families.layer_types, with
        # transformers' defaults where config.json has none)
        self.windows = (families.generic_attention_windows(self.hf_config) if self.generic
                        else families.windows_by_layer_type(self.hf_config))
        self.recurrent = has_recurrent_layers(self.hf_config)
        if self.is_moe:
            moe.check_moe(self.hf_config)
        elif routing_replay == "r3" and self.generic:
            raise ValueError(f"algo.routing_replay=r3: model_type {self.hf_config.get('model_type')!r} runs on the "
                             f"generic path, which records no routes ({generic_path_hint()})")
        elif routing_replay == "r3":
            raise ValueError(f"algo.routing_replay=r3 needs a mixture-of-experts model; "
                             f"{self.hf_config.get('model_type')!r} is dense")
        replay = routing_replay == "r3"
        self.lora = cfg.lora if cfg.lora.rank > 0 else None
        dtype = torch.bfloat16 if self.on_gpu else torch.float32

        def load():
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
            model.config.use_cache = False
            return model

        model = load()
        self._replayers = {}  # id(model passed to _logits) -> its HFRouteReplayer (MoE models)
        if self.is_moe:
            replayer = HFRouteReplayer(model, self.hf_config, replay)
        if cfg.recompute_activations == "full":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora is not None:  # the base frozen where it was loaded; only the adapter reaches the optimizer
            model = hf_lora.wrap(model, self.hf_config, self.lora)
        with _launcher_world_is_learner_group():
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                config=deepspeed_config(cfg, self.on_gpu))
        if self.is_moe:
            self._replayers[id(self.engine)] = replayer
        # KL penalty: a frozen copy of the initial weights (docs/learner.md#deepspeed): partitioned like
        # the policy at stage 3 (an engine without optimizer), a plain replica below.
        self.ref_model = None
        if loss_cfg.kl_coef > 0 and self.lora is not None:
            # The base is the initial policy (B starts at zero) and is frozen: the adapter switched off is the
            # reference, with no second copy of the base.
            self.ref_model = _AdapterDisabled(self.engine)
        elif loss_cfg.kl_coef > 0:
            ref = load().requires_grad_(False).eval()
            ref_replayer = HFRouteReplayer(ref, self.hf_config, replay) if self.is_moe else None
            if self.zero_stage == 3:
                with _launcher_world_is_learner_group():
                    ref = deepspeed.initialize(model=ref, config=deepspeed_config(cfg, self.on_gpu, with_optimizer=False))[0]
            self.ref_model = ref.to(self.device) if self.zero_stage < 3 else ref
            self.ref_model.eval()
            if ref_replayer is not None:
                self._replayers[id(self.ref_model)] = ref_replayer
        self.distill, self.teacher = distill, None  # on-policy distillation's frozen teacher
        if distill is not None:
            from megarl.learner.teacher import Teacher

            self.teacher = Teacher(distill.teacher, self.device, temperature)
        # advantage.estimator=gae: the same critic as the megatron learner's (megarl.learner.critic), replicated on
        # every learner rank with its own torch AdamW, outside ZeRO; the learner group is its DP group.
        self.critic = None
        if critic_cfg is not None:
            from megarl.learner.critic import Critic

            self.critic = Critic(critic_cfg, model_dir, self.device, None, cfg.dp)

    @property
    def version(self) -> int:
        return self._version

    @property
    def module(self):
        """The HF model inside the engine (parameters named as in the HF checkpoint; under learner.lora the peft
        model around it, whose keys megarl.learner.hf_lora translates)."""
        return self.engine.module

    # ------------------------------------------------------------------ forward

    def _logits(self, model, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits [B', S', V] of what the model runs on (packing.model_input_ids); an MoE model's routers are fed
        its routes first (replay). A packed micro-batch (megarl.learner.packing) runs as its packed rows, each row
        with its own position ids and a 4D mask keeping it to itself."""
        replayer = self._replayers.get(id(model))
        ids = packing.model_input_ids(mb).to(self.device)
        if replayer is not None:
            replayer.before_forward(ids, packing.model_routes(mb))
        if "unpack_index" not in mb:
            return model(input_ids=ids, use_cache=False).logits
        masks = {kind: packing.additive_attention_mask(mb, self.module.dtype, self.device, window)
                 for kind, window in (self.windows or {"": None}).items()}
        mask = masks.pop("") if "" in masks else masks  # one mask, or one per layer type (Gemma 3's local/global)
        return model(input_ids=ids, position_ids=mb["packed_positions"].to(self.device), attention_mask=mask,
                     use_cache=False).logits

    def _row_logprobs(self, logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, S] log-probs of the micro-batch's rows from `_logits` (packed: computed on the packed positions,
        read per row token)."""
        return step.row_logprobs(logits, mb, self.temperature)

    def _aligned(self, micro: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """The micro-batches, padded to the most any DP rank has: ZeRO gathers parameters in every forward
        (stage 3) and reduces gradients in every backward (2, 3), so all ranks run the same count. A padding
        micro-batch is a one-row copy with nothing trained (loss 0, gradient 0, no statistics)."""
        count = torch.tensor([len(micro)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        pad = {k: v[:1].clone() for k, v in packing.unpacked(micro[-1]).items()}
        pad["mask"] = torch.zeros_like(pad["mask"])
        return micro + [pad] * (int(count) - len(micro))

    @torch.no_grad()
    def _forward_logprobs(self, model, micro: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Per-token log-probs (fp32, CPU) of `model` on each micro-batch's input_ids (with its `routes`
        replayed under routing replay), forward only: the same micro-batch shapes as the training pass, so
        identical weights give identical log-probs."""
        return [self._row_logprobs(self._logits(model, mb), mb).cpu() for mb in micro]

    def logprobs(self, input_ids: torch.Tensor, routes: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token log-probs [B, S] (fp32, CPU) of the whole batch under the current weights (every
        rank the whole batch, in the same micro-batches: collective at stage 3; routes [B, S, L, k]:
        replayed under algo.routing_replay=r3)."""
        self.engine.eval()
        rows = torch.arange(input_ids.shape[0]).split(self.cfg.micro_batch_size)
        return torch.cat(self._forward_logprobs(self.engine, [
            {"input_ids": input_ids[idx], **({"routes": routes[idx]} if routes is not None else {})}
            for idx in rows]))

    # ------------------------------------------------------------------ the step

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Exactly one optimizer step over the whole batch; skipped if loss or grad norm is not finite."""
        start = time.perf_counter()
        dp, dp_rank = self.cfg.dp, dist.get_rank()
        totals = step.batch_totals(batch)
        fields = step.dp_share(batch, dp, dp_rank)
        real = step.micro_batches(fields, self.cfg.micro_batch_size, self.cfg.micro_batch_tokens,
                                  pack=self.cfg.pack_sequences and not self.recurrent,
                                  share_prefixes=self.cfg.share_prefixes)
        micro = self._aligned(real)
        needs_pi = step.needs_proximal_logprobs(self.loss_cfg, self.critic)
        step.attach_extra_logprobs(micro, {"proximal_logprobs": self.engine if needs_pi else None,
                                           "ref_logprobs": self.ref_model}, self._forward_logprobs)
        if self.critic is not None:  # GAE advantages (replacing the batch's) and value targets of the real rows
            self.critic.prepare(real)
        # Critic warm-up: the policy's loss and metrics from a forward pass only; no backward and no engine step
        # (DeepSpeed has no way to drop reduced ZeRO gradients short of stepping), so its version does not move.
        critic_only = self.critic is not None and self.critic.warming_up
        teacher_s = self.teacher.attach(micro) if self.teacher is not None else None
        self.engine.train()
        stats_list, losses = [], []
        replayer = self._replayers.get(id(self.engine))
        own_routes = [] if replayer is not None and "routes" in micro[0] else None
        for i, mb in enumerate(micro):
            mb = {k: v.to(self.device) for k, v in mb.items()}
            with torch.set_grad_enabled(not critic_only):
                logits = self._logits(self.engine, mb)
            if own_routes is not None and i < len(real):
                own_routes.append(packing.rows_layout(replayer.own_choice(), mb))
            logprobs = self._row_logprobs(logits, mb)
            entropy = step.token_entropy(lambda z: step.position_entropy(z, self.temperature), logits, mb,
                                         self.loss_cfg)
            loss, stats = step.micro_batch_loss(logprobs, mb, batch.learner_version, totals, self.loss_cfg, entropy,
                                                self.distill)
            if i < len(real):
                stats_list.append(stats)
                losses.append(loss.detach())
            # The micro-batch losses (global normalisers) add up to the batch loss over all micro-batches
            # and ranks, so the batch gradient is their plain SUM; DeepSpeed averages gradients over the
            # DP ranks, which the factor dp undoes.
            if not critic_only:
                self.engine.backward(loss * dp, scale_wrt_gas=False)
        lr = lr_at(self._version, self.cfg)
        if not critic_only:
            for group in self.optimizer.param_groups:  # (DeepSpeed runs no scheduler of its own here)
                group["lr"] = lr
            self.engine.step()  # the one optimizer update (ZeRO skips it on a non-finite gradient norm)
        if own_routes is not None:
            matches = [algo_metrics.route_matches(mb["routes"], own) for mb, own in zip(real, own_routes)]
            decisions = moe.num_moe_layers(self.hf_config) * moe.top_k(self.hf_config)
            router = step.router_partials(real, matches, decisions, batch.learner_version, self.loss_cfg)
            stats_list = [{**st, **rp} for st, rp in zip(stats_list, router)]

        loss = torch.stack(losses).sum().double().cpu()
        dist.all_reduce(loss)
        loss = float(loss)
        metrics = {"loss": loss, "lr": lr, "num_tokens": totals[0], **step.position_metrics(fields, real)}
        if critic_only:  # (no backward: no policy gradient norm to report)
            skipped = not math.isfinite(loss)
        else:
            grad_norm = self.engine.get_global_grad_norm()
            metrics["grad_norm"] = grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            skipped = not (math.isfinite(loss) and math.isfinite(grad_norm) and self.engine.was_step_applied())
            if not skipped:
                self._version += 1
        if teacher_s is not None:
            metrics["distill/teacher_s"] = teacher_s
        metrics.update(step.dp_merged_stats(stats_list, dp))
        if self.critic is not None:
            metrics.update(self.critic.train(real, totals[0], batch.learner_version, self.loss_cfg.max_lag_bucket))
        metrics.update(step_time_s=time.perf_counter() - start, skipped_nonfinite=float(skipped))
        return metrics

    # ------------------------------------------------------------------ weights out

    def publish_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named fp32 CPU tensors of the full weights (under learner.lora: of the adapter, see
        _published_parameters), in the HF model's parameter order (tied: the
        embedding once, no lm_head), valid until the next step: below ZeRO-3 the parameters themselves
        when they are fp32 on the CPU (a publisher that sends only its share copies nothing it skips),
        else converted copies. Collective: every learner rank iterates it. At ZeRO-3 they are views into
        `publish_buckets`' flat buffers (contiguous, one bucket's worth per gather). An MoE model's fused
        experts are yielded as views per expert and projection under save_pretrained's names."""
        for name, tensor in self._in_memory_tensors():
            yield from _hf_tensors(self.hf_config, name, tensor)

    def _published_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(published name, parameter) of what a version carries: every HF parameter, or under learner.lora the
        adapter's only, under megarl.models.lora's names in adapter_spec's order (the samplers hold the base)."""
        if self.lora is not None:
            return hf_lora.adapter_parameters(self.module, self.hf_config, self.lora)
        return list(self.module.named_parameters())

    def adapted_base_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """learner.lora: the frozen base of every weight the adapter adapts (peft's ``base_layer`` weights), HF-named,
        whole fp32 CPU tensors in adapter_spec's order (megarl/learner/lora_publish.py keeps them to publish merged
        weights); collective as publish_tensors (ZeRO-3 gathers them a bucket at a time)."""
        yield from self._in_memory_tensors(hf_lora.base_parameters(self.module, self.hf_config, self.lora))

    def _in_memory_tensors(self, named: list[tuple[str, torch.nn.Parameter]] | None = None
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """publish_tensors before an MoE model's fused experts are split into save_pretrained's names (or the
        tensors of other `named` parameters)."""
        buffers = self._published_buffers() if named is None else []
        named = self._published_parameters() if named is None else named
        if self.zero_stage < 3:
            for name, param in named:
                yield name, param.detach().to(device="cpu", dtype=torch.float32)
        else:
            for bucket, flat in self.publish_buckets(named):
                for slot in bucket.slots:
                    yield slot.name, flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
        for name, buffer in buffers:
            yield name, buffer.detach().to(device="cpu", dtype=torch.float32)

    def _published_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The buffers a version carries besides its parameters: a sigmoid-routed MoE's router expert bias
        (DeepSeek-V3's, GLM-4.5's, on the generic path Nemotron-H's ``e_score_correction_bias``, a buffer in
        transformers, saved with the weights and read by the engines' routers; never trained, whole on every rank at
        every ZeRO stage); none under learner.lora (the samplers hold the base)."""
        if self.lora is not None:
            return []
        return [(name, b) for name, b in self.module.named_buffers() if name.endswith(moe.EXPERT_BIAS[0])]

    def publish_spec(self, shards: bool = False) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """What publish_tensors yields (TP = 1: shards are the same); ZeRO-3 parameters' full shapes."""
        return [(hf_name, tuple(t.shape), torch.float32)
                for name, p in self._published_parameters()
                for hf_name, t in _hf_tensors(self.hf_config, name, torch.empty(
                    tuple(getattr(p, "ds_shape", p.shape)), device="meta"))] + [
            (name, tuple(b.shape), torch.float32) for name, b in self._published_buffers()]

    def publish_buckets(self, named: list[tuple[str, torch.nn.Parameter]] | None = None
                        ) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """ZeRO-3: the weight publisher's own bucket plan over `publish.bucket_mb` (megarl.distributed.
        publish.plan_buckets), each bucket's parameters gathered with ONE GatheredParameters over all of
        them and copied straight into a fresh flat fp32 CPU buffer; the device holds at most one gathered
        bucket beyond its partition. Collective over the learner ranks. `named`: other (name, parameter)s than
        what a version publishes."""
        import deepspeed

        named = self._published_parameters() if named is None else named
        params = dict(named)
        spec = [(name, tuple(p.ds_shape), torch.float32) for name, p in named]
        for bucket in plan_buckets(spec, self.bucket_bytes):
            flat = torch.empty(bucket.numel, dtype=torch.float32)
            with deepspeed.zero.GatheredParameters([params[slot.name] for slot in bucket.slots]):
                for slot in bucket.slots:
                    flat[slot.offset:slot.offset + slot.numel].copy_(params[slot.name].detach().reshape(-1))
            yield bucket, flat

    def publish_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """TP = 1: this rank's 'slices' are the whole tensors."""
        yield from self.publish_tensors()

    # ------------------------------------------------------------------ checkpoint state (megarl/checkpoint)

    def save_shards(self, directory: Path) -> None:
        """DeepSpeed's checkpoint (module, ZeRO-partitioned optimizer state and step) under
        `directory`/CHECKPOINT_TAG; collective. megarl's storage makes the step directory atomic."""
        self.engine.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, save_latest=False)

    def load_shards(self, directory: Path, version: int, with_optimizer: bool) -> None:
        """Weights (and, after a first step, Adam moments and step) from `save_shards`; lr, betas and
        weight decay stay this run's config. Collective; the same dp and zero_stage as the save."""
        hyper = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in self.optimizer.param_groups]
        path, _ = self.engine.load_checkpoint(str(directory), tag=CHECKPOINT_TAG, load_module_strict=True,
                                              load_optimizer_states=with_optimizer, load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {directory / CHECKPOINT_TAG}")
        for group, own in zip(self.optimizer.param_groups, hyper):
            group.update(own)
        self._version = version


def checkpoint_hf_tensors(checkpoint: Path, hf_config: dict, lora_layout: dict | None = None,
                          adapter_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The full fp32 weights of a `save_shards` checkpoint as (HF name, tensor), merged from the ZeRO
    partitions of every rank one tensor at a time (DeepSpeed's zero_to_fp32, lazy mode; no process
    group). Tied embeddings: the embedding only, as HF saves it. A LoRA checkpoint (`lora_layout`: the
    manifest's layout["lora"]) gives the base with its adapter merged (W + alpha / r * B @ A), or with
    `adapter_only` the adapter alone under megarl.models.lora's names (in adapter_spec's order)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=CHECKPOINT_TAG, lazy_mode=True)
    if lora_layout is not None:
        yield from _lora_checkpoint_tensors(checkpoint, state, hf_config, lora_layout, adapter_only)
    else:
        yield from _hf_named(state, hf_config)


def _hf_tensors(hf_config: dict, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of one in-memory parameter: a family's fused experts split into save_pretrained's
    per-expert names (megarl.models.moe); on the generic path the parameter as transformers holds it."""
    if is_native(hf_config):
        yield from moe.per_expert_tensors(hf_config, name, tensor)
    else:
        yield name, tensor


def _hf_named(state: dict, hf_config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's HF-keyed (lazy) tensors as save_pretrained writes them: a tied lm_head dropped, an MoE
    model's fused experts (one tensor per layer in memory) as per-expert ones."""
    tied = hf_config.get("tie_word_embeddings", False)
    for name, lazy in state.items():
        if not (tied and name == "lm_head.weight"):
            for hf_name, tensor in _hf_tensors(hf_config, name, lazy.contiguous()):
                yield hf_name, tensor.contiguous()


def _lora_checkpoint_tensors(checkpoint: Path, state: dict, hf_config: dict, lora_layout: dict,
                             adapter_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """checkpoint_hf_tensors of a peft model's checkpoint. zero_to_fp32 holds the adapter (the optimizer's fp32
    partitions) and, from ZeRO-2 on, the frozen base (DeepSpeed saves frozen parameters' fragments only when it
    partitions gradients); at ZeRO-1 the base comes from the module state, which DeepSpeed saves whole below
    ZeRO-3 (in the module's parameter order, which the export keeps)."""
    lora_cfg = LoraConfig(**lora_layout)
    if adapter_only:
        adapter = hf_lora.split_state(state)[1]
        for name, _, _ in lora.adapter_spec(hf_config, lora_cfg):
            yield name, adapter[name].contiguous()
        return
    module_file = Path(checkpoint) / CHECKPOINT_TAG / "mp_rank_00_model_states.pt"  # (below ZeRO-3 only)
    module = torch.load(module_file, map_location="cpu", mmap=True, weights_only=True)["module"] \
        if module_file.is_file() else {}
    base, adapter = hf_lora.split_state({k: state[k] if k in state else module[k]
                                         for k in [*module, *(k for k in state if k not in module)]})
    factor = lora.scale(lora_cfg)
    for name, tensor in _hf_named(base, hf_config):
        a_name = name[:-len(".weight")] + ".lora_A.weight"
        if a_name in adapter:
            b_name = a_name[:-len("lora_A.weight")] + "lora_B.weight"
            tensor = lora.merge({name: tensor}, {a_name: adapter[a_name].contiguous(),
                                                 b_name: adapter[b_name].contiguous()}, factor)[name]
        yield name, tensor
