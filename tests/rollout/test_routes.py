"""Packing a batch's MoE routes: aligned with input_ids, filled where no route exists, refused naming the sampler."""
import numpy as np
import pytest
import torch

from megarl.protocols import Sample
from megarl.models import moe
from megarl.protocols import RouteShape
from megarl.rollout.routes import pack_routes

SHAPE = RouteShape(layers=2, top_k=2, num_experts=4)


def _sample(prompt_len, tokens, routes=..., rank=3):
    s = Sample(group_id="g7", prompt="p", completion="c", prompt_ids=[1] * prompt_len, token_ids=[2] * tokens,
               logprobs=[-1.0] * tokens, versions=[0] * tokens, reward=1.0, finish_reason="stop", sampler_rank=rank)
    positions = prompt_len + tokens - 1
    rng = np.random.default_rng(prompt_len + tokens)
    s.routes = (np.stack([np.stack([rng.permutation(4)[:2] for _ in range(2)]) for _ in range(positions)])
                .astype(np.uint8) if routes is ... else routes)
    return s


def test_routes_are_aligned_with_input_ids_and_filled_after_the_last_input():
    a, b = _sample(3, 4), _sample(2, 2)
    packed = pack_routes([a, b], width=7, shape=SHAPE, required=True)
    assert packed.shape == (2, 7, 2, 2) and packed.dtype == torch.uint8
    assert torch.equal(packed[0, :6], torch.from_numpy(a.routes))
    assert torch.equal(packed[1, :3], torch.from_numpy(b.routes))
    # the last token of each sample (never an input to a trained log-prob) and the padding: experts 0, 1
    assert torch.equal(packed[1, 3:], torch.tensor([0, 1], dtype=torch.uint8).expand(4, 2, 2))
    assert torch.equal(packed[0, 6:], torch.tensor([0, 1], dtype=torch.uint8).expand(1, 2, 2))


def test_dense_models_and_unrecorded_routes_without_replay_pack_nothing():
    assert pack_routes([_sample(3, 4)], 7, None, required=False) is None
    assert pack_routes([_sample(3, 4), _sample(3, 4, routes=None)], 7, SHAPE, required=False) is None


@pytest.mark.parametrize("routes, message", [
    (None, "sample 'g7' from sampler rank 3 carries no routes"),
    (np.zeros((5, 2, 2), np.uint8), r"sample 'g7' from sampler rank 3: routes of shape \(5, 2, 2\), expected \(6, 2, 2\)"),
    (np.zeros((6, 1, 2), np.uint8), r"expected \(6, 2, 2\)"),
    (np.full((6, 2, 2), 4, np.uint8), "routes name experts outside 0..3"),
    (np.zeros((6, 2, 2), np.float32), "routes of dtype float32"),
])
def test_bad_routes_under_replay_stop_naming_the_sampler_rank(routes, message):
    with pytest.raises(ValueError, match=message):
        pack_routes([_sample(3, 4), _sample(3, 4, routes=routes)], 7, SHAPE, required=True)


def test_routes_travel_as_int16_past_255_experts():
    assert RouteShape(layers=1, top_k=8, num_experts=256).dtype == torch.int16
    assert moe.route_shape({"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8,
                          "num_hidden_layers": 48}) == RouteShape(48, 8, 128)
    assert moe.route_shape({"model_type": "qwen2"}) is None
