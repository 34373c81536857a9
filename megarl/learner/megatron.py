"""The megatron-core learner: a GPTModel (local layer spec) trained with one optimizer step per batch.

Owns: building the TP/PP/DP model-parallel state over the learner ranks, loading an HF-format model
directory into a megatron ``GPTModel`` (through megarl.models.convert), megatron DDP + optimizer,
per-token log-probs through vocab-parallel cross-entropy, the policy-gradient step (loss from
megarl.algo.losses), the frozen reference model for the KL penalty (when loss.kl_coef > 0) and the
HF-named tensors the weight publisher broadcasts (whole, or each TP rank's slices for a direct
shard-to-shard publish: megarl.models.tp_shard).

Mixture-of-experts models (Mixtral, Qwen3-MoE: megarl.models.moe) train with megatron's MoE layer
(SequentialMLP experts, alltoall dispatcher) and expert parallelism ``learner.ep``: each EP rank holds
E / ep whole experts, carved out of the TP x CP x DP ranks (megatron's expert_model_parallel_size, with an expert
TP size of 1), and the published / exported tensors gather every expert. At ``learner.tp > 1`` they train
with megatron's sequence parallelism (megarl.learner.sequence_parallel). ``algo.routing_replay=r3`` forces
the sampler's recorded routes in every forward of the step (megarl.learner.routing_replay). Context parallelism
``learner.cp`` splits each (packed) row's positions over the ranks of a CP group (megarl.learner.context_parallel);
an MoE layer's routers then route, or under r3 replay the recorded routes of, the positions their CP rank holds.
Qwen3.5 text's hybrid layers (megatron-core's GatedDeltaNet beside gated full attention: megarl.learner.hybrid) train
on unpacked rows, one sequence per row.

Process contract: construct it after ``torch.distributed`` is initialised with a default process
group that contains ONLY the learner ranks (world size = tp * pp * cp * dp).  Every learner rank receives
the same, whole ``TrainBatch``; each DP rank trains on its contiguous share of the rows, each CP rank of it on its
share of those rows' positions.  On CPU the
model is fp32 with gloo and the shims of megarl.learner.cpu_shims; on GPU bf16 with fp32 main weights.
docs/learner.md explains the loss scaling and the publish layout.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Iterator

import torch
import torch.distributed as dist

from megarl.algo.config import CriticConfig, DistillConfig, LossConfig
from megarl.config.schema import LearnerConfig
from megarl.learner import context_parallel, packing, plain_linear, rotary_positions, sequence_parallel, step
from megarl.learner.lr_schedule import lr_at
from megarl.learner.routing_replay import RouteReplayer
from megarl.models import convert, families, gated_delta_net, moe
from megarl.protocols import TrainBatch


def import_framework() -> None:
    """megatron-core's modules MegatronLearner builds from, imported as it imports them (deferred_compile)."""
    from megarl.learner.deferred_compile import deferred_compile

    with deferred_compile():
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.optimizer  # noqa: F401


