"""Sequence packing (megarl/learner/packing.py): a micro-batch's rows placed end to end in fewer rows, each row kept
to its own positions by the attention mask and read back in the rows' layout. On both learner backends (one gloo
rank, in this process) a packed forward gives transformers' own per-row log-probs, and a packed step the unpacked
step's loss, grad norm and weights; an MoE model under routing replay gets each row's recorded routes. The megatron
learner's fused attention (SDPA) computes what megatron's own does under both masks."""
import random

import pytest
import torch

from megarl.algo.config import LossConfig
from megarl.learner import packing, step
from megarl.protocols import TrainBatch
from tests.helpers import save_tiny_moe, save_tiny_qwen2

VOCAB, B, S, PROMPT = 64, 24, 24, 3
# Long-tailed lengths (prompt included), as an RL batch's: a few long rows, many short ones.
LENGTHS = [24, 22, 17, 12, 10, 9, 8, 8, 7, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4, 4, 4, 4, 4]


def test_first_fit_decreasing_places_every_row_once_within_capacity():
    assert packing.first_fit_decreasing([5, 4, 3, 2, 1], 5) == [[0], [1, 4], [2, 3]]
    rng = random.Random(0)
    for _ in range(50):
        capacity = rng.randint(4, 40)
        lengths = [rng.randint(1, capacity) for _ in range(rng.randint(1, 60))]
        bins = packing.first_fit_decreasing(lengths, capacity)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
        # First fit never leaves two packed rows that would fit in one (at most half full twice).
        assert sum(sum(lengths[i] for i in b) <= capacity / 2 for b in bins) <= 1
    with pytest.raises(ValueError, match="row 1 of 7 positions does not fit a packed row of 6"):
        packing.first_fit_decreasing([3, 7], 6)


