"""The critic of advantage.estimator=gae on both learner backends (one gloo rank, in this process): GAE advantages
drive the policy step, the critic learns its value targets, warm-up trains only the critic, both backends take the
same critic step, a checkpoint carries it, its export is a transformers token-classification model giving the
learner's values, and a critic model that cannot work is refused naming algo.critic.model.
(The DeepSpeed learner's critic over two ranks, resumed and exported: tests/learner/test_deepspeed.py.)"""
import json

import pytest
import torch

from megarl.algo import values
from megarl.algo.config import CriticConfig, LossConfig
from megarl.protocols import TrainBatch
from tests.helpers import save_tiny_qwen2

VOCAB, B, S, PROMPT = 64, 16, 14, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_qwen2(tmp_path_factory.mktemp("critic") / "m", tie_word_embeddings=True, vocab_size=VOCAB))


@pytest.fixture
def local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")  # what DeepSpeed asks a launcher for


def _learner(model_dir, backend="megatron", **critic):
    from megarl.config.schema import LearnerConfig

    cfg = LearnerConfig(backend=backend, micro_batch_size=8, lr=1e-3)
    if backend == "deepspeed":
        from megarl.learner.deepspeed import DeepSpeedLearner

        return DeepSpeedLearner(model_dir, cfg, LossConfig(), critic_cfg=CriticConfig(lr=1e-2, **critic))
    from megarl.learner.megatron import MegatronLearner

    return MegatronLearner(model_dir, cfg, LossConfig(), critic_cfg=CriticConfig(lr=1e-2, **critic))


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
    module = learner.module if hasattr(learner, "engine") else learner.gpt
    return {k: v.detach().clone() for k, v in module.state_dict().items() if torch.is_tensor(v)}


@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_critic_learns_and_warmup_trains_only_the_critic(model_dir, world, local_rank, backend):
    learner = _learner(model_dir, backend, warmup_steps=1, target="gae", gamma=1.0, lam=1.0)
    batch = _batch(learner)
    before = _policy_weights(learner)
    losses = []
    for i in range(4):
        m = learner.train_step(batch)
        losses.append(m["critic/value_loss"])
        assert m["critic/warmup"] == float(i < 1) and m["skipped_nonfinite"] == 0.0
        if i == 0:  # a warm-up step: the critic moved, the policy did not (and kept its version)
            assert learner.version == 0 and learner.critic.steps == 1
            assert all(torch.equal(before[k], v) for k, v in _policy_weights(learner).items())
    assert learner.version == 3 and learner.critic.steps == 4
    assert any(not torch.equal(before[k], v) for k, v in _policy_weights(learner).items())
    assert losses[-1] < 0.5 * losses[0], losses
    for key in ("critic/explained_var", "lag0/critic_explained_var", "lag1/critic_return_mean", "ratio/mean"):
        assert key in m, key


def test_both_backends_take_the_same_critic_step(model_dir, world, local_rank):
    """Same weights, same batch (V-trace targets, value clip): the DeepSpeed learner's critic step and the policy
    loss it drives equal the megatron learner's (the shared megarl.learner.critic, the backend only feeds it)."""
    critic = {"target": "vtrace", "value_clip": 0.2, "gamma": 0.9}
    ref = _learner(model_dir, "megatron", **critic)
    batch = _batch(ref)
    want = ref.train_step(batch)
    got = _learner(model_dir, "deepspeed", **critic).train_step(batch)
    for key in ("loss", "grad_norm", "critic/value_loss", "critic/grad_norm", "critic/explained_var",
                "critic/value_mean", "lag1/critic_return_mean"):
        assert abs(got[key] - want[key]) <= 1e-5 * max(1.0, abs(want[key])), (key, got[key], want[key])


def test_gae_advantages_replace_the_batch_and_targets_follow_the_setting(model_dir, world):
    """prepare(): advantages are the (whitened) GAE of the critic's values on model tokens only; vtrace targets
    differ from gae returns exactly where pi != mu."""
    from megarl.learner import step

    learner = _learner(model_dir, target="vtrace", whiten=False, gamma=0.9, lam=0.8)
    batch = _batch(learner)
    fields = step.dp_share(batch, 1, 0)
    micro = step.micro_batches(fields, 8)
    step.attach_extra_logprobs(micro, {"proximal_logprobs": learner.model}, learner._forward_logprobs)
    learner.critic.model.net.score.bias.data.fill_(0.25)  # nonzero values, so the recursion has something to bootstrap
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


def test_checkpoint_carries_the_critic_and_export_gives_its_values(model_dir, tmp_path, world):
    from transformers import AutoModelForTokenClassification

    from megarl.checkpoint import learner_state
    from megarl.checkpoint.export import export_hf
    from megarl.learner.critic import Critic

    learner = _learner(model_dir)
    learner.train_step(_batch(learner))
    path = learner_state.save(learner, tmp_path / "ckpt", 1, 2, model_dir, {})
    fresh = _learner(model_dir)
    learner_state.load(fresh, path)
    assert fresh.critic.steps == 1
    for (name, a), b in zip(learner.critic.model.state_dict().items(), fresh.critic.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh.critic.optimizer.state_dict()["state"].keys() == learner.critic.optimizer.state_dict()["state"].keys()

    # The export: transformers loads the critic by itself; its logit at t is the learner's V(s_{t+1}).
    export = export_hf(path, tmp_path / "export")
    ids = torch.randint(0, VOCAB, (3, S), generator=torch.Generator().manual_seed(7))
    ours = learner.critic.model(ids).detach()
    assert float(ours.abs().max()) > 0  # (a trained head: not the zero-initialised one)
    hf = AutoModelForTokenClassification.from_pretrained(export / "critic").eval()
    assert type(hf).__name__ == "Qwen2ForTokenClassification" and hf.config.num_labels == 1
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits[:, :-1, 0], ours[:, 1:], rtol=0, atol=1e-6)
    # algo.critic.model may start a run from it: the head comes with the trunk.
    again = Critic(CriticConfig(model=str(export / "critic")), model_dir, torch.device("cpu"))
    torch.testing.assert_close(again.model(ids).detach(), ours, rtol=0, atol=1e-6)

    # The resumed critic steps exactly like the original.
    batch = _batch(learner, seed=1)
    torch.testing.assert_close(fresh.train_step(batch)["critic/value_loss"], learner.train_step(batch)["critic/value_loss"])


def _config_dir(path, **config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"")  # (the checks read the config only)
    return str(path)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "olmoe", "vocab_size": VOCAB}, "model_type 'olmoe' has no token-classification class"),
    ({"model_type": "qwen2", "vocab_size": VOCAB - 1}, f"vocab_size {VOCAB - 1} < the policy's"),
])
def test_a_critic_model_that_cannot_work_is_refused_naming_the_key(model_dir, tmp_path, config, message):
    from megarl.learner.critic import check_critic

    with pytest.raises(ValueError, match=rf"^algo\.critic\.model \({tmp_path}/c\): {message}"):
        check_critic(_config_dir(tmp_path / "c", **config), model_dir)
    check_critic(model_dir, model_dir)  # the policy's own directory: the default critic
