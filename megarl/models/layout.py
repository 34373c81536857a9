"""Which parallel layouts a model admits: every divisibility megatron-core 0.16.1 and megarl's own
shard-to-shard path require, checked against the model's config.json before any process starts.

`check_layout` is called by `megarl train` (megarl/cli.py check_model_dir) and again by every learner
rank of a raw torchrun launch (megarl/roles/learner_main.py), so a refused layout is named with its key
instead of ending in a megatron assert seconds after four processes started. What it enumerates, and
where each rule comes from:

  learner.pp  num_hidden_layers % pp == 0: megatron's transformer_block.get_num_layers_to_build asserts
              "num_layers should be divisible by pipeline_model_parallel_size" (megarl sets no uneven
              first/last stage sizes).
  learner.tp  num_attention_heads % tp == 0: TransformerConfig.__post_init__ raises.
              num_key_value_heads % tp == 0: megatron also admits tp % kv_heads == 0 (replicated KV
              heads), but megarl's converters and tp_shard split whole KV heads per rank.
              intermediate_size % tp == 0: ColumnParallelLinear (fc1) and RowParallelLinear (fc2)
              `divide` it by the TP size (an AssertionError); of an MoE model, one expert's width
              (Qwen3-MoE: moe_intermediate_size), which the built-in engine splits per expert.
              vocab_size % tp == 0: VocabParallelEmbedding and the vocab-parallel output layer
              `divide` it (megarl does not pad the vocabulary). A gated-DeltaNet model (Qwen3.5):
              linear_num_key_heads % tp == 0 (megarl.models.gated_delta_net.tp_slice: whole key heads per rank).
  sampler.tp  the same four TP rules: the built-in engine runs on tp_shard slices (sampler.tp is 1,
              learner.tp, or any size at learner.tp=1; megarl.config.load checks that).  An MoE model's
              router stays whole on every rank, its experts split like the dense MLP.
  learner.dp  no model rule: with learner.use_distributed_optimizer megatron pads every gradient bucket
              to a multiple of dp (param_and_grad_buffer._pad_end_of_bucket_if_needed), so any dp shards.
  learner.ep  a mixture-of-experts model only; num_experts % ep == 0: megatron's MoE layer asserts
              "num_moe_experts must be divisible by expert_model_parallel_size" (each EP rank holds E / ep).
              An MoE model at learner.tp > 1 trains with sequence parallelism and whole experts per TP rank
              (megarl.learner.sequence_parallel): intermediate_size (the experts' width) is not split, so
              the TP rule on it does not apply; (tp * cp * dp) % ep == 0 is megarl.config.load's.
  sampler.tp  of an MoE model: > 1 only at learner.tp=1 (the learner's whole experts per TP rank are not the
              engine's per-expert slices); the experts' width divisible by sampler.tp (the shared expert's is a
              multiple of it), and the first dense layers' intermediate_size (GLM-4.5, DeepSeek-V3).
  algo.routing_replay=r3  a mixture-of-experts model.
  learner.cp  > 1 not for a model with gated-DeltaNet layers (Qwen3.5: a recurrence over each row's positions).
Rules that need no model (a batch smaller than learner.dp, sampler.tp not 1 or learner.tp, learner.ep not
dividing learner.dp) are in megarl.config.load.validate.
"""
from __future__ import annotations

