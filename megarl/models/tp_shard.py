"""The tensor-parallel layout of HF-named weights: which slice of each HF tensor TP rank r holds.

One definition shared by the two sides of a direct shard-to-shard publish: the learner's TP rank r
sends exactly these slices (`MegatronLearner.publish_shards`) and the built-in engine's TP rank r runs
on them (`megarl.sampler.model`), so neither side ever holds the whole model to convert it.

The split is megatron's (and SGLang's) for a Llama/Qwen2 decoder:
  * column-parallel, split by output rows: q_proj, k_proj, v_proj (whole heads: rank r holds query
    heads [r*H/t, (r+1)*H/t) and KV heads [r*K/t, (r+1)*K/t)), their biases, gate_proj, up_proj and
    their biases; and vocab-parallel, also by rows: embed_tokens and lm_head (rank r holds token ids
    [r*V/t, (r+1)*V/t), as megatron's VocabParallelEmbedding and output layer do);
  * row-parallel, split by input columns: o_proj, down_proj; their biases (if any) are not split:
    every rank holds them whole and adds them once, after the all-reduce of the partial outputs;
  * the norms whole on every rank.
So a link carries 1/t of every matrix; nothing needs gathering on the learner side.

Mixture-of-experts layers split every expert as the dense MLP (expert tensor parallelism, as SGLang's and
vLLM's fused-MoE TP does): each expert's gate/up (Mixtral's w1/w3, Qwen3-MoE's gate_proj/up_proj) by rows,
its down (w2/down_proj) by columns, so rank r holds rows [r*I/t, (r+1)*I/t) of every expert's intermediate
width I.  The router (``gate``) stays whole on every rank: every rank then routes the same hidden state with
the same weights and picks the same experts, and the layer's partial outputs are summed once, like the
dense MLP's.  Qwen3-MoE's q_norm / k_norm act per head_dim and stay whole.  A sigmoid-routed MoE's shared expert
(GLM-4.5, DeepSeek-V3: ``mlp.shared_experts.{gate,up,down}_proj``) splits as one more expert, its router's
``e_score_correction_bias`` stays whole with the router, its first dense layers split as a dense MLP.

Multi-latent attention (DeepSeek-V3; the built-in engine only: its learner publishes whole tensors) splits by heads
as vLLM's and SGLang's MLA do: rank r holds the heads [r*H/t, (r+1)*H/t) of q_proj or q_b_proj (whose rows are
grouped by head) and of kv_b_proj (each head's k-nope and v rows), and their columns of o_proj; the latent
projections (q_a_proj, kv_a_proj_with_mqa) and their norms stay whole, so every rank computes and caches the same
latent.
"""
from __future__ import annotations

import torch

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head",
                   "w1", "w3",  # Mixtral experts' gate, up
                   "q_b_proj", "kv_b_proj")  # multi-latent attention's per-head up-projections
ROW_PARALLEL = ("o_proj", "down_proj", "w2")  # w2: a Mixtral expert's down


def check_divisible(num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
                    tp_size: int, intermediate_name: str = "intermediate_size") -> None:
    """ValueError naming the dimension that tp_size does not divide (`intermediate_name`: the config field of
    the MLP width that is split: an MoE expert's, e.g. Qwen3-MoE's moe_intermediate_size)."""
    for what, n in (("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads),
                    (intermediate_name, intermediate_size), ("vocab_size", vocab_size)):
        if n % tp_size:
            raise ValueError(f"tensor parallel size {tp_size} does not divide {what}={n}")


def split_kind(name: str) -> str:
    """'column', 'row' or 'whole': how TP splits the HF tensor `name` (biases of row-parallel layers are whole)."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module in COLUMN_PARALLEL:
        return "column"
    if module in ROW_PARALLEL and name.endswith(".weight"):
        return "row"
    return "whole"


def shard(name: str, tensor: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """TP rank `tp_rank`'s slice of the HF tensor `name` (a view; the tensor itself when whole).

    Column- and vocab-parallel tensors are cut into tp_size equal blocks of rows; since q/k/v rows are
    grouped by head, equal blocks are whole heads (check_divisible first)."""
    kind = split_kind(name)
    if kind == "whole" or tp_size == 1:
        return tensor
    dim = 0 if kind == "column" else 1
    if tensor.shape[dim] % tp_size:
        raise ValueError(f"{name} {list(tensor.shape)}: tensor parallel size {tp_size} does not divide "
                         f"dimension {dim}")
    return tensor.chunk(tp_size, dim=dim)[tp_rank]


def whole_shape(name: str, shape: tuple[int, ...], tp_size: int) -> tuple[int, ...]:
    """The HF tensor `name`'s whole shape from the shape of one of `tp_size` ranks' slices (the inverse of
    `shard` on shapes)."""
    kind = split_kind(name)
    if kind == "whole":
        return tuple(shape)
    dim = 0 if kind == "column" else 1
    return tuple(n * tp_size if d == dim else n for d, n in enumerate(shape))


def shard_state_dict(weights: dict[str, torch.Tensor], tp_size: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """Every tensor of an HF state dict cut to TP rank `tp_rank`'s slice."""
    return {name: shard(name, t, tp_size, tp_rank) for name, t in weights.items()}


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The whole HF tensor from every TP rank's slice, in rank order (the inverse of `shard`)."""
    kind = split_kind(name)
    if kind == "whole":
        return shards[0]
    return torch.cat(shards, dim=0 if kind == "column" else 1)

