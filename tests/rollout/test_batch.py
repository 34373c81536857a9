"""Batch assembly and the staleness (max_lag) filter."""
import pytest
import torch

from megarl.algo.advantages import compute_advantages
from megarl.algo.config import AdvantageConfig
from megarl.config.length_limit import LengthLimit
from megarl.config.load import load_config
from megarl.protocols import Sample
from megarl.rollout.batch import assemble_batch, group_lag, is_stale, is_zero_variance, shaped_rewards


def sample(prompt_ids, token_ids, versions, reward):
    return Sample(group_id="g", prompt="p", completion="c", prompt_ids=prompt_ids, token_ids=token_ids,
                  logprobs=[-0.1 * (i + 1) for i in range(len(token_ids))], versions=versions, reward=reward,
                  finish_reason="stop")


def test_lag_is_measured_from_the_oldest_token_of_the_group():
    group = [sample([1], [2, 3], [5, 6], 1.0), sample([1], [2], [7], 0.0)]
    assert group_lag(group, learner_version=8) == 3
    assert not is_stale(group, learner_version=8, max_lag=3)
    assert is_stale(group, learner_version=9, max_lag=3)


def test_mask_tokens_drops_a_group_only_when_none_of_its_tokens_is_within_max_lag():
    group = [sample([1], [2, 3, 4], [3, 5, 6], 1.0), sample([1], [2], [4], 0.0)]
    # The oldest token is 5 versions behind: drop_group drops it; mask_tokens keeps it while a token is fresh.
    assert is_stale(group, learner_version=8, max_lag=2, policy="drop_group")
    assert not is_stale(group, learner_version=8, max_lag=2, policy="mask_tokens")
    assert is_stale(group, learner_version=8, max_lag=2)  # drop_group is the default
    assert is_stale(group, learner_version=9, max_lag=2, policy="mask_tokens")  # newest token 6: 3 behind
    episode = sample([1], [2, 9, 3], [7, -1, 7], 1.0)  # a tool token (-1) is not a version
    episode.env_spans = [(1, 2)]
    assert not is_stale([episode], learner_version=9, max_lag=2, policy="mask_tokens")
    with pytest.raises(ValueError, match="stale policy 'keep'"):
        is_stale(group, learner_version=8, max_lag=2, policy="keep")


def test_assembled_tensors_align_with_input_ids():
    groups = [[sample([1, 2], [3, 4, 5], [0, 0, 1], 1.0), sample([1, 2], [6], [1], 0.0)]]
    b, counts = assemble_batch(groups, AdvantageConfig(), pad_id=0, learner_version=2)
    assert counts["samples/kept"] == 2
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5], [1, 2, 6, 0, 0]]
    assert b.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]
    assert b.versions.tolist() == [[-1, -1, 0, 0, 1], [-1, -1, 1, -1, -1]]
    assert torch.allclose(b.behaviour_logprobs[0, 2:], torch.tensor([-0.1, -0.2, -0.3]))
    # GRPO with std normalisation: +1 / -1 for a two-sample group with rewards 1 and 0.
    assert b.advantages[0, 2:].tolist() == [b.advantages[0, 2].item()] * 3
    assert b.advantages[0, 2] > 0 > b.advantages[1, 2]
    assert b.advantages[1, 3:].abs().sum() == 0 and b.advantages[:, :2].abs().sum() == 0
    assert b.num_tokens == 4 and b.learner_version == 2


def test_truncated_samples_are_zero_weighted_but_keep_their_place_in_the_baseline():
    cut = sample([1], [2, 3], [0, 0], 0.0)
    cut.finish_reason = "length"
    groups = [[sample([1], [2], [0], 1.0), cut, sample([1], [4], [0], 0.0)]]
    b, counts = assemble_batch(groups, AdvantageConfig(drop_truncated=True), pad_id=0, learner_version=0)
    assert b.loss_mask[1].sum() == 0 and b.loss_mask[0].sum() == 1 and b.loss_mask[2].sum() == 1
    assert counts["samples/truncated_dropped"] == 1
    # the baseline still includes the cut sample's reward: mean 1/3
    assert b.advantages[2, 1] < 0 and b.advantages[0, 1] > 0


def test_zero_variance_groups_are_recognised():
    assert is_zero_variance([sample([1], [2], [0], 1.0)] * 3, AdvantageConfig())
    assert not is_zero_variance([sample([1], [2], [0], 1.0), sample([1], [2], [0], 0.0)], AdvantageConfig())


def test_overlong_shaping_takes_the_penalty_off_the_reward_before_the_group_baseline():
    """advantage.overlong_buffer: each sample's limit is min(max_new_tokens, max_seq_len - prompt); within `buffer`
    tokens of it the reward falls linearly, by the whole penalty at the limit. The advantages are the estimator's
    on the shaped rewards; a group of equal rewards but different lengths is no longer zero-variance."""
    cfg = AdvantageConfig(overlong_buffer=4, overlong_penalty=0.5)
    limit = LengthLimit(max_seq_len=12, cap=8, cap_key="sampling.max_new_tokens")
    short, near, cut = (sample([1, 2], [3] * n, [0] * n, 1.0) for n in (4, 6, 8))  # limit 8: ramp from 4
    long_prompt = sample([1] * 7, [3] * 5, [0] * 5, 1.0)  # max_seq_len 12 leaves it 5 tokens: ramp from 1
    group = [short, near, cut, long_prompt]
    rewards, penalty = shaped_rewards(group, cfg, limit)
    assert penalty.tolist() == [0.0, -0.25, -0.5, -0.5] and rewards.tolist() == [1.0, 0.75, 0.5, 0.5]
    b, counts = assemble_batch([group], cfg, pad_id=0, learner_version=0, length_limit=limit)
    expected = compute_advantages(torch.tensor([1.0, 0.75, 0.5, 0.5], dtype=torch.float64), torch.zeros(4).long(), cfg)
    first = [b.advantages[i, len(s.prompt_ids)].item() for i, s in enumerate(group)]  # on every completion token
    assert first == pytest.approx(expected.tolist())
    assert counts["samples/overlong_penalised"] == 3 and counts["reward/overlong_penalty_mean"] == -0.3125
    assert is_zero_variance(group, AdvantageConfig()) and not is_zero_variance(group, cfg, limit)
    assert "reward/overlong_penalty_mean" not in assemble_batch([group], AdvantageConfig(), 0, 0)[1]
    with pytest.raises(ValueError, match="overlong_buffer > 0 needs each sample's length limit"):
        assemble_batch([group], cfg, pad_id=0, learner_version=0)