def _rows(lengths, width, layers=2, k=2, seed=0):
    """A micro-batch's fields: random tokens, trained from PROMPT to each row's length, routes [n, w, L, k]."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    mask = torch.zeros(n, width)
    for r, length in enumerate(lengths):
        mask[r, PROMPT:length] = 1.0
    return {"input_ids": torch.randint(1, VOCAB, (n, width), generator=g), "mask": mask,
            "routes": torch.randint(0, 8, (n, width, layers, k), generator=g, dtype=torch.uint8)}


def test_pack_places_each_row_and_unpack_reads_it_back():
    mb = _rows(LENGTHS, S)
    lengths = step.sequence_lengths(mb["mask"])
    assert lengths.tolist() == LENGTHS
    p = packing.pack(mb, lengths)
    rows, width = p["packed_ids"].shape
    assert width == max(LENGTHS) and rows * width < B * S and rows * width >= sum(LENGTHS)
    real = torch.arange(S) < lengths[:, None]
    # Every real position reads back its own token, route and position within its row.
    assert torch.equal(packing.unpack(p["packed_ids"], p["unpack_index"])[real], mb["input_ids"][real])
    assert torch.equal(packing.unpack(p["packed_routes"], p["unpack_index"])[real], mb["routes"][real])
    assert torch.equal(packing.unpack(p["packed_positions"], p["unpack_index"])[real],
                       torch.arange(S).expand(B, S)[real])
    assert torch.equal(packing.unpack(p["packed_segments"], p["unpack_index"])[real],
                       torch.arange(B)[:, None].expand(B, S)[real])
    # Each row's positions are consecutive in one packed row; unplaced positions hold nothing.
    assert torch.equal(torch.bincount(p["packed_segments"][p["packed_segments"] >= 0], minlength=B), lengths)
    empty = p["packed_segments"] < 0
    assert int(empty.sum()) == rows * width - sum(LENGTHS) and not p["packed_ids"][empty].any()
    assert torch.equal(p["packed_routes"][empty], torch.arange(2, dtype=torch.uint8).expand(int(empty.sum()), 2, 2))
    assert set(packing.unpacked(p)) == set(mb)
    with pytest.raises(ValueError, match="exactly once"):
        packing.pack(mb, lengths, [[0, 1], [1]])


def test_attention_mask_keeps_each_row_to_its_own_earlier_positions():
    segments = torch.tensor([[0, 0, 0, 1, 1, -1]])
    attended = ~packing.attention_mask(segments)[0, 0]
    assert attended.tolist() == [[True, False, False, False, False, False],
                                 [True, True, False, False, False, False],
                                 [True, True, True, False, False, False],
                                 [False, False, False, True, False, False],
                                 [False, False, False, True, True, False],
                                 [False, False, False, False, False, True]]
    additive = packing.additive_attention_mask(segments, torch.float32)[0, 0]
    assert torch.equal(additive == 0, attended) and float(additive.min()) == torch.finfo(torch.float32).min


def test_packed_micro_batches_hold_every_row_once_within_the_unpacked_bounds():
    rng = random.Random(1)
    lengths = sorted((min(S, PROMPT + 1 + int(rng.expovariate(1 / 6))) for _ in range(96)), reverse=True)
    fields = _rows(lengths, S)
    fields = {**fields, "behaviour_logprobs": torch.zeros(96, S), "advantages": torch.zeros(96, S),
              "versions": torch.zeros(96, S, dtype=torch.long), "row": torch.arange(96)[:, None].expand(96, S)}
    for max_rows, max_tokens in [(8, 0), (64, 0), (8, 3 * S)]:
        unpacked = step.micro_batches(fields, max_rows, max_tokens)
        micro = step.micro_batches(fields, max_rows, max_tokens, pack=True)
        assert sorted(int(r) for mb in micro for r in mb["row"][:, 0]) == list(range(96))
        for mb in micro:
            rows, width = mb["packed_ids"].shape
            assert rows <= max_rows and width <= S and (max_tokens == 0 or rows * width <= max_tokens)
            real = mb["mask"] > 0
            assert torch.equal(packing.unpack(mb["packed_ids"], mb["unpack_index"])[real], mb["input_ids"][real])
        assert step.padding_frac(fields, micro) < step.padding_frac(fields, unpacked)
    assert len(step.micro_batches(fields, 64, pack=True)) == 1
    # Expert parallelism pads to a micro-batch count by splitting rows: the parts are packed again.
    micro = step.micro_batches(fields, 64, pack=True)
    split = step.pad_micro_batches(micro, 3)
    assert len(split) == 3 and all("unpack_index" in mb for mb in split)
    assert sorted(int(r) for mb in split for r in mb["row"][:, 0]) == list(range(96))


# ---------------------------------------------------------------- both learner backends against transformers


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    return {"qwen2": str(save_tiny_qwen2(root / "qwen2", tie_word_embeddings=False, vocab_size=VOCAB)),
            "mixtral": str(save_tiny_moe(root / "mixtral", "mixtral", vocab_size=VOCAB))}


@pytest.fixture
def local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")  # what DeepSpeed asks a launcher for


def _learner(model_dir, backend, pack, routing_replay="off", loss_cfg=None):
    from megarl.config.schema import DeepSpeedConfig, LearnerConfig

    cfg = LearnerConfig(backend=backend, micro_batch_size=6, lr=1e-2, pack_sequences=pack,
                        deepspeed=DeepSpeedConfig(zero_stage=1))
    if backend == "deepspeed":
        from megarl.learner.deepspeed import DeepSpeedLearner

        return DeepSpeedLearner(model_dir, cfg, loss_cfg or LossConfig(), routing_replay=routing_replay)
    from megarl.learner.megatron import MegatronLearner

    return MegatronLearner(model_dir, cfg, loss_cfg or LossConfig(), routing_replay=routing_replay)


def _hf_forward(model_dir, ids):
    """transformers' own per-row log-probs [B, S] (column 0 = 0) and, for an MoE model, its routes [B, S, L, k]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    moe = hasattr(hf.config, "num_local_experts")
    with torch.no_grad():
        out = hf(ids, output_router_logits=True) if moe else hf(ids)
    lp = torch.nn.functional.pad(torch.log_softmax(out.logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0], (1, 0))
    if not moe:
        return lp, None
    k = hf.config.num_experts_per_tok
    routes = torch.stack([r.reshape(*ids.shape, -1).topk(k, dim=-1).indices for r in out.router_logits], dim=2)
    return lp, routes.to(torch.uint8)


def _batch(model_dir):
    """Long-tailed rows trained at lag 0 (behaviour = transformers' log-probs) with random advantages."""
    fields = _rows(LENGTHS, S, seed=2)
    behaviour, routes = _hf_forward(model_dir, fields["input_ids"])
    mask = fields["mask"]
    adv = torch.randn(B, 1, generator=torch.Generator().manual_seed(3)).expand(B, S) * mask
    batch = TrainBatch(input_ids=fields["input_ids"], loss_mask=mask, behaviour_logprobs=behaviour * mask,
                       versions=torch.where(mask > 0, 0, -1), advantages=adv, learner_version=0, routes=routes)
    return batch, behaviour