class MegatronLearner:
    def __init__(self, model_dir: str, cfg: LearnerConfig, loss_cfg: LossConfig,
                 temperature: float = 1.0, routing_replay: str = "off", critic_cfg: CriticConfig | None = None,
                 distill: DistillConfig | None = None):
        # megatron is imported here, not at module top: importing it costs seconds and the package's
        # other roles never need it; its torch.compile decorations compile (and import dynamo) at first call.
        from megarl.learner.deferred_compile import deferred_compile
        from megarl.learner.layer_spec import layer_spec

        with deferred_compile():
            from megatron.core import parallel_state, tensor_parallel
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.distributed import finalize_model_grads
            from megatron.core.models.gpt import GPTModel
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
            from megatron.core.transformer import MLATransformerConfig, TransformerConfig
            from megatron.core.transformer.module import Float16Module
            from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        if not dist.is_initialized():
            raise RuntimeError("MegatronLearner needs torch.distributed initialised over the learner ranks")
        if cfg.tp * cfg.pp * cfg.cp * cfg.dp != dist.get_world_size():
            raise ValueError(f"learner tp*pp*cp*dp = {cfg.tp}*{cfg.pp}*{cfg.cp}*{cfg.dp} != learner world size "
                             f"{dist.get_world_size()}")
        self.cfg, self.loss_cfg, self.temperature = cfg, loss_cfg, temperature
        self._version = 0
        self._publish_specs: dict[bool, list] = {}  # publish_spec(shards): worked out at the first publish
        self.on_gpu = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")
        if not self.on_gpu:
            from megarl.learner.cpu_shims import apply_cpu_shims

            torch.set_num_threads(cfg.threads)
            apply_cpu_shims()

        self.ps, self.tensor_parallel = parallel_state, tensor_parallel
        # Experts are never TP-split (expert_tensor_parallel_size=1): each TP rank runs whole experts on its own
        # sequence-parallel tokens (megarl.learner.sequence_parallel), so EP ranks come out of TP x DP.
        # Context parallelism: megatron's CP groups (its DDP reduces gradients over data x context parallel ranks),
        # attention carried by megarl's (megarl.learner.context_parallel); TransformerConfig keeps
        # context_parallel_size 1, which megatron's own attention would otherwise refuse without Transformer Engine.
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(cfg.tp, cfg.pp, context_parallel_size=cfg.cp,
                                                     expert_model_parallel_size=cfg.ep, expert_tensor_parallel_size=1)
        elif (parallel_state.get_tensor_model_parallel_world_size(),
              parallel_state.get_pipeline_model_parallel_world_size(),
              parallel_state.get_context_parallel_world_size(),
              parallel_state.get_expert_model_parallel_world_size(),
              parallel_state.get_expert_tensor_parallel_world_size()) != (cfg.tp, cfg.pp, cfg.cp, cfg.ep, 1):
            raise RuntimeError("megatron parallel_state is already initialised with another tp/pp/cp/ep")
        torch.manual_seed(cfg.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)

        with open(os.path.join(model_dir, "config.json")) as f:
            self.hf_config = convert.check_supported(json.load(f))
        self.is_moe = moe.is_moe(self.hf_config)
        # Gated-DeltaNet layers (Qwen3.5: megarl.learner.hybrid) run one sequence per row: megatron's module refuses
        # packed rows, and a recurrence would carry one sequence's state into the next.
        self.recurrent = families.family_of(self.hf_config).linear_attention
        if self.recurrent:
            check_recurrent(cfg, routing_replay)
            from megarl.learner.cpu_shims import apply_gated_delta_net_shims
            from megarl.learner.gated_delta_net import use_torch_path_without_fla

            if self.on_gpu:
                use_torch_path_without_fla()
            else:
                apply_gated_delta_net_shims()
        # A sliding window is part of the masks the core attention builds from the attention layout
        # (megarl.learner.packing): it counts position ids, which a packed row's columns are not. Layers with windows
        # of their own (Gemma 3, gpt-oss: families.layer_types) each get their own
        # (megarl.learner.sdpa_attention.use_layer_windows).
        self.windows, self.mask_index = families.mask_windows(self.hf_config)
        # megatron trains an MoE layer under TP only with sequence parallelism (megarl.learner.sequence_parallel);
        # dense models keep plain TP.
        self.sequence_parallel = self.is_moe and cfg.tp > 1
        if routing_replay == "r3" and not self.is_moe:
            raise ValueError(f"algo.routing_replay=r3 needs a mixture-of-experts model; "
                             f"{self.hf_config['model_type']!r} is dense")
        dtype = torch.bfloat16 if self.on_gpu else torch.float32
        model_kwargs = convert.transformer_config_kwargs(self.hf_config)
        # (multi-latent attention, DeepSeek-V3's: megatron's MLA reads its dims from the MLA config class)
        config_class = MLATransformerConfig if model_kwargs.get("multi_latent_attention") else TransformerConfig
        self.config = config_class(
            tensor_model_parallel_size=cfg.tp,
            pipeline_model_parallel_size=cfg.pp,
            params_dtype=dtype, pipeline_dtype=dtype, bf16=self.on_gpu,
            # Micro-batches keep their own trimmed (rows, length) shape, so at PP>1 the stages
            # exchange each activation's shape before it (one tiny message per p2p transfer).
            variable_seq_lengths=cfg.pp > 1,
            # (config validation refuses variable lengths with the default MoE dispatcher even for a
            # dense model; the dense layers never use it)
            **{"moe_token_dispatcher_type": "alltoall", **model_kwargs},
            expert_model_parallel_size=cfg.ep, expert_tensor_parallel_size=1,
            sequence_parallel=self.sequence_parallel,
            moe_enable_routing_replay=self.is_moe,
            **_recompute_kwargs(cfg.recompute_activations),
            use_cpu_initialization=True,
            perform_initialization=False,  # every weight is loaded from the HF checkpoint below
        )
        self.pre_process = parallel_state.is_pipeline_first_stage()
        self.post_process = parallel_state.is_pipeline_last_stage()
        self.layer_offset = get_transformer_layer_offset(self.config)
        # A sample's routes hold one entry per MoE layer: this stage's first MoE layer's is route_offset (the
        # layers before it less the model's first dense ones, GLM-4.5's)
        self.route_offset = max(0, self.layer_offset - moe.first_dense_layers(self.hf_config))
        # An EP rank's local expert j is global expert expert_offset + j (megatron's contiguous split).
        self.expert_offset = (parallel_state.get_expert_model_parallel_rank() * moe.num_experts(self.hf_config)
                              // cfg.ep if self.is_moe else 0)
        hf_weights = convert.hf_to_mcore(convert.load_pretrained(model_dir)[1], self.hf_config)  # single or sharded

        # parameter name -> TP-split dim (None: replicated), filled by _tp_slice: the model's weights (the KL
        # reference's are the same names) and the LoRA adapters'
        self._tp_dim: dict[str, int | None] = {}

        spec = layer_spec(self.hf_config, self.config, self.sequence_parallel)  # megarl.learner.layer_spec
        from megarl.learner.expert_bias import copy_expert_outputs
        from megarl.learner.sdpa_attention import use_layer_windows

        def build():  # this rank's shard of the HF model, as a GPTModel (Float16Module-wrapped on GPU)
            gpt = GPTModel(
                config=self.config,
                transformer_layer_spec=spec,
                pre_process=self.pre_process, post_process=self.post_process,
                **convert.gpt_model_kwargs(self.hf_config),
            )
            self._load_hf_weights(gpt, hf_weights)
            plain_linear.use_plain_linears(gpt, cfg.tp)
            rotary_positions.use_frequencies(gpt, convert.inv_freq(self.hf_config))
            rotary_positions.use_position_ids(gpt)
            rotary_positions.skip_layers(gpt, families.rope_layers(self.hf_config))
            use_layer_windows(gpt, self.windows, self.mask_index)
            if families.family_of(self.hf_config).gemma:
                from megarl.learner import gemma3

                gemma3.scale_embeddings(gpt, self.hf_config["hidden_size"])
                gemma3.use_layer_rope(gpt, families.layer_types(self.hf_config),
                                      convert.local_inv_freq(self.hf_config))
            copy_expert_outputs(gpt)  # (biased experts without expert parallelism: megarl.learner.expert_bias)
            if families.family_of(self.hf_config).latent_attention:  # (DeepSeek-V3: each layer's own rotary embedding)
                attention_factor = convert.rope_attention_factor(convert.rope_scaling(self.hf_config))
                rotary_positions.use_latent_frequencies(gpt, convert.inv_freq(self.hf_config), attention_factor)
            if self.sequence_parallel:
                sequence_parallel.mark_whole_experts(gpt, cfg.ep)
            gpt = gpt.to(self.device)
            module = Float16Module(self.config, gpt) if self.on_gpu else gpt
            # (Float16Module casts buffers too: GLM-4.5's expert bias routes in fp32, as HF keeps it)
            for name, buf in _weights(gpt).items():
                if name.endswith("." + moe.EXPERT_BIAS[1]):
                    buf.data = hf_weights[self._global_name(name)].to(device=buf.device, dtype=torch.float32)
            return gpt, module

        self.gpt, module = build()
        # learner.lora: the base is frozen where it was loaded; only the adapters train (megarl/learner/lora.py).
        self.lora = cfg.lora if cfg.lora.rank > 0 else None
        if self.lora is not None:
            from megarl.learner import lora as lora_adapters
            from megarl.models import lora as lora_names

            lora_names.check(self.hf_config, self.lora)
            lora_adapters.attach(self.gpt, self.hf_config, self.lora, self.layer_offset, cfg.seed, cfg.tp,
                                 self._tp_slice, self.sequence_parallel)
        replay = routing_replay == "r3"
        # (sequence parallelism: each TP rank's routers see its slice of the positions)
        seq_group = parallel_state.get_tensor_model_parallel_group() if self.sequence_parallel else None
        self._replayers = {}  # id(model passed to _run) -> its RouteReplayer (MoE models)
        # KL penalty: a frozen copy of the initial weights, same sharding, no grads, no optimizer
        # state, always in eval mode (docs/learner.md: one extra copy of the weights per rank).
        self.ref_model = None
        if loss_cfg.kl_coef > 0:
            ref_gpt, self.ref_model = build()
            self.ref_model.requires_grad_(False).eval()
            if self.is_moe:
                self._replayers[id(self.ref_model)] = RouteReplayer(ref_gpt, self.route_offset, replay, seq_group)
        del hf_weights
        # On-policy distillation: the frozen teacher, where the loss is computed (the last pipeline stage); the CP
        # ranks of a DP rank split its rows.
        self.distill, self.teacher = distill, None
        if distill is not None and self.post_process:
            from megarl.learner.teacher import Teacher

            self.teacher = Teacher(distill.teacher, self.device, temperature,
                                   parallel_state.get_context_parallel_group() if cfg.cp > 1 else None)
        self.model = DistributedDataParallel(
            config=self.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                use_distributed_optimizer=cfg.use_distributed_optimizer,
            ),
            module=module,
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay,
                adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, clip_grad=cfg.grad_clip,
                bf16=self.on_gpu, params_dtype=dtype,
                use_distributed_optimizer=cfg.use_distributed_optimizer,
            ),
            [self.model],
        )
        # On CPU megatron steps torch's AdamW, which there defaults to one chain of small kernels per parameter; its
        # foreach form runs the same arithmetic over all of them at once (GPUs default to it already).
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if type(opt.optimizer) is torch.optim.AdamW:
                for group in opt.optimizer.param_groups:
                    group["foreach"] = True
        if self.is_moe:
            self._replayers[id(self.model)] = RouteReplayer(self.gpt, self.route_offset, replay, seq_group)
        # advantage.estimator=gae: a separate value model with its own optimizer (megarl.learner.critic); the CP
        # ranks of a DP rank split its rows.
        self.critic = None
        if critic_cfg is not None:
            from megarl.learner.critic import Critic

            self.critic = Critic(critic_cfg, model_dir, self.device, parallel_state.get_data_parallel_group(),
                                 parallel_state.get_data_parallel_world_size(),
                                 parallel_state.get_context_parallel_group() if cfg.cp > 1 else None)
        # The schedules run micro-batches under DDP's no_sync and reduce grads once at the end.
        self.config.no_sync_func = self.model.no_sync
        self.config.finalize_model_grads_func = finalize_model_grads
        if self.recurrent:  # (the gated norm's weight: whole on every TP rank, each rank's heads' gradient share)
            from megarl.learner.hybrid import summing_gated_norm_grads

            self.config.finalize_model_grads_func = summing_gated_norm_grads(
                finalize_model_grads, parallel_state.get_tensor_model_parallel_group())

    # ------------------------------------------------------------------ weights in and out

    def _load_hf_weights(self, gpt, full: dict[str, torch.Tensor]) -> None:
        """Load this rank's shard (its PP stage's layers, its TP slice) of the full megatron-named weights."""
        params = _weights(gpt)
        shard = {}
        for name, param in params.items():
            source = self._global_name(name)
            if source == "output_layer.weight" and source not in full:
                source = "embedding.word_embeddings.weight"  # tied embeddings on the last PP stage
            shard[name] = self._tp_slice(name, param, full[source])
        missing, unexpected = gpt.load_state_dict(shard, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"weight loading mismatch: missing={missing} unexpected={unexpected}")

    def _global_name(self, local_name: str) -> str:
        """Megatron name with the PP stage's local layer index (and the EP rank's local expert index)
        replaced by the global one."""
        if not local_name.startswith("decoder.layers."):
            return local_name
        index, rest = local_name[len("decoder.layers."):].split(".", 1)
        return moe.global_expert_name(f"decoder.layers.{int(index) + self.layer_offset}.{rest}", self.expert_offset)

    def _tp_slice(self, name: str, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        # The TP-split dim is the one where the local shape differs from the full one (megatron's
        # partition_dim attribute is only set when megatron initialises the weights itself).
        split = [d for d, (a, b) in enumerate(zip(param.shape, full.shape)) if a != b]
        self._tp_dim[name] = split[0] if split else None
        if not split:
            return full
        rank, dim = self.ps.get_tensor_model_parallel_rank(), split[0]
        # ... and the grad norm needs it to count each TP shard once (not as a TP duplicate).
        if not hasattr(param, "tensor_model_parallel"):
            self.tensor_parallel.set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)
        if _gate_up_rows(name):
            # Fused SwiGLU: each TP rank holds cat[its gate rows, its up rows], not a contiguous slice.
            gate, up = full.chunk(2, dim=0)
            return torch.cat([gate.chunk(self.cfg.tp, 0)[rank], up.chunk(self.cfg.tp, 0)[rank]])
        if _gated_delta_net_part(name, self.recurrent):  # (its fused in_proj and conv: each part split by heads)
            return gated_delta_net.tp_slice(_gated_delta_net_part(name, True), full, self.hf_config, self.cfg.tp,
                                            rank)
        # qkv rows are grouped per query group, so a contiguous slice is whole groups.
        return full.chunk(self.cfg.tp, dim=dim)[rank]

    def _tp_gather(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """Full fp32 tensor of a (possibly TP-sharded) parameter; collective over the TP group."""
        if self._tp_dim[name] is None:
            return _local_copy(param)
        local = param.detach().float()  # gathered where it lives (NCCL on GPU), then moved to the CPU
        parts = [torch.empty_like(local) for _ in range(self.cfg.tp)]
        dist.all_gather(parts, local.contiguous(), group=self.ps.get_tensor_model_parallel_group())
        parts = [p.cpu() for p in parts]
        if _gate_up_rows(name):
            gates, ups = zip(*(p.chunk(2, dim=0) for p in parts))
            return torch.cat(list(gates) + list(ups))
        if _gated_delta_net_part(name, self.recurrent):
            return gated_delta_net.tp_unslice(_gated_delta_net_part(name, True), parts, self.hf_config)
        return torch.cat(parts, dim=self._tp_dim[name])

    def publish_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full fp32 tensors of this PP stage's weights (all of them at PP=1).

        Collective over the TP group (every TP rank must iterate it; all yield the same tensors).
        At PP>1 each stage yields only its own tensors, with global HF layer indices: the first
        stage the embedding, the last the final norm (and lm_head when untied); no rank ever holds
        the whole model.
        """
        if self.lora is not None:  # only the adapter travels (whole: gathered over TP); the samplers hold the base
            yield from self._adapter_tensors(self._tp_gather)
            return
        yield from self._hf_tensors(self._tp_gather, tp_size=1)

    def _adapter_tensors(self, tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's adapter tensors under HF adapter names (megarl.models.lora), built from the whole
        tensor(name, param) of each adapter parameter."""
        from megarl.learner.lora import hf_adapter, layer_adapters

        for i, layer in enumerate(self.gpt.decoder.layers):
            adapters = layer_adapters(layer, lambda name, param: tensor(f"decoder.layers.{i}.{name}", param))
            yield from hf_adapter(adapters, i + self.layer_offset, self.hf_config, self.lora.target_modules).items()

    def publish_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This TP rank's slices of the HF-named fp32 tensors of its PP stage, for a direct publish to
        the same TP rank of samplers with the same TP size: exactly
        ``tp_shard.shard(name, whole, tp, tp_rank)`` of each ``(name, whole)`` publish_tensors yields.

        Every tensor is converted from the local megatron shard, nothing is gathered (megatron's
        vocab-parallel embedding and output layer hold the same vocab rows as the layout), so unlike
        publish_tensors this is not collective. Same PP behaviour as publish_tensors.
        """
        self._check_shards_publishable()
        yield from self._hf_tensors(lambda name, param: _local_copy(param), tp_size=self.cfg.tp)

    def _check_shards_publishable(self) -> None:
        if self.lora is not None:
            raise NotImplementedError("learner.lora publishes whole adapters (sampler.tp = 1)")
        whole = families.whole_tensors_only(self.hf_config)
        if whole:
            raise NotImplementedError(f"{self.hf_config['model_type']}'s {whole} publish whole "
                                      f"tensors: the built-in engine runs it at sampler.tp = 1")
        if self.sequence_parallel:  # (its experts are whole on every TP rank, not tp_shard slices)
            raise NotImplementedError("an MoE model at learner.tp > 1 publishes whole tensors: the built-in engine "
                                      "runs MoE models at sampler.tp = 1")

    def publish_spec(self, shards: bool = False) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """What publish_tensors / publish_shards yield, from the same conversion run on meta tensors of the
        shapes they would have (whole: the TP-split dim times tp); local, nothing is gathered. Worked out once
        (shapes never change; it costs ~2 ms of every step's publish otherwise)."""
        def meta(name: str, param: torch.Tensor) -> torch.Tensor:
            return self._meta(name, param, whole=not shards)

        if shards:
            self._check_shards_publishable()
        if shards not in self._publish_specs:
            tensors = (self._adapter_tensors(meta) if self.lora is not None
                       else self._hf_tensors(meta, tp_size=self.cfg.tp if shards else 1))
            self._publish_specs[shards] = [(name, tuple(t.shape), t.dtype) for name, t in tensors]
        return list(self._publish_specs[shards])

    def _meta(self, name: str, param: torch.Tensor, whole: bool = True) -> torch.Tensor:
        """A meta fp32 tensor of a parameter's whole (TP=1) shape (the TP-split dim times tp), or its local one."""
        shape = list(param.shape)
        if whole and self._tp_dim[name] is not None:
            shape[self._tp_dim[name]] *= self.cfg.tp
        return torch.empty(shape, dtype=torch.float32, device="meta")

    def adapted_base_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """learner.lora: the frozen base of every weight this stage's adapter adapts, HF-named, whole fp32 CPU tensors
        in adapter_spec's order (megarl/learner/lora_publish.py keeps them to publish merged weights). Only the
        adapted linears' weights are gathered (collective over TP, as publish_tensors); the rest of the conversion
        runs on meta tensors."""
        from megarl.learner.lora import adapted_linears
        from megarl.portable.lora_merge import merged_spec

        adapted = tuple(f".{path}.weight" for path in adapted_linears(self.hf_config, self.lora.target_modules))

        def tensor(name: str, param: torch.Tensor) -> torch.Tensor:
            return self._tp_gather(name, param) if name.endswith(adapted) else self._meta(name, param)

        targets = {name for name, _, _ in merged_spec(self.publish_spec())}
        for name, t in self._hf_tensors(tensor, tp_size=1):
            if name in targets:
                yield name, t

    def _hf_tensors(self, megatron_tensor, tp_size: int) -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's HF-named tensors, built from megatron_tensor(name, param) of each parameter: the
        whole tensor (tp_size 1) or this TP rank's shard (tp_size = learner TP)."""
        params = _weights(self.gpt)
        if self.pre_process:
            name = "embedding.word_embeddings.weight"
            yield "model.embed_tokens.weight", megatron_tensor(name, params[name])
        for i in range(len(self.gpt.decoder.layers)):
            prefix = f"decoder.layers.{i}."
            layer = {n[len(prefix):]: megatron_tensor(n, p) for n, p in params.items() if n.startswith(prefix)}
            if self.cfg.ep > 1:
                layer = self._all_experts(layer)
            yield from convert.mcore_layer_to_hf(layer, i + self.layer_offset, self.hf_config, tp_size).items()
        if self.post_process:
            name = "decoder.final_layernorm.weight"
            yield "model.norm.weight", megatron_tensor(name, params[name])
            if not self.hf_config.get("tie_word_embeddings", False):
                yield "lm_head.weight", megatron_tensor("output_layer.weight", params["output_layer.weight"])

    def _all_experts(self, layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One layer's tensors with every EP rank's experts, under global expert indices: gathered over
        the expert-parallel group (collective: every rank of it iterates the publish), or for meta
        tensors (publish_spec) the same shapes without communication."""
        marker = "mlp.experts.local_experts."
        local = {k: v for k, v in layer.items() if k.startswith(marker)}
        out = {k: v for k, v in layer.items() if not k.startswith(marker)}
        per_rank = moe.num_experts(self.hf_config) // self.cfg.ep
        for name in sorted(local):
            j, rest = name[len(marker):].split(".", 1)
            tensor = local[name]
            if tensor.is_meta:
                parts = [tensor] * self.cfg.ep
            else:
                tensor = tensor.to(self.device).contiguous()  # gathered where it lives (NCCL on GPU)
                parts = [torch.empty_like(tensor) for _ in range(self.cfg.ep)]
                dist.all_gather(parts, tensor, group=self.ps.get_expert_model_parallel_group())
                parts = [p.cpu() for p in parts]
            for rank, part in enumerate(parts):
                out[f"{marker}{rank * per_rank + int(j)}.{rest}"] = part
        return out

    # ------------------------------------------------------------------ forward / loss

    @property
    def version(self) -> int:
        return self._version

    def _model_inputs(self, input_ids: torch.Tensor, mb: dict | None = None,
                      columns: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, position_ids, attention layout) of a micro-batch's rows, or of its packed rows (`mb`, whose
        positions take their own rows' position ids and attend to their own paths: megarl.learner.packing),
        widened to input_ids' width (sequence and context parallelism pad it). The layout (packing.attention_layout)
        describes every key position in O(S) numbers; each layer's core attention builds its masks from it, a block
        of queries at a time, with its own window (megarl.learner.sdpa_attention.layout_attention). `columns`: this
        context-parallel rank's columns (megarl.learner.context_parallel): its tokens and position ids; the layout
        describes every CP rank's keys, in the all-gathered order."""
        input_ids = input_ids.to(self.device)
        b, s = input_ids.shape
        keys = None if columns is None else context_parallel.key_columns(s, self.cfg.cp)
        layout = packing.attention_layout(mb, s, self.device, keys)
        if mb is not None:
            positions = mb["packed_positions"]
            positions = torch.nn.functional.pad(positions, (0, s - positions.shape[1])).to(self.device)
        else:
            positions = torch.arange(s, device=self.device).unsqueeze(0).expand(b, s)
        if columns is not None:
            local = columns.to(self.device)
            input_ids, positions = input_ids[:, local], positions[:, local]
        return input_ids, positions, layout

    def _row_logprobs(self, logits: torch.Tensor, mb: dict, cp_layout: tuple | None = None) -> torch.Tensor:
        """[B, S] log-probs of input_ids[:, t] of the micro-batch's rows from logits / T of the position predicting
        it (packed rows: computed on the packed positions, read per row token); column 0 is 0.

        logits are this TP rank's vocab shard [B', S', V/tp]; vocab-parallel cross-entropy does the
        softmax across the shards (it works in place on its input, a fresh tensor here). At TP=1 the whole
        vocabulary is here: plain cross-entropy, without megatron's three all-reduces over a group of one.
        `cp_layout` (columns, padded width): logits of this context-parallel rank's columns only; each rank
        computes the row tokens it predicts and the CP group sums them into every rank's [B, S].
        """
        if cp_layout is not None:
            return self._cp_row_logprobs(logits, mb, *cp_layout)
        if self.cfg.tp == 1:
            return step.row_logprobs(logits, mb, self.temperature)
        if "unpack_index" in mb:  # each row token's predicting position, gathered into the rows' layout
            flat = logits.reshape(-1, logits.shape[-1])
            predicting = flat[packing.predicting_positions(mb, logits.device)]
        else:
            predicting = logits[:, :-1]
        shifted = (predicting.float() / self.temperature).transpose(0, 1).contiguous()
        target = mb["input_ids"][:, 1:].to(logits.device).transpose(0, 1).contiguous()
        nll = self.tensor_parallel.vocab_parallel_cross_entropy(shifted, target)  # [S-1, B]
        return torch.nn.functional.pad(-nll.transpose(0, 1), (1, 0))

    def _cp_row_logprobs(self, logits: torch.Tensor, mb: dict, columns: torch.Tensor, width: int) -> torch.Tensor:
        """`_row_logprobs` of a context-parallel rank's logits [B', W_local, V/tp] at its `columns` of the padded
        `width` (megarl.learner.context_parallel)."""
        mine, index = context_parallel.predicting_local(mb, columns, width, logits.device)
        predicting = logits.reshape(-1, logits.shape[-1])[index].float() / self.temperature  # [N, V/tp]
        target = mb["input_ids"][:, 1:].to(logits.device)[mine]
        if self.cfg.tp == 1:
            own = torch.log_softmax(predicting, dim=-1).gather(-1, target[:, None])[:, 0]
        else:
            own = -self.tensor_parallel.vocab_parallel_cross_entropy(predicting[:, None], target[:, None])[:, 0]
        part = torch.zeros(mine.shape, dtype=own.dtype, device=logits.device).masked_scatter(mine, own)
        rows = context_parallel.sum_parts(part, self.ps.get_context_parallel_group())
        return torch.nn.functional.pad(rows, (1, 0))

    def _cp_rows(self, cp_layout: tuple | None, model_width: int):
        """None, or under context parallelism what turns a rank's per-position values [B', W_local] into the whole
        rows' [B', model_width] (step.token_entropy's `to_rows`)."""
        if cp_layout is None:
            return None
        columns, width = cp_layout
        group = self.ps.get_context_parallel_group()
        return lambda values: context_parallel.positions_to_rows(values, columns, width, group)[:, :model_width]

    def _position_entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """[B', S'] entropy of the predictive distribution at each position (packing.next_token_values reads it
        per row token): over the vocab shards of the TP ranks (the whole vocabulary at TP=1)."""
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        if self.cfg.tp == 1:
            return step.position_entropy(logits, self.temperature)
        group = self.ps.get_tensor_model_parallel_group()
        z = logits.float() / self.temperature
        zmax = z.detach().max(dim=-1, keepdim=True).values
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        e = (z - zmax).exp()
        sum_e = reduce_from_tensor_model_parallel_region(e.sum(-1), group)
        sum_ez = reduce_from_tensor_model_parallel_region((e * z).sum(-1), group)
        return zmax.squeeze(-1) + sum_e.log() - sum_ez / sum_e

    def _run(self, model, micro_batches: list[dict], forward_only: bool, loss_fn,
             own_routes: list | None = None) -> list:
        """Run megatron's schedule for `model` (policy or reference) over the micro-batches.

        loss_fn(logits, mb, cp_layout, width) -> (loss, record), cp_layout: None, or under context parallelism
        (this rank's columns, the padded width) of its logits, width: what the model ran on; the records of the
        last PP stage are returned. For an MoE
        model each micro-batch's routers are fed its `routes` first (replay), and `own_routes`, when
        given, receives per micro-batch the top-k this stage's routers computed themselves.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        replayer = self._replayers.get(id(model))

        multiple = self.cfg.tp if self.sequence_parallel else 1
        cp = self.cfg.cp
        cp_group = self.ps.get_context_parallel_group() if cp > 1 else None

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            # Sequence parallelism splits the positions over TP: the width is padded to a multiple of tp, and the
            # logits (and the routers' own choices) are cut back to the real width before anything reads them.
            # Context parallelism: each CP rank runs its zig-zag columns of the width padded to 2 * cp chunks (each
            # a multiple of tp under sequence parallelism), its routers those columns' routes.
            model_ids = packing.model_input_ids(mb)
            width = model_ids.shape[1]
            ids, routes = sequence_parallel.pad_micro_batch(model_ids, packing.model_routes(mb),
                                                            multiple * (2 * cp if cp > 1 else 1))
            columns = (context_parallel.local_columns(ids.shape[1], cp, self.ps.get_context_parallel_rank())
                       if cp > 1 else None)
            input_ids, position_ids, mask = self._model_inputs(ids, mb if "unpack_index" in mb else None, columns)
            if replayer is not None:
                replayer.before_forward(input_ids, routes if columns is None or routes is None else routes[:, columns])
            output = model(input_ids, position_ids, mask)
            if own_routes is not None and replayer is not None:
                own = replayer.own_choice()
                if columns is not None:  # (gathered where the group communicates: NCCL on GPU)
                    own = context_parallel.positions_to_rows(own.to(self.device), columns, ids.shape[1],
                                                             cp_group).cpu()
                own_routes.append(packing.rows_layout(own[:, :width], mb))
            if columns is None:
                return output, lambda logits: loss_fn(logits[:, :width], mb, None, width)
            return output, lambda logits: loss_fn(logits, mb, (columns, ids.shape[1]), width)

        # With variable_seq_lengths (PP>1) the stages send each shape along; these two only size
        # megatron's default receive shape.
        b = max(packing.model_input_ids(mb).shape[0] for mb in micro_batches)
        s = max(-(-packing.model_input_ids(mb).shape[1] // multiple) * multiple for mb in micro_batches)
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
                num_microbatches=len(micro_batches), seq_length=s, micro_batch_size=b,
                forward_only=forward_only,
            )
        finally:
            if replayer is not None:
                replayer.clear()

    def _router_partials(self, micro_batches: list[dict], own_routes: list, learner_version: int) -> list[dict]:
        """Per micro-batch, the router-agreement partials (megarl.algo.metrics.router_partials) of its
        trained tokens: the sampler's recorded routes against the top-k the learner's routers computed
        themselves, every pipeline stage counting its own layers (summed over the PP group)."""
        from megarl.algo import metrics

        lo = self.route_offset
        matches = [metrics.route_matches(mb["routes"][:, :, lo:lo + own.shape[2]], own)
                   for mb, own in zip(micro_batches, own_routes)]
        if self.cfg.pp > 1:
            flat = torch.cat([m.reshape(-1) for m in matches])
            dist.all_reduce(flat, group=self.ps.get_pipeline_model_parallel_group())
            matches = list(flat.split([m.numel() for m in matches]))
            matches = [m.reshape(mb["input_ids"].shape) for m, mb in zip(matches, micro_batches)]
        decisions = moe.num_moe_layers(self.hf_config) * moe.top_k(self.hf_config)
        return step.router_partials(micro_batches, matches, decisions, learner_version, self.loss_cfg)

    def _last_stage_rank(self) -> int:
        group = self.ps.get_pipeline_model_parallel_group()
        return dist.get_global_rank(group, self.ps.get_pipeline_model_parallel_world_size() - 1)

    def _broadcast_from_last_stage(self, tensor: torch.Tensor | None, shape) -> torch.Tensor:
        if tensor is None:
            tensor = torch.empty(shape, dtype=torch.float32, device=self.device)
        dist.broadcast(tensor, src=self._last_stage_rank(), group=self.ps.get_pipeline_model_parallel_group())
        return tensor

    @torch.no_grad()
    def _forward_logprobs(self, model, micro: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Per-token log-probs (fp32, CPU) of `model` on each micro-batch's input_ids (with its `routes`
        replayed under routing replay), forward-only.

        The no-grad passes share it: the policy's (`logprobs`, the decoupled proximal policy) and the
        frozen reference's (KL penalty). They run on exactly the micro-batch shapes of the training
        pass, so identical weights give bit-identical log-probs. Every rank of the PP group gets them.
        """
        micro_inputs = [mb["input_ids"] for mb in micro]
        model_keys = ("input_ids", "routes", *packing.PACK_KEYS)
        out = self._run(model, [{k: mb[k] for k in model_keys if k in mb} for mb in micro],
                        forward_only=True,
                        loss_fn=lambda logits, mb, cp_layout, _: (torch.zeros((), device=self.device),
                                                                  self._row_logprobs(logits, mb, cp_layout)))
        if self.cfg.pp == 1:
            return [o.cpu() for o in out]
        # PP: only the last stage computed them; one broadcast of all micro-batches padded to the widest.
        shapes = [tuple(x.shape) for x in micro_inputs]
        width = max(w for _, w in shapes)
        padded = (torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1])) for o in out])
                  if self.post_process else None)
        full = self._broadcast_from_last_stage(padded, (sum(b for b, _ in shapes), width)).cpu()
        return [part[:, :w] for part, (_, w) in zip(full.split([b for b, _ in shapes]), shapes)]

    def logprobs(self, input_ids: torch.Tensor, routes: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token log-probs [B, S] (fp32, CPU) of the whole batch under the current weights (routes
        [B, S, L, k]: replayed under algo.routing_replay=r3)."""
        self.model.eval()
        rows = range(input_ids.shape[0])
        return torch.cat(self._forward_logprobs(self.model, [
            {"input_ids": input_ids[idx], **({"routes": routes[idx]} if routes is not None else {})}
            for idx in torch.arange(len(rows)).split(self.cfg.micro_batch_size)]))

    # ------------------------------------------------------------------ the step

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Exactly one optimizer step over the whole batch; skipped if loss or grad norm is not finite."""
        start = time.perf_counter()
        totals = step.batch_totals(batch)
        fields = step.dp_share(batch, self.cfg.dp, self.ps.get_data_parallel_rank())
        micro_batches = step.micro_batches(fields, self.cfg.micro_batch_size, self.cfg.micro_batch_tokens,
                                           pack=self.cfg.pack_sequences and not self.recurrent,
                                           share_prefixes=self.cfg.share_prefixes)
        if self.cfg.ep > 1:
            # Every MoE layer's alltoall pairs the EP ranks micro-batch by micro-batch: same count on all.
            count = torch.tensor(len(micro_batches))
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.ps.get_expert_model_parallel_group())
            micro_batches = step.pad_micro_batches(micro_batches, int(count), self.cfg.share_prefixes)
        needs_pi = step.needs_proximal_logprobs(self.loss_cfg, self.critic)
        step.attach_extra_logprobs(micro_batches, {"proximal_logprobs": self.model if needs_pi else None,
                                                   "ref_logprobs": self.ref_model}, self._forward_logprobs)
        if self.critic is not None:  # GAE advantages (replacing the batch's) and value targets, per micro-batch
            self.critic.prepare(micro_batches)
        critic_only = self.critic is not None and self.critic.warming_up
        teacher_s = self.teacher.attach(micro_batches) if self.teacher is not None else None
        # policy_loss returns each micro-batch's share of the batch loss (global normalisers), so
        # the batch gradient is the plain SUM over micro-batches and DP ranks.  Megatron instead
        # divides each micro-batch loss by num_microbatches (schedules.forward_step_calc_loss,
        # 2-tuple loss_func path) and averages grads over DP (DDP gradient_scaling_factor =
        # 1/dp); multiplying by both cancels that exactly for power-of-two counts.
        megatron_scale = len(micro_batches) * self.ps.get_data_parallel_world_size()
        stats_list, losses = [], []

        def loss_fn(logits, mb, cp_layout, width):
            mb = {k: v.to(self.device) for k, v in mb.items()}
            logprobs = self._row_logprobs(logits, mb, cp_layout)
            entropy = step.token_entropy(self._position_entropy, logits, mb, self.loss_cfg,
                                         self._cp_rows(cp_layout, width))
            loss, stats = step.micro_batch_loss(logprobs, mb, batch.learner_version, totals, self.loss_cfg, entropy,
                                                self.distill)
            stats_list.append(stats)
            losses.append(loss.detach())
            return loss * megatron_scale, {}

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        own_routes = [] if self.is_moe and "routes" in micro_batches[0] else None
        self._run(self.model, micro_batches, forward_only=False, loss_fn=loss_fn, own_routes=own_routes)
        if own_routes is not None:  # (collective over PP: every stage counts its own layers)
            router = self._router_partials(micro_batches, own_routes, batch.learner_version)
            stats_list = [{**st, **rp} for st, rp in zip(stats_list, router)] if self.post_process else stats_list

        # The batch loss = sum of micro-batch losses over the last PP stage of every DP rank.
        loss = torch.stack(losses).sum().double().cpu() if losses else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(loss)  # non-last PP stages contribute 0; TP and CP ranks hold copies
        loss = float(loss) / (self.cfg.tp * self.cfg.cp)
        # Look at the grad norm BEFORE stepping (the fp32 optimizer has no inf check of its own);
        # step() repeats both calls, an extra pass over the grads we pay to never apply a NaN.
        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        lr = lr_at(self._version, self.cfg)
        if not skipped and not critic_only:  # (critic warm-up: the policy's gradients are computed, not applied)
            for group in self.optimizer.param_groups:  # (megarl runs no megatron OptimizerParamScheduler)
                group["lr"] = lr
            self.optimizer.step()
            self._version += 1
        critic_metrics = {}
        if self.critic is not None:
            critic_metrics = self.critic.train(micro_batches, totals[0], batch.learner_version,
                                               self.loss_cfg.max_lag_bucket)
        metrics = {
            "loss": loss, "grad_norm": grad_norm, "lr": lr, "num_tokens": totals[0],
            **step.position_metrics(fields, micro_batches),
            "step_time_s": time.perf_counter() - start, "skipped_nonfinite": float(skipped),
        }
        if teacher_s is not None:
            metrics["distill/teacher_s"] = teacher_s
        if self.post_process:  # only the last PP stage computes losses
            metrics.update(step.dp_merged_stats(stats_list, self.cfg.dp, self.ps.get_data_parallel_group()))
        if self.cfg.pp > 1:  # every stage reports the loss statistics (rank 0, the logger, is the first)
            box = [metrics if self.post_process else None]
            dist.broadcast_object_list(box, src=self._last_stage_rank(),
                                       group=self.ps.get_pipeline_model_parallel_group())
            metrics = {**box[0], "step_time_s": metrics["step_time_s"]}
        return {**metrics, **critic_metrics}

    # ------------------------------------------------------------------ checkpoint state (megarl/checkpoint)

    def sharded_state_dict(self, with_optimizer: bool, is_loading: bool = False) -> dict:
        """Model (and optimizer) as megatron dist-checkpointing ShardedTensors: every shard is named
        by its place in the full TP=1/PP=1 tensor, so what one tp/pp/dp layout saves another loads.
        The optimizer has no state to save before its first applied step."""
        model = self.gpt.sharded_state_dict()
        if not with_optimizer:
            return {"model": model}
        # fully_reshardable: the distributed optimizer's state in the same model-space form as the
        # plain optimizer's (which ignores these options); gathered over gloo on CPU (the other path
        # gathers on the GPU).
        metadata = {"distrib_optim_sharding_type": "fully_reshardable",
                    "distrib_optim_fully_reshardable_mem_efficient": not self.on_gpu}
        if is_loading and self.cfg.use_distributed_optimizer:
            # With torch's Adam (no Apex/TE) megatron reads the step from the Adam state, which exists
            # only after a first step: create it (zero moments, replaced by the load), as megatron does.
            for opt in self.optimizer.chained_optimizers:
                if len(opt.optimizer.state) == 0:
                    opt._init_optimizer_states_with_dummy_values()
        return {"model": model, "optimizer": self.optimizer.sharded_state_dict(
            model, is_loading=is_loading, metadata=metadata)}

    def load_state(self, state: dict, version: int) -> None:
        """Take what `sharded_state_dict` saved, as dist_checkpointing.load returns it.  Weights, Adam
        moments and step come from the checkpoint; lr, betas and weight decay stay this run's config."""
        self.gpt.load_state_dict(state["model"])
        if "optimizer" in state:
            # (Apex/TE's FusedAdam keeps its step count in the param groups: that one is state.)
            hyper = [{k: v for k, v in group.items() if k not in ("params", "step")}
                     for group in self.optimizer.param_groups]
            self.optimizer.load_state_dict(state["optimizer"])
            for group, own in zip(self.optimizer.param_groups, hyper):
                group.update(own)
            if self.cfg.use_distributed_optimizer:
                # megatron 0.16's distributed optimizer hands every parameter's torch-Adam state ONE
                # shared step tensor, which Adam then increments once per parameter: un-share it.
                for opt in self.optimizer.chained_optimizers:
                    for param_state in opt.optimizer.state.values():
                        if "step" in param_state:
                            param_state["step"] = param_state["step"].clone()
        self._version = version