def test_the_length_limit_is_the_task_s_max_new_tokens_or_an_episode_s_token_budget():
    single = LengthLimit.of(load_config(None, ["sampling.max_new_tokens=40", "sampler.max_seq_len=64"],
                                        check_files=False))
    assert (single.cap, single.cap_key, single.of_prompt(10), single.of_prompt(30)) == (
        40, "sampling.max_new_tokens", 40, 34)
    budget = LengthLimit.of(load_config(None, ["task.name=tool_arith", "task.max_episode_tokens=50",
                                               "sampler.max_seq_len=96"], check_files=False))
    assert (budget.cap_key, budget.of_prompt(20), budget.of_prompt(60)) == ("task.max_episode_tokens", 50, 36)
    context = LengthLimit.of(load_config(None, ["task.name=tool_arith", "sampler.max_seq_len=96"], check_files=False))
    assert (context.cap, context.cap_key, context.of_prompt(20)) == (None, "sampler.max_seq_len", 76)


def test_an_episode_s_environment_tokens_are_context_not_trained_and_do_not_count_for_staleness():
    episode = sample([1, 2], [10, 11, 90, 91, 92, 12], [4, 4, -1, -1, -1, 6], reward=1.0)
    episode.env_spans, episode.turns = [(2, 5)], 2
    other = sample([1, 2], [13], [5], reward=0.0)
    assert episode.oldest_version == 4 and episode.policy_versions == {4, 6}
    assert group_lag([episode, other], learner_version=7) == 3
    assert episode.spans() == [("model", 0, 2), ("env", 2, 5), ("model", 5, 6)]
    batch, _ = assemble_batch([[episode, other]], AdvantageConfig(), pad_id=0, learner_version=7)
    assert batch.input_ids[0].tolist() == [1, 2, 10, 11, 90, 91, 92, 12]  # the model saw the environment's tokens
    assert batch.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 1]
    assert batch.versions[0].tolist() == [-1, -1, 4, 4, -1, -1, -1, 6]
    advantage = batch.advantages[0, 2].item()
    assert advantage > 0 and batch.advantages[0, 7].item() == advantage  # one advantage for every model turn


def test_every_sample_lands_in_its_own_row_whatever_the_lengths():
    # Groups of random prompt / completion lengths (some completions empty, some cut and dropped, some multi-turn),
    # written one sample at a time as the reference: each row holds exactly its sample, padding elsewhere.
    import random

    rng = random.Random(0)
    groups = []
    for _ in range(6):
        group = []
        for _ in range(4):
            p, c = rng.randint(1, 7), rng.randint(0, 12)
            s = sample([rng.randint(3, 99) for _ in range(p)], [rng.randint(3, 99) for _ in range(c)],
                       [rng.randint(0, 5) for _ in range(c)], float(rng.random() < 0.5))
            if c >= 4 and rng.random() < 0.3:
                s.env_spans, s.versions[1:3] = [(1, 3)], [-1, -1]
            s.finish_reason = "length" if rng.random() < 0.2 else "stop"
            group.append(s)
        groups.append(group)
    cfg = AdvantageConfig(drop_truncated=True)
    b, _ = assemble_batch(groups, cfg, pad_id=0, learner_version=5)
    samples = [s for g in groups for s in g]
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.token_ids)
        kept = not (s.finish_reason == "length")
        assert b.input_ids[i].tolist() == s.prompt_ids + s.token_ids + [0] * (b.input_ids.shape[1] - p - c)
        assert b.versions[i, p:p + c].tolist() == s.versions and (b.versions[i, :p] == -1).all()
        assert (b.versions[i, p + c:] == -1).all()
        assert b.behaviour_logprobs[i, p:p + c].tolist() == torch.tensor(s.logprobs).tolist()
        assert b.behaviour_logprobs[i, :p].abs().sum() == 0 and b.behaviour_logprobs[i, p + c:].abs().sum() == 0
        assert b.loss_mask[i].tolist() == [0.0] * p + [float(kept and m) for m in s.model_token_mask()] + \
            [0.0] * (b.input_ids.shape[1] - p - c)
        assert (b.advantages[i, p:p + c] == b.advantages[i, p]).all() if c else True
        assert b.advantages[i, :p].abs().sum() == 0 and b.advantages[i, p + c:].abs().sum() == 0


def test_a_sample_with_fewer_logprobs_than_tokens_is_refused():
    short = sample([1], [2, 3], [0, 0], 1.0)
    short.logprobs = [-0.1]
    try:
        assemble_batch([[short, sample([1], [2], [0], 0.0)]], AdvantageConfig(), pad_id=0, learner_version=0)
    except ValueError as e:
        assert "token_ids, logprobs and versions differ in length (2, 1, 2)" in str(e)
    else:
        raise AssertionError("a short log-prob record was assembled")