@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
@pytest.mark.parametrize("kind", ["qwen2", "mixtral"])
def test_a_packed_step_is_the_unpacked_step(model_dirs, world, local_rank, backend, kind):
    """Packed micro-batches (several rows per packed row) give transformers' per-row log-probs at every trained
    position, and the step the unpacked one's loss, grad norm and weights; an MoE learner under r3 replays each
    row's recorded routes at its packed positions (agreement 1)."""
    replay = "r3" if kind == "mixtral" else "off"
    batch, behaviour = _batch(model_dirs[kind])
    packed = _learner(model_dirs[kind], backend, pack=True, routing_replay=replay)
    micro = step.micro_batches(step.dp_share(batch, 1, 0), 6, pack=True)
    assert sum(mb["packed_ids"].shape[0] for mb in micro) < B / 2  # packed rows hold several rows each
    model = packed.engine if backend == "deepspeed" else packed.model
    for mb, lp in zip(micro, packed._forward_logprobs(model, micro)):
        width = mb["input_ids"].shape[1]
        rows = [int(torch.nonzero((batch.input_ids[:, :width] == row).all(1))[0]) for row in mb["input_ids"]]
        real = mb["mask"] > 0
        assert float((lp - behaviour[rows, :width])[real].abs().max()) <= 1e-5
    unpacked = _learner(model_dirs[kind], backend, pack=False, routing_replay=replay)
    got, want = packed.train_step(batch), unpacked.train_step(batch)
    assert got["padding_frac"] < want["padding_frac"] / 2
    for key in ("loss", "grad_norm", "ratio/mean"):
        assert abs(got[key] - want[key]) <= 1e-5 * max(1.0, abs(want[key])), key
    if kind == "mixtral":
        assert got["router/agreement"] == 1.0
    # Adam's first step moves an element by ~lr * sign(grad): elements of float-noise gradients differ by up to lr.
    after = dict(unpacked.publish_tensors())
    for name, tensor in packed.publish_tensors():
        assert float((tensor - after[name]).abs().max()) <= 0.1 * 1e-2, name


@pytest.mark.parametrize("pack", [True, False])
def test_what_fills_a_row_past_its_end_changes_nothing(model_dirs, world, pack):
    """The learner pads batch rows with token 0, not the tokenizer's pad token (megarl.roles.learner_main): positions
    past a row's end are never trained, and causal attention (or packing, which leaves them out) keeps them out of
    every real position, so any fill gives the same step."""
    from dataclasses import replace

    batch, _ = _batch(model_dirs["qwen2"])
    past_end = torch.arange(S) >= step.sequence_lengths(batch.loss_mask)[:, None]
    steps = [_learner(model_dirs["qwen2"], "megatron", pack).train_step(
        replace(batch, input_ids=batch.input_ids.masked_fill(past_end, fill))) for fill in (0, VOCAB - 1)]
    for key in ("loss", "grad_norm", "ratio/mean"):
        assert steps[0][key] == steps[1][key], key


def test_the_megatron_learner_attends_through_sdpa_exactly_as_megatron_does(model_dirs, world):
    # megarl.learner.sdpa_attention: every layer's core attention is SDPAttention, and its fused forward and
    # backward give what megatron's own DotProductAttention gives, under the causal mask and the packed rows' one.
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megarl.learner.sdpa_attention import SDPAttention

    learner = _learner(model_dirs["qwen2"], "megatron", True)
    cores = [m for m in learner.gpt.modules() if isinstance(m, DotProductAttention)]
    assert cores and all(type(m) is SDPAttention for m in cores)
    core, width, rows = cores[0], 10, 3
    assert core.num_attention_heads_per_partition > core.num_query_groups_per_partition  # grouped-query attention
    gen = torch.Generator().manual_seed(0)
    shapes = [(width, rows, heads, core.hidden_size_per_attention_head) for heads in
              (core.num_attention_heads_per_partition, core.num_query_groups_per_partition,
               core.num_query_groups_per_partition)]
    causal = torch.ones(width, width, dtype=torch.bool).triu(1).view(1, 1, width, width)
    segments = torch.tensor([[0] * 4 + [1] * 5 + [-1], [0] * 10, [0] * 3 + [1] * 3 + [2] * 4])
    for mask in (causal, packing.attention_mask(segments)):
        outputs, grads = [], []
        for forward in (core.forward, lambda *a: DotProductAttention.forward(core, *a)):
            qkv = [torch.randn(s, generator=torch.Generator().manual_seed(i)).requires_grad_() for i, s in enumerate(shapes)]
            out = forward(*qkv, mask)
            out.backward(torch.randn(out.shape, generator=gen.manual_seed(9)))
            outputs.append(out.detach())
            grads.append([t.grad for t in qkv])
        torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)
        for fused, megatron in zip(*grads):
            torch.testing.assert_close(fused, megatron, atol=1e-5, rtol=1e-5)
