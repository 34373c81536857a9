"""Where a sampler assembles a group: MoE routes are checked against the model (megarl.roles.sampler_main),
and a multi-turn episode's routes cover every position (megarl.rollout.episode)."""
from __future__ import annotations

import numpy as np
import pytest

from megarl.protocols import Completion, Prompt, RouteShape, Sample
from megarl.roles.sampler_main import check_sample_routes
from megarl.rollout.episode import Episode

SHAPE = RouteShape(layers=2, top_k=2, num_experts=4)


def sample(routes) -> Sample:
    return Sample(group_id="g0", prompt="p", completion="c", prompt_ids=[1, 2, 3], token_ids=[4, 5], logprobs=[0.0] * 2,
                  versions=[0, 0], reward=1.0, finish_reason="stop", sampler_rank=1, routes=routes)


def test_routes_of_the_right_shape_pass_and_a_dense_model_checks_nothing():
    check_sample_routes([sample(np.zeros((4, 2, 2), np.uint8))], SHAPE, "r3", "builtin")
    check_sample_routes([sample(None)], SHAPE, "off", "sglang")  # replay off: an engine may record none
    check_sample_routes([sample(np.zeros((9, 9, 9), np.uint8))], None, "r3", "builtin")


@pytest.mark.parametrize("routes, why", [
    (np.zeros((5, 2, 2), np.uint8), r"shape \(5, 2, 2\), expected \(4, 2, 2\)"),
    (np.full((4, 2, 2), 4, np.uint8), "outside 0..3"),
    (None, "carries no routes"),
])
def test_wrong_or_missing_routes_stop_the_sampler_naming_its_engine(routes, why):
    with pytest.raises(ValueError, match=f"sampler.engine=sglang: .*{why}"):
        check_sample_routes([sample(routes)], SHAPE, "r3", "sglang")


def test_an_episode_carries_its_last_turns_routes_and_fills_the_positions_no_engine_computed():
    from megarl.embedded.tiny_chat import build_chat_tokenizer
    from megarl.rollout.chat import ChatTranscript

    chat = ChatTranscript(build_chat_tokenizer(), [{"role": "user", "content": "2*3"}])
    episode = Episode(key="g/0", prompt=Prompt("2*3", "6"), chat=chat, prompt_len=len(chat.ids))
    assert episode.sample_routes() is None
    prompt_ids, turn = list(chat.ids), [ord(c) for c in "6"] + [chat.ids[0] + 1]  # "6<|im_end|>"
    last_turn = (np.arange((len(prompt_ids) + 1) * 4, dtype=np.uint8) % 4).reshape(-1, 2, 2)
    episode.add_model_turn(Completion("g/0", prompt_ids, turn, [0.0] * 2, [0] * 2, "stop", routes=last_turn),
                           stop_token_ids=(chat.ids[0] + 1,))
    np.testing.assert_array_equal(episode.sample_routes(), last_turn)  # the turn computed every position
    # An environment turn, then the episode ends (truncated by a limit): no engine computed those positions.
    episode.add_environment_turn(chat.prepare([{"role": "tool", "content": "6"}]))
    routes = episode.sample_routes()
    assert routes.shape == (len(chat.ids) - 1, 2, 2) and routes.dtype == np.uint8
    np.testing.assert_array_equal(routes[:len(last_turn)], last_turn)
    np.testing.assert_array_equal(routes[len(last_turn):], [[[0, 1]] * 2] * (len(routes) - len(last_turn)))
