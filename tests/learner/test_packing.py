"""Sequence packing (megarl/learner/packing.py): a micro-batch's rows placed end to end in fewer rows, each row kept
to its own positions by the attention mask and read back in the rows' layout. On both learner backends (one gloo
rank, in this process) a packed forward gives transformers' own per-row log-probs, and a packed step the unpacked
step's loss, grad norm and weights; an MoE model under routing replay gets each row's recorded routes. The megatron
learner's fused attention (SDPA) computes what megatron's own does under both masks."""
import dataclasses
import random

import pytest
import torch

from megarl.algo.config import LossConfig
from megarl.learner import packing, step
from megarl.protocols import TrainBatch
from tests.helpers import save_tiny_deepseek_v3, save_tiny_dense, save_tiny_gpt_oss, save_tiny_moe, save_tiny_qwen2

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


def _attended(p, b, t):
    """The flat packed positions that row b's position t attends to (its packed row's mask)."""
    width = p["packed_ids"].shape[1]
    q = int(p["unpack_index"][b, t])
    allowed = ~packing.attention_mask(p)[q // width, 0, q % width]
    return {q // width * width + int(c) for c in torch.nonzero(allowed)[:, 0]}


def _assert_rows_read_back(p, mb, lengths):
    """Every real position reads back its own token and position within its row, and attends exactly to its row's
    positions up to it."""
    n, w = mb["input_ids"].shape
    real = torch.arange(w) < lengths[:, None]
    assert torch.equal(packing.unpack(p["packed_ids"], p["unpack_index"])[real], mb["input_ids"][real])
    assert torch.equal(packing.unpack(p["packed_positions"], p["unpack_index"])[real], torch.arange(w).expand(n, w)[real])
    for b in range(n):
        for t in range(int(lengths[b])):
            assert _attended(p, b, t) == {int(p["unpack_index"][b, s]) for s in range(t + 1)}, (b, t)


def test_pack_places_each_row_and_unpack_reads_it_back():
    mb = _rows(LENGTHS, S)
    lengths = step.sequence_lengths(mb["mask"])
    assert lengths.tolist() == LENGTHS
    p = packing.pack(mb, lengths)
    rows, width = p["packed_ids"].shape
    assert width == max(LENGTHS) and rows * width < B * S and rows * width >= sum(LENGTHS)
    real = torch.arange(S) < lengths[:, None]
    _assert_rows_read_back(p, mb, lengths)
    assert torch.equal(packing.unpack(p["packed_routes"], p["unpack_index"])[real], mb["routes"][real])
    # Each row its own positions, consecutive in one packed row; unplaced positions hold nothing, attend to themselves.
    placed = p["unpack_index"][real]
    assert len(set(placed.tolist())) == sum(LENGTHS)
    for b in range(B):
        assert torch.equal(p["unpack_index"][b, :LENGTHS[b]], p["unpack_index"][b, 0] + torch.arange(LENGTHS[b]))
    empty = torch.ones(rows * width, dtype=torch.bool)
    empty[placed] = False
    assert int(empty.sum()) == rows * width - sum(LENGTHS) and not p["packed_ids"].view(-1)[empty].any()
    assert torch.equal(p["packed_routes"].view(rows * width, 2, 2)[empty],
                       torch.arange(2, dtype=torch.uint8).expand(int(empty.sum()), 2, 2))
    for q in torch.nonzero(empty)[:, 0].tolist():
        assert torch.nonzero(~packing.attention_mask(p)[q // width, 0, q % width])[:, 0].tolist() == [q % width]
    assert set(packing.unpacked(p)) == set(mb)
    with pytest.raises(ValueError, match="exactly once"):
        packing.pack(mb, lengths, [[0, 1], [1]])


def test_rows_that_begin_alike_share_those_positions():
    """A group's rows: one prompt, completions that agree on their first tokens (one repeated whole). Each distinct
    prefix is one packed position; every row still reads back its own tokens and positions and attends to exactly
    its own path. Rows carrying routes (routing replay) share nothing."""
    prompt = [5, 6, 7]
    completions = [[10, 11, 12], [10, 11], [10, 11, 12], [10, 13, 14, 15], [20], [10, 11, 12, 16]]
    other = [[9, 6, 7, 30, 31]]  # another prompt: nothing in common
    rows = [prompt + c for c in completions] + other
    n, w = len(rows), max(map(len, rows))
    mb = {"input_ids": torch.tensor([r + [0] * (w - len(r)) for r in rows]), "mask": torch.zeros(n, w)}
    lengths = torch.tensor([len(r) for r in rows])
    p = packing.pack(mb, lengths, bins=[[1, 0, 2, 5, 3, 4], [6]], share_prefixes=True)  # the group, lexicographic
    distinct = {tuple(r[:t + 1]) for r in rows for t in range(len(r))}
    assert len(set(p["unpack_index"][torch.arange(w) < lengths[:, None]].tolist())) == len(distinct) == 16
    assert p["packed_ids"].shape[1] == 11  # the group's 11 distinct prefixes in one packed row
    _assert_rows_read_back(p, mb, lengths)
    assert torch.equal(p["unpack_index"][0], p["unpack_index"][2])  # identical rows: the same positions
    assert int(p["unpack_index"][1, 4]) == int(p["unpack_index"][0, 4])  # [5, 6, 7, 10, 11] once
    p = packing.pack(mb, lengths, share_prefixes=True)  # default bins: never wider than the longest row
    assert p["packed_ids"].shape[1] == w
    _assert_rows_read_back(p, mb, lengths)
    # As the learner cuts a batch: lexicographic bins within the capacity, then laid out by them.
    bins = packing.prefix_sharing_bins(rows, 8)
    assert sorted(i for b in bins for i in b) == list(range(n))
    assert packing.prefix_sharing_bins([[1, 2], [1, 3], [1, 2]], 3) == [[0, 2, 1]]
    assert packing.prefix_sharing_bins([[5, 1], [4], [6, 1, 1]], 3) == [[2], [0, 1]]  # nothing shared: first fit
    with pytest.raises(ValueError, match="row 0 of 4 positions does not fit a packed row of 3"):
        packing.prefix_sharing_bins([[1, 2, 3, 4]], 3)
    routed = {**mb, "routes": torch.zeros(n, w, 2, 2, dtype=torch.uint8)}
    p = packing.pack(routed, lengths, share_prefixes=True)
    assert len(set(p["unpack_index"][torch.arange(w) < lengths[:, None]].tolist())) == int(lengths.sum())


def test_token_values_are_read_from_the_position_that_predicts_each_row_token():
    rows = [[1, 2, 3], [1, 2, 4], [1, 5]]
    mb = {"input_ids": torch.tensor([[1, 2, 3], [1, 2, 4], [1, 5, 0]]), "mask": torch.zeros(3, 3)}
    p = packing.pack(mb, torch.tensor([3, 3, 2]), share_prefixes=True)
    width = p["packed_ids"].shape[1]
    logits = torch.randn(*p["packed_ids"].shape, 8, generator=torch.Generator().manual_seed(0))
    logp = torch.log_softmax(logits.view(-1, 8), -1)
    got = packing.token_logprobs(logits, p, temperature=1.0)
    for b, row in enumerate(rows):
        assert float(got[b, 0]) == 0.0
        for t in range(1, len(row)):
            before = int(p["unpack_index"][b, t - 1])
            assert float(got[b, t]) == float(logp[before, row[t]])
    values = torch.arange(p["packed_ids"].numel(), dtype=torch.float32).view(-1, width)
    assert packing.next_token_values(values, p)[:, 1:].tolist() == p["unpack_index"][:, :-1].float().tolist()
    assert packing.next_token_values(values, mb)[:, 1:].tolist() == values[:, :-1].tolist()  # unpacked: shifted


def test_attention_mask_widens_with_positions_that_attend_to_themselves():
    mb = {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 0]]), "mask": torch.zeros(2, 3)}
    p = packing.pack(mb, torch.tensor([3, 2]), bins=[[0], [1]])
    attended = ~packing.attention_mask(p, 4)[:, 0]
    assert attended[0].tolist() == [[True, False, False, False], [True, True, False, False],
                                    [True, True, True, False], [False, False, False, True]]
    assert attended[1].tolist() == [[True, False, False, False], [True, True, False, False],
                                    [False, False, True, False], [False, False, False, True]]
    additive = packing.additive_attention_mask(p, torch.float32)[:, 0]
    assert torch.equal(additive == 0, attended[:, :3, :3]) and float(additive.min()) == torch.finfo(torch.float32).min


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
        assert (step.position_metrics(fields, micro)["padding_frac"]
                < step.position_metrics(fields, unpacked)["padding_frac"])
    assert len(step.micro_batches(fields, 64, pack=True)) == 1
    # Groups of 8 rows with one prompt each: with sharing, a packed row computes each distinct prefix of its rows once.
    grouped = {**fields, "input_ids": fields["input_ids"].clone()}
    grouped["input_ids"][:, :PROMPT] = (torch.arange(96) // 8)[:, None]
    computed = {}
    for share in (False, True):
        micro = step.micro_batches({k: v for k, v in grouped.items() if k != "routes"}, 8, 0, pack=True,
                                   share_prefixes=share)
        assert sorted(int(r) for mb in micro for r in mb["row"][:, 0]) == list(range(96))
        computed[share] = 0
        for mb in micro:
            rows, width = mb["packed_ids"].shape
            lengths = step.sequence_lengths(mb["mask"])
            assert rows <= 8 and width <= S
            _assert_rows_read_back(mb, mb, lengths)
            real = torch.arange(mb["input_ids"].shape[1]) < lengths[:, None]
            computed[share] += len(set(mb["unpack_index"][real].tolist()))
            if share:
                packed_row = mb["unpack_index"][:, 0] // width
                distinct = {(int(packed_row[b]), tuple(mb["input_ids"][b, :t + 1].tolist()))
                            for b in range(len(lengths)) for t in range(int(lengths[b]))}
                assert len(set(mb["unpack_index"][real].tolist())) == len(distinct)
    assert computed[False] == int(step.sequence_lengths(grouped["mask"]).sum()) > computed[True]
    # Routes (routing replay) in the fields: nothing is shared.
    micro = step.micro_batches(grouped, 8, 0, pack=True, share_prefixes=True)
    assert sum(len(set(mb["unpack_index"][mb["mask"] > 0].tolist())) for mb in micro) == int((grouped["mask"] > 0).sum())
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
            "mixtral": str(save_tiny_moe(root / "mixtral", "mixtral", vocab_size=VOCAB)),
            "mistral": str(save_tiny_dense(root / "mistral", "mistral", vocab_size=VOCAB)),
            "gemma3": str(_save_tiny_gemma3(root / "gemma3")),
            "gemma3_pattern": str(_without_layer_types(_save_tiny_gemma3(root / "gemma3_pattern"))),
            "gpt_oss": str(save_tiny_gpt_oss(root / "gpt_oss", vocab_size=VOCAB)),
            "deepseek_v3": str(save_tiny_deepseek_v3(root / "deepseek_v3", vocab_size=VOCAB))}


def _without_layer_types(path):
    """The Gemma 3 directory's config.json as the hub's first Gemma 3 releases wrote theirs: the layer kinds given by
    sliding_window_pattern (here 2: a local layer, then a global one), no layer_types."""
    import json

    cfg = json.loads((path / "config.json").read_text())
    del cfg["layer_types"]
    cfg["sliding_window_pattern"] = 2
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _save_tiny_gemma3(path):
    """A Gemma 3 text model whose first layer slides over 4 positions, shorter than most rows, and whose second attends
    to all: each layer type needs its own mask in a packed row."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    Gemma3ForCausalLM(Gemma3TextConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, sliding_window=4, initializer_range=0.1,
        pad_token_id=None, layer_types=["sliding_attention", "full_attention"])).save_pretrained(path)
    return path


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


def _batch(model_dir, groups=False):
    """Long-tailed rows trained at lag 0 (behaviour = transformers' log-probs) with random advantages; with `groups`,
    every 4 rows one prompt and completions that follow their group's first row for a while (shared prefixes)."""
    fields = _rows(LENGTHS, S, seed=2)
    if groups:
        ids, g = fields["input_ids"], torch.Generator().manual_seed(4)
        for r in range(B):
            lead = r - r % 4
            follow = PROMPT + int(torch.randint(0, S - PROMPT, (), generator=g)) if r != lead else S
            ids[r, :follow] = ids[lead, :follow]
    behaviour, routes = _hf_forward(model_dir, fields["input_ids"])
    mask = fields["mask"]
    adv = torch.randn(B, 1, generator=torch.Generator().manual_seed(3)).expand(B, S) * mask
    batch = TrainBatch(input_ids=fields["input_ids"], loss_mask=mask, behaviour_logprobs=behaviour * mask,
                       versions=torch.where(mask > 0, 0, -1), advantages=adv, learner_version=0, routes=routes)
    return batch, behaviour


@pytest.mark.parametrize("backend,kind", [(backend, kind) for backend in ("megatron", "deepspeed")
                                          for kind in ("qwen2", "qwen2 groups", "mixtral", "mistral groups",
                                                       "gemma3 groups", "gpt_oss")]
                         + [("deepspeed", "gemma3_pattern groups")]
                         + [("megatron", "deepseek_v3 groups")])  # (multi-latent attention: RoPE by position id)
def test_a_packed_step_is_the_unpacked_step(model_dirs, world, local_rank, backend, kind):
    """Packed micro-batches (several rows per packed row; rows of a group sharing their common prefixes) give
    transformers' per-row log-probs at every trained position, and the step the unpacked one's loss, grad norm and
    weights; an MoE learner under r3 replays each row's recorded routes at its packed positions (agreement 1); a
    sliding window (Mistral's, shorter than most rows) counts each row's own positions, not packed columns, and
    Gemma 3's local and global layers (their kinds from layer_types, or from the older sliding_window_pattern) and
    gpt-oss's sliding and full layers each get their own mask."""
    replay = "r3" if kind == "mixtral" else "off"
    model_dir = model_dirs[kind.split()[0]]
    batch, behaviour = _batch(model_dir, groups=kind.endswith("groups"))
    if replay == "off" and batch.routes is not None:  # (routes travel only under r3; rows with routes share nothing)
        batch = dataclasses.replace(batch, routes=None)
    packed = _learner(model_dir, backend, pack=True, routing_replay=replay)
    micro = step.micro_batches(step.dp_share(batch, 1, 0), 6, pack=True, share_prefixes=True)
    assert sum(mb["packed_ids"].shape[0] for mb in micro) < B / 2  # packed rows hold several rows each
    shared = step.position_metrics(step.dp_share(batch, 1, 0), micro)["shared_frac"]
    assert shared > 0.2 if kind.endswith("groups") else shared < 0.05  # random rows: a first token in common at most
    model = packed.engine if backend == "deepspeed" else packed.model
    for mb, lp in zip(micro, packed._forward_logprobs(model, micro)):
        width = mb["input_ids"].shape[1]
        rows = [int(torch.nonzero((batch.input_ids[:, :width] == row).all(1))[0]) for row in mb["input_ids"]]
        real = mb["mask"] > 0
        assert float((lp - behaviour[rows, :width])[real].abs().max()) <= 1e-5
    unpacked = _learner(model_dir, backend, pack=False, routing_replay=replay)
    got, want = packed.train_step(batch), unpacked.train_step(batch)
    computed = {name: sum(packing.model_input_ids(mb).numel() for mb in mbs)
                for name, mbs in (("packed", micro), ("unpacked", step.micro_batches(step.dp_share(batch, 1, 0), 6)))}
    if kind.endswith("groups"):
        assert computed["packed"] < computed["unpacked"] / 2
    else:
        assert got["padding_frac"] < want["padding_frac"] / 2
    assert got["shared_frac"] == shared and want["shared_frac"] == 0.0
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
    # backward give what megatron's own DotProductAttention gives, under the causal mask and packed rows' one
    # (rows sharing prefixes: each position attends to its path).
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
    rows = [[1, 2, 3, 4], [1, 2, 5, 6, 7], [8] * 10, [9, 9, 9], [9, 9, 8], [7, 7, 7, 7]]  # shared prefixes too
    mb = {"input_ids": torch.tensor([r + [0] * (10 - len(r)) for r in rows]), "mask": torch.zeros(6, 10)}
    packed = packing.pack(mb, torch.tensor([len(r) for r in rows]), bins=[[0, 1], [2], [3, 4, 5]], share_prefixes=True)
    for mask in (causal, packing.attention_mask(packed)):
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


@pytest.mark.parametrize("seed", range(4))
def test_attention_layout_says_exactly_what_the_dense_masks_say(seed):
    """packing.layout_mask of attention_layout equals attention_mask (packed rows, shared prefixes, any bins, padded
    widths, sliding windows, a context-parallel rank's queries against every rank's keys) and causal_mask: the
    prefix tree `pack` lays out is in preorder, so a position's descendants are the columns up to its subtree end."""
    import random

    from megarl.learner import context_parallel

    rng = random.Random(seed)
    for _ in range(25):
        rows: list[list[int]] = []
        for _ in range(rng.randint(1, 8)):
            base = rows[rng.randrange(len(rows))] if rows and rng.random() < 0.6 else []
            keep = base[:rng.randint(0, len(base))]
            rows.append(keep + [rng.randint(1, 3) for _ in range(rng.randint(0 if keep else 1, 6))])
        w = max(map(len, rows)) + rng.randint(0, 3)
        mb = {"input_ids": torch.tensor([r + [0] * (w - len(r)) for r in rows]), "mask": torch.zeros(len(rows), w)}
        order = list(range(len(rows)))
        rng.shuffle(order)
        cut = rng.randint(1, len(rows))
        bins = [b for b in (order[:cut], order[cut:]) if b] if rng.random() < 0.5 else None
        packed = packing.pack(mb, torch.tensor([len(r) for r in rows]), bins=bins, share_prefixes=rng.random() < 0.7)
        width = packed["packed_ids"].shape[1] + rng.randint(0, 4)
        width += -width % 4  # cut into 2 * cp = 4 chunks
        keys = context_parallel.key_columns(width, 2)
        for window in (None, 1, 3):
            for mb_or_none, dense in ((packed, packing.attention_mask(packed, width, window=window)),
                                      (None, packing.causal_mask(width, window=window))):
                layout = packing.attention_layout(mb_or_none, width)
                assert torch.equal(packing.layout_mask(layout, layout, window), dense)
            gathered = packing.attention_layout(packed, width, keys=keys)
            mine = context_parallel.local_columns(width, 2, 1)
            assert torch.equal(packing.layout_mask(gathered[:, :, len(mine):], gathered, window),
                               packing.attention_mask(packed, width, window=window, queries=mine, keys=keys))
