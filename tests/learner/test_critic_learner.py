"""The critic of advantage.estimator=gae on the megatron learner (one gloo rank): GAE advantages drive the policy
step, the critic learns its value targets, warm-up trains only the critic, and a checkpoint carries it."""
import torch

from megarl.algo import values
from megarl.algo.config import CriticConfig, LossConfig
from megarl.protocols import TrainBatch
from tests.helpers import save_tiny_qwen2

VOCAB, B, S, PROMPT = 64, 16, 14, 4


def _learner(model_dir, **critic):
    from megarl.config.schema import LearnerConfig
    from megarl.learner.megatron import MegatronLearner

    return MegatronLearner(model_dir, LearnerConfig(micro_batch_size=8, lr=1e-3), LossConfig(),
                           critic_cfg=CriticConfig(lr=1e-2, **critic))


def _batch(learner, seed=0):
    """Rows with an environment span inside the completion (multi-turn), rewards on the last model token,
    behaviour log-probs from two 'versions' (a shift half-way through each completion)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    mask = torch.zeros(B, S)
    for b in range(B):
        mask[b, PROMPT:S - b % 4] = 1.0
        if b % 2:
            mask[b, PROMPT + 3:PROMPT + 5] = 0.0  # environment tokens
    pi = learner.logprobs(ids)
    mu = torch.where(torch.arange(S) < PROMPT + 4, pi, pi + 0.3) * mask
    versions = torch.where(mask > 0, torch.where(torch.arange(S) < PROMPT + 4, 0, 1), -1)
    rewards = values.terminal_rewards((ids[:, PROMPT] % 2).float(), mask)  # learnable from the first token
    return TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=mu, versions=versions,
                      advantages=torch.zeros(B, S), learner_version=1, rewards=rewards)


def _policy_weights(learner):
    return {k: v.detach().clone() for k, v in learner.gpt.state_dict().items() if torch.is_tensor(v)}


def test_critic_learns_and_warmup_trains_only_the_critic(tmp_path, world):
    model_dir = str(save_tiny_qwen2(tmp_path / "m", tie_word_embeddings=True, vocab_size=VOCAB))
    learner = _learner(model_dir, warmup_steps=1, target="gae", gamma=1.0, lam=1.0)
    batch = _batch(learner)
    before = _policy_weights(learner)
    losses = []
    for i in range(4):
        m = learner.train_step(batch)
        losses.append(m["critic/value_loss"])
        assert m["critic/warmup"] == float(i < 1)
        if i == 0:  # a warm-up step: the critic moved, the policy did not (and kept its version)
            assert learner.version == 0 and learner.critic.steps == 1
            assert all(torch.equal(before[k], v) for k, v in _policy_weights(learner).items())
    assert learner.version == 3 and learner.critic.steps == 4
    assert any(not torch.equal(before[k], v) for k, v in _policy_weights(learner).items())
    assert losses[-1] < 0.5 * losses[0], losses
    for key in ("critic/explained_var", "lag0/critic_explained_var", "lag1/critic_return_mean", "ratio/mean"):
        assert key in m, key


def test_gae_advantages_replace_the_batch_and_targets_follow_the_setting(tmp_path, world):
    """prepare(): advantages are the (whitened) GAE of the critic's values on model tokens only; vtrace targets
    differ from gae returns exactly where pi != mu."""
    from megarl.learner import step

    model_dir = str(save_tiny_qwen2(tmp_path / "m", tie_word_embeddings=True, vocab_size=VOCAB))
    learner = _learner(model_dir, target="vtrace", whiten=False, gamma=0.9, lam=0.8)
    batch = _batch(learner)
    fields = step.dp_share(batch, 1, 0)
    micro = step.micro_batches(fields, 8)
    step.attach_extra_logprobs(micro, {"proximal_logprobs": learner.model}, learner._forward_logprobs)
    learner.critic.model.head.bias.data.fill_(0.25)  # nonzero values, so the recursion has something to bootstrap
    learner.critic.prepare(micro)
    for mb in micro:
        v = learner.critic.model(mb["input_ids"]).detach()
        adv, ret = values.gae(mb["rewards"], v, mb["mask"], 0.9, 0.8)
        torch.testing.assert_close(mb["advantages"], adv)
        target = values.vtrace_targets(mb["rewards"], v, mb["mask"], mb["proximal_logprobs"] - mb["behaviour_logprobs"],
                                       0.9, 0.8, 1.0, 1.0)
        torch.testing.assert_close(mb["value_targets"], target)
        assert not torch.allclose(target, ret)  # the second 'version' is off-policy
        assert float(mb["advantages"][mb["mask"] == 0].abs().sum()) == 0.0


def test_checkpoint_carries_the_critic(tmp_path, world):
    from megarl.checkpoint import learner_state

    model_dir = str(save_tiny_qwen2(tmp_path / "m", tie_word_embeddings=True, vocab_size=VOCAB))
    learner = _learner(model_dir)
    learner.train_step(_batch(learner))
    path = learner_state.save(learner, tmp_path / "ckpt", 1, 2, model_dir, {})
    fresh = _learner(model_dir)
    learner_state.load(fresh, path)
    assert fresh.critic.steps == 1
    for (name, a), b in zip(learner.critic.model.state_dict().items(), fresh.critic.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh.critic.optimizer.state_dict()["state"].keys() == learner.critic.optimizer.state_dict()["state"].keys()
    # The resumed critic steps exactly like the original.
    batch = _batch(learner, seed=1)
    torch.testing.assert_close(fresh.train_step(batch)["critic/value_loss"], learner.train_step(batch)["critic/value_loss"])
