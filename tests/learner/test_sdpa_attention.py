"""megarl.learner.sdpa_attention's attention sinks and per-layer masks against transformers' gpt-oss eager attention
(fp32: the softmax over the scores and the sink logit, the sink dropped): outputs and the gradients of q, k, v and the
sinks, under causal, sliding-window and packed masks, with grouped-query heads."""
import types

import pytest
import torch

from megarl.learner import packing

HEADS, GROUPS, HEAD_DIM, WIDTH = 4, 2, 8, 10


@pytest.fixture(scope="module")
def core(world):
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    from megarl.learner.sdpa_attention import SDPAttention

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(num_layers=2, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=HEAD_DIM, attention_dropout=0.0,
                               softmax_type="learnable", use_cpu_initialization=True, perform_initialization=False)
    from megatron.core.transformer.enums import AttnMaskType

    module = SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    with torch.no_grad():
        module.softmax_offset.copy_(torch.tensor([-1.0, 0.5, 2.0, 0.0]))  # sinks that take a fair share
    return module


def _hf(q, k, v, mask, sinks):
    """transformers' gpt-oss eager attention on megatron's [S, B, heads, d] layout; `mask` bool, True = masked."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = types.SimpleNamespace(sinks=sinks, num_key_value_groups=HEADS // GROUPS, training=False)
    additive = torch.zeros(mask.shape).masked_fill(mask, torch.finfo(torch.float32).min)
    out, _ = eager_attention_forward(module, *(t.permute(1, 2, 0, 3) for t in (q, k, v)), additive,
                                     scaling=HEAD_DIM ** -0.5)
    return out.transpose(0, 1).reshape(q.shape[0], q.shape[1], -1)  # [B, S, H, d] -> [S, B, H * d]


def _packed_mask(window):
    rows = [[1, 2, 3, 4], [1, 2, 5, 6, 7], [8] * 10, [9, 9, 9], [9, 9, 8], [7, 7, 7, 7]]  # shared prefixes too
    mb = {"input_ids": torch.tensor([r + [0] * (10 - len(r)) for r in rows]), "mask": torch.zeros(6, 10)}
    packed = packing.pack(mb, torch.tensor([len(r) for r in rows]), bins=[[0, 1], [2], [3, 4, 5]], share_prefixes=True)
    return packing.attention_mask(packed, window=window)


@pytest.mark.parametrize("mask_kind", ["causal", "window", "packed", "packed_window"])
def test_sinks_match_transformers_eager_attention(core, mask_kind):
    mask = (packing.causal_mask(WIDTH, window=3 if mask_kind == "window" else None) if "packed" not in mask_kind
            else _packed_mask(3 if mask_kind == "packed_window" else None))
    rows = mask.shape[0] if "packed" in mask_kind else 2
    shapes = [(WIDTH, rows, h, HEAD_DIM) for h in (HEADS, GROUPS, GROUPS)]
    results = []
    for forward in (core.forward, lambda q, k, v, m: _hf(q, k, v, m, core.softmax_offset)):
        core.zero_grad()
        qkv = [torch.randn(s, generator=torch.Generator().manual_seed(i)).requires_grad_()
               for i, s in enumerate(shapes)]
        out = forward(*qkv, mask)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(9)))
        results.append((out.detach(), [t.grad for t in qkv], core.softmax_offset.grad.clone()))
    (ours, our_grads, our_sink_grad), (ref, ref_grads, ref_sink_grad) = results
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(our_grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(our_sink_grad, ref_sink_grad, atol=1e-5, rtol=1e-5)
    assert ref_sink_grad.abs().min() > 1e-4  # (each sink's gradient is there to compare)


def test_a_layer_attends_with_its_own_mask_of_a_stack(core):
    # use_layer_masks: a stacked [windows, B, 1, Q, K] mask, the layer's own index picks its mask
    full, window = packing.causal_mask(WIDTH), packing.causal_mask(WIDTH, window=2)
    qkv = [torch.randn(WIDTH, 1, h, HEAD_DIM, generator=torch.Generator().manual_seed(i))
           for i, h in enumerate((HEADS, GROUPS, GROUPS))]
    stacked = torch.stack([full, window])
    for index, mask in enumerate((full, window)):
        core.mask_index = index
        torch.testing.assert_close(core.forward(*qkv, stacked), _hf(*qkv, mask, core.softmax_offset.detach()),
                                   atol=1e-5, rtol=1e-5)
    core.mask_index = 0


def test_with_sinks_leaves_sdpa_its_fused_kernel():
    """q, k and v come out of with_sinks one width, a multiple of 8 (14 heads in 2 groups of 64 dims: 64 + 7 -> 72),
    which SDPA's fused CPU flash kernel takes (it computes the [Q, K] scores unfused otherwise); the context's first
    64 dims are the attention with sinks."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megarl.learner.sdpa_attention import with_sinks

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 6, 64, generator=gen) for h in (14, 2, 2))
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()
    sinks = torch.randn(14, generator=gen)
    q2, k2, v2, allowed2 = with_sinks(q, k, v, allowed, sinks, 0.125)
    assert q2.shape[-1] == k2.shape[-1] == v2.shape[-1] == 72 and allowed2.shape == (6, 7)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        fused = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, attn_mask=allowed2, scale=0.125,
                                                                 enable_gqa=True)[..., :64]
    module = types.SimpleNamespace(sinks=sinks, num_key_value_groups=7, training=False)
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    additive = torch.zeros(6, 6).masked_fill(~allowed, torch.finfo(torch.float32).min)
    ref, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.125)
    torch.testing.assert_close(fused, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def latent_core(world):
    """A core attention without sinks, as multi-latent attention uses it: q / k heads wider than v's."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megarl.learner.sdpa_attention import SDPAttention

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(num_layers=2, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               kv_channels=HEAD_DIM, attention_dropout=0.0, use_cpu_initialization=True,
                               perform_initialization=False)
    return SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                        k_channels=12, v_channels=HEAD_DIM)


def _packed_batch(width):
    rows = [[1, 2, 3, 4], [1, 2, 5, 6, 7], [8] * 10, [9, 9, 9], [9, 9, 8], [7, 7, 7, 7], [1, 2, 3, 9, 9, 9],
            [7, 7, 6]]  # shared prefixes, rows that share nothing, one fully shared prefix
    mb = {"input_ids": torch.tensor([r + [0] * (10 - len(r)) for r in rows]), "mask": torch.zeros(len(rows), 10)}
    packed = packing.pack(mb, torch.tensor([len(r) for r in rows]), bins=[[0, 1, 6, 2], [3, 4, 5, 7]],
                          share_prefixes=True)
    assert packed["packed_ids"].shape[1] <= width
    return packed


def _grads(module, forward, shapes, window):
    module.zero_grad()
    module.window = window
    qkv = [torch.randn(s, generator=torch.Generator().manual_seed(i)).requires_grad_() for i, s in enumerate(shapes)]
    out = forward(*qkv)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(9)))
    sinks = module.softmax_offset
    return out.detach(), [t.grad for t in qkv], None if sinks is None else sinks.grad.clone()


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("module_name", ["core", "latent_core"], ids=["sinks", "latent_dims"])
def test_layout_attention_in_query_blocks_equals_one_dense_mask(request, packed, window, module_name):
    """The attention layout path with blocks of 4 queries (several blocks, each over only its visible keys and
    recomputed in the backward) computes what one SDPA call with today's dense mask computes: outputs, the gradients
    of q, k, v and of the sinks, under causal and packed prefix-shared rows, a sliding window, sinks with grouped
    heads and multi-latent attention's wider q / k heads."""
    from megarl.learner import sdpa_attention

    module = request.getfixturevalue(module_name)
    width = 24  # (the packed rows are padded past their fill: added positions attend to themselves)
    mb = _packed_batch(width) if packed else None
    rows = mb["packed_ids"].shape[0] if packed else 2
    dense = (packing.attention_mask(mb, width, window=window) if packed
             else packing.causal_mask(width, window=window))
    layout = packing.attention_layout(mb, width)
    groups = module.num_query_groups_per_partition
    qk_dim = 12 if module_name == "latent_core" else HEAD_DIM
    shapes = [(width, rows, HEADS, qk_dim), (width, rows, groups, qk_dim), (width, rows, groups, HEAD_DIM)]
    calls = []

    def counted(*args):
        calls.append(args[0].shape[2])
        return type(module)._attend(module, *args)

    module._attend, module.block_elements = counted, layout.shape[0] * width * 4
    try:
        blocked = _grads(module, lambda q, k, v: module.forward(q, k, v, layout), shapes, window)
    finally:
        del module._attend
        module.block_elements = sdpa_attention.BLOCK_ELEMENTS
    assert calls == [4] * 12  # six blocks, each run once more in the backward
    reference = _grads(module, lambda q, k, v: module.forward(q, k, v, dense), shapes, window)
    module.window = None
    for ours, ref in zip(blocked, reference):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_layout_attention_under_context_parallelism_takes_its_own_queries(latent_core):
    """Under context parallelism's zig-zag split the queries are one rank's columns and the keys every rank's in
    the all-gathered order: the blocks (keys put in column order) equal one call with today's [local queries x all
    keys] mask."""
    from megarl.learner import context_parallel
    from megarl.learner.sdpa_attention import layout_attention

    width, cp, rank = 24, 2, 1
    mb = _packed_batch(width)
    rows = mb["packed_ids"].shape[0]
    mine, keys = context_parallel.local_columns(width, cp, rank), context_parallel.key_columns(width, cp)
    layout = packing.attention_layout(mb, width, keys=keys)
    own = layout[:, :, rank * len(mine):(rank + 1) * len(mine)]
    dense = packing.attention_mask(mb, width, window=3, queries=mine, keys=keys)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, h, n, HEAD_DIM, generator=gen).requires_grad_()
               for h, n in ((HEADS, len(mine)), (HEADS, width), (HEADS, width)))
    results = []
    for run in (lambda: layout_attention(q, k, v, own, layout, 3, latent_core._attend, rows * width * 3),
                lambda: latent_core._attend(q, k, v, ~dense)):
        for t in (q, k, v):
            t.grad = None
        out = run()
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(9)))
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for ours, ref in zip(*results):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_the_learner_in_query_blocks_takes_the_step_it_takes_in_one_block(tmp_path, world, monkeypatch):
    """The megatron learner on gpt-oss (a sliding-window layer and a full one, sinks) with packed prefix-shared rows,
    its attention in query blocks (BLOCK_ELEMENTS forced small) under selective recomputation (megatron recomputes
    the attention core, which recomputes its blocks inside), against the same learner attending in one block (one
    SDPA call with the whole mask, as a dense mask is attended): the log-probs before and after one step
    (LEARNER_TOL: the blocks reduce the softmax in another order only where rounding differs)."""
    from megarl.algo.config import LossConfig
    from megarl.config.schema import LearnerConfig
    from megarl.learner import sdpa_attention
    from megarl.learner.megatron import MegatronLearner
    from megarl.protocols import TrainBatch
    from tests.helpers import LEARNER_TOL, save_tiny_gpt_oss

    model_dir = str(save_tiny_gpt_oss(tmp_path / "gpt_oss"))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 64, (3,), generator=g)
    ids = torch.cat([prompt.expand(6, 3), torch.randint(1, 64, (6, 13), generator=g)], dim=1)
    ids[1, :6] = ids[0, :6]  # (a longer shared prefix)
    mask = torch.zeros(6, 16)
    for row, length in enumerate((16, 12, 9, 16, 7, 11)):
        mask[row, 3:length] = 1.0
        ids[row, length:] = 0
    batch = TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=-3.0 * mask,
                       versions=torch.where(mask > 0, 0, -1), advantages=torch.randn(6, 1, generator=g) * mask,
                       learner_version=0)
    results = []
    for block_elements in (sdpa_attention.BLOCK_ELEMENTS, 2 * 16 * 3):  # (the second: 3 queries of 2 packed rows)
        monkeypatch.setattr(sdpa_attention, "BLOCK_ELEMENTS", block_elements)
        learner = MegatronLearner(model_dir, LearnerConfig(micro_batch_size=8, lr=1e-2,
                                                           recompute_activations="selective"), LossConfig())
        before = learner.logprobs(ids)
        loss = learner.train_step(batch)["loss"]
        results.append((before, loss, learner.logprobs(ids)))
    (one_before, one_loss, one_after), (blocks_before, blocks_loss, blocks_after) = results
    torch.testing.assert_close(blocks_before, one_before, atol=LEARNER_TOL, rtol=0)
    assert blocks_loss == pytest.approx(one_loss, abs=LEARNER_TOL)
    torch.testing.assert_close(blocks_after, one_after, atol=LEARNER_TOL, rtol=0)
    assert (one_after - one_before).abs().max() > 100 * LEARNER_TOL  # (the step moved the log-probs)