from megarl.models import families, moe_config


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_layout(hf_config: dict, learner_tp: int = 1, learner_pp: int = 1, sampler_tp: int = 1,
                 learner_ep: int = 1, routing_replay: str = "off", learner_cp: int = 1) -> None:
    """ValueError naming the config key and the model dimension it does not divide; a dimension the
    check needs but config.json lacks is named too."""

    def dim(name: str, default_from: str | None = None) -> int:
        value = hf_config.get(name) or (hf_config.get(default_from) if default_from else None)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"config.json has no positive integer {name!r} (got {value!r}), which the parallel "
                             f"layout needs")
        return value

    if learner_pp > 1:
        layers = dim("num_hidden_layers")
        if layers % learner_pp:
            raise ValueError(f"learner.pp={learner_pp}: pipeline parallel size {learner_pp} does not divide "
                             f"num_hidden_layers={layers} (megatron gives every stage the same number of layers; "
                             f"this model allows learner.pp in {_divisors(layers)})")
    model_type = hf_config.get("model_type")
    family = families.LEARNER_FAMILIES.get(model_type) or families.FAMILIES.get(model_type)
    if learner_cp > 1 and family is not None and family.linear_attention:
        raise ValueError(f"learner.cp={learner_cp}: {model_type}'s gated-DeltaNet layers run each row's positions as "
                         f"one recurrence, which context parallelism would split over ranks; use learner.cp=1")
    whole = families.engine_tp_refusal(hf_config)
    if sampler_tp > 1 and whole:
        raise ValueError(f"sampler.tp={sampler_tp}: {model_type}'s {whole} have no "
                         f"tensor-parallel slices in the built-in engine (megarl.models.tp_shard); use sampler.tp=1")
    # (gpt-oss is not whole_tensors_only: its learners publish it as the other MoE families do)
    if sampler_tp > 1 and family is not None and family.gpt_oss_blocks:
        raise ValueError(f"sampler.tp={sampler_tp}: {model_type}'s fused experts (mlp.experts.gate_up_proj, gate and "
                         f"up interleaved) have no tensor-parallel slices in the built-in engine; use sampler.tp=1")
    if not moe_config.is_moe(hf_config):
        if learner_ep > 1:
            raise ValueError(f"learner.ep={learner_ep}: expert parallelism needs a mixture-of-experts model; "
                             f"model_type {hf_config.get('model_type')!r} is dense")
        if routing_replay != "off":
            raise ValueError(f"algo.routing_replay={routing_replay}: routing replay needs a mixture-of-experts "
                             f"model; model_type {hf_config.get('model_type')!r} is dense")
    else:
        experts = moe_config.num_experts(hf_config)
        if experts % learner_ep:
            raise ValueError(f"learner.ep={learner_ep}: expert parallel size {learner_ep} does not divide "
                             f"num_experts={experts} (this model allows learner.ep in {_divisors(experts)})")
        if sampler_tp > 1 and learner_tp > 1:
            raise ValueError(f"sampler.tp={sampler_tp}: at learner.tp={learner_tp} an MoE learner keeps every expert "
                             f"whole on each TP rank (megarl.learner.sequence_parallel), which is not the built-in "
                             f"engine's per-expert split, so no shard-to-shard publish; use learner.tp=1 with "
                             f"sampler.tp > 1 (whole tensors, each engine rank keeps its slices) or sampler.tp=1")
        if sampler_tp > 1:  # the engine splits every expert like the dense MLP; the learner keeps them whole
            ffns = [moe_config.expert_ffn_field(hf_config)]
            if model_type in moe_config.SIGMOID_ROUTED and moe_config.first_dense_layers(hf_config):
                ffns.append("intermediate_size")  # (the first dense layers' MLP, split as a dense model's)
            for ffn in ffns:
                width = dim(ffn)
                if width % sampler_tp:
                    raise ValueError(f"sampler.tp={sampler_tp}: tensor parallel size {sampler_tp} does not divide "
                                     f"{ffn}={width} (each TP rank holds an equal share of every expert and MLP; "
                                     f"{ffn}={width} allows tp in {_divisors(width)})")
    tp = max(learner_tp, sampler_tp)
    if tp > 1:
        keys = "/".join(key for key, size in (("learner.tp", learner_tp), ("sampler.tp", sampler_tp)) if size > 1)
        split = [("num_attention_heads", None), ("num_key_value_heads", "num_attention_heads"), ("vocab_size", None)]
        if not moe_config.is_moe(hf_config):
            split.append(("intermediate_size", None))
        if hf_config.get("model_type") in families.LEARNER_FAMILIES:
            split.append(("linear_num_key_heads", None))  # (gated DeltaNet: a rank holds whole key heads)
        for name, default_from in split:
            n = dim(name, default_from)
            if n % tp:
                raise ValueError(f"{keys}={tp}: tensor parallel size {tp} does not divide {name}={n} "
                                 f"(each TP rank holds an equal share; {name}={n} allows tp in {_divisors(n)})")