def _weights(gpt) -> dict[str, torch.Tensor]:
    """The tensors of `gpt` that are HF weights: its parameters and GLM-4.5's router expert bias, a buffer
    (megarl.models.moe.EXPERT_BIAS: HF's e_score_correction_bias, never trained)."""
    weights = dict(gpt.named_parameters())
    weights.update((n, b) for n, b in gpt.named_buffers() if n.endswith("." + moe.EXPERT_BIAS[1]))
    return weights


def check_recurrent(cfg: LearnerConfig, routing_replay: str) -> None:
    """Refuse, naming them, the settings a model with gated-DeltaNet layers is not built for here."""
    missing = {"learner.cp > 1 (context parallelism)": cfg.cp > 1, "learner.lora": cfg.lora.rank > 0,
               "algo.routing_replay=r3": routing_replay == "r3"}
    if any(missing.values()):
        raise ValueError(f"a model with gated-DeltaNet layers (layer_types 'linear_attention') does not train with "
                         f"{', '.join(k for k, v in missing.items() if v)} on the megatron learner")


def _gated_delta_net_part(name: str, recurrent: bool) -> str | None:
    """A gated-DeltaNet parameter's name within its layer's module (`in_proj.weight`, `conv1d.weight`: fused rows
    that megarl.models.gated_delta_net splits over TP part by part), None for any other parameter."""
    if not recurrent:
        return None
    for part in ("self_attention.in_proj.weight", "self_attention.conv1d.weight"):
        if name.endswith(part):
            return part[len("self_attention."):]
    return None


def _gate_up_rows(name: str) -> bool:
    """Whether a parameter's rows are a fused SwiGLU's [gate; up] (linear_fc1's weight, and its adapter's B): each
    TP rank holds cat[its gate rows, its up rows]. GLM-4.5's shared expert is such an MLP, split over TP."""
    return name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.lora.lora_B",
                          "mlp.shared_experts.linear_fc1.weight"))


def _local_copy(param: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of a parameter as fp32 on CPU, detached from the training storage (one copy)."""
    return param.detach().to(device="cpu", dtype=torch.float32, copy=True)


def publish_bytes(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype = torch.float32) -> int:
    """Bytes one publish source sends for tensors of these shapes (HF name -> shape), all of `dtype`:
    with publish_shards, what each learner TP rank's link carries."""
    return sum(math.prod(shape) for shape in shapes.values()) * dtype.itemsize


def _recompute_kwargs(mode: str) -> dict:
    """TransformerConfig arguments of `learner.recompute_activations` (none | full | selective)."""
    if mode == "full":  # every layer's activations recomputed in the backward pass
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if mode == "selective":  # only the attention core (megatron's cheap-to-recompute part)
        return {"recompute_granularity": "selective"}
    return {}
