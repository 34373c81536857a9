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
              `divide` it by the TP size (an AssertionError).
              vocab_size % tp == 0: VocabParallelEmbedding and the vocab-parallel output layer
              `divide` it (megarl does not pad the vocabulary).
  sampler.tp  the same four TP rules: the built-in engine runs on tp_shard slices (sampler.tp is 1 or
              learner.tp, megarl.config.load checks that).
  learner.dp  no model rule: with learner.use_distributed_optimizer megatron pads every gradient bucket
              to a multiple of dp (param_and_grad_buffer._pad_end_of_bucket_if_needed), so any dp shards.
  learner.ep  a mixture-of-experts model only; num_experts % ep == 0: megatron's MoE layer asserts
              "num_moe_experts must be divisible by expert_model_parallel_size" (each EP rank holds E / ep).
              An MoE model at learner.tp > 1 trains with sequence parallelism and whole experts per TP rank
              (megarl.learner.sequence_parallel): intermediate_size (the experts' width) is not split, so
              the TP rule on it does not apply; (tp * dp) % ep == 0 is megarl.config.load's.
  sampler.tp  > 1 is refused for an MoE model: the built-in engine has no TP for MoE layers (ModelSpec.shard).
  algo.routing_replay=r3  a mixture-of-experts model.
Rules that need no model (a batch smaller than learner.dp, sampler.tp not 1 or learner.tp, learner.ep not
dividing learner.dp) are in megarl.config.load.validate.
"""
from __future__ import annotations

from megarl.models import moe


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_layout(hf_config: dict, learner_tp: int = 1, learner_pp: int = 1, sampler_tp: int = 1,
                 learner_ep: int = 1, routing_replay: str = "off") -> None:
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
    if not moe.is_moe(hf_config):
        if learner_ep > 1:
            raise ValueError(f"learner.ep={learner_ep}: expert parallelism needs a mixture-of-experts model; "
                             f"model_type {hf_config.get('model_type')!r} is dense")
        if routing_replay != "off":
            raise ValueError(f"algo.routing_replay={routing_replay}: routing replay needs a mixture-of-experts "
                             f"model; model_type {hf_config.get('model_type')!r} is dense")
    else:
        experts = moe.num_experts(hf_config)
        if experts % learner_ep:
            raise ValueError(f"learner.ep={learner_ep}: expert parallel size {learner_ep} does not divide "
                             f"num_experts={experts} (this model allows learner.ep in {_divisors(experts)})")
        if sampler_tp > 1:
            raise ValueError(f"sampler.tp={sampler_tp}: the built-in engine has no tensor parallelism for "
                             f"mixture-of-experts models; use sampler.tp=1 (learner.tp may be > 1)")
    tp = max(learner_tp, sampler_tp)
    if tp > 1:
        keys = "learner.tp/sampler.tp" if sampler_tp > 1 else "learner.tp"
        split = ("num_attention_heads", "num_key_value_heads", "vocab_size")
        if not moe.is_moe(hf_config):  # (an MoE learner keeps every expert whole on each TP rank)
            split += ("intermediate_size",)
        for name in split:
            default_from = "num_attention_heads" if name == "num_key_value_heads" else None
            n = dim(name, default_from)
            if n % tp:
                raise ValueError(f"{keys}={tp}: tensor parallel size {tp} does not divide {name}={n} "
                                 f"(each TP rank holds an equal share; {name}={n} allows tp in {_divisors(n)})")
