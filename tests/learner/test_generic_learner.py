"""The generic path's learner: DeepSpeedLearner on a model type megarl has no family for (a tiny Granite), one gloo
rank in this process, against transformers: log-probs, a step, a publish into the built-in engine's generic model
(bitwise), checkpoint -> export -> from_pretrained (equal logits) and resume (bitwise); the megatron backend and
what the generic path does not do are refused before launch, naming docs/models.md and the path."""
from dataclasses import replace

import pytest
import torch

from megarl.algo.config import LossConfig
from megarl.config.schema import DeepSpeedConfig, LearnerConfig
from tests.helpers import LEARNER_TOL, REPO, save_tiny_granite
from tests.learner.test_deepspeed_moe import world  # noqa: F401 - the one-rank gloo group with LOCAL_RANK
from tests.learner.test_megatron_learner import _batch, _hf_logprobs


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    return str(save_tiny_granite(tmp_path_factory.mktemp("generic") / "granite"))


def _hf(model_dir, weights=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if weights is not None:  # (every parameter; a persistent buffer, e.g. Nemotron-H's router bias, stays loaded)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and not set(missing) & set(dict(model.named_parameters())), (missing, unexpected)
    return model


def _learner(model_dir, zero_stage):
    from megarl.learner.deepspeed import DeepSpeedLearner

    cfg = LearnerConfig(backend="deepspeed", micro_batch_size=16, lr=1e-2,
                        deepspeed=DeepSpeedConfig(zero_stage=zero_stage))
    return DeepSpeedLearner(model_dir, cfg, LossConfig())


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_a_model_type_outside_the_families_trains_publishes_exports_and_resumes(granite, world, tmp_path,  # noqa: F811
                                                                                zero_stage):
    from megarl.checkpoint import learner_state
    from megarl.checkpoint.export import export_hf
    from megarl.sampler.engine import BuiltinEngine
    from megarl.sampler.hf_model import load_pretrained

    learner = _learner(granite, zero_stage)
    assert learner.generic and not learner.is_moe
    hf = _hf(granite)
    batch = _batch(hf, seed=5)
    with torch.no_grad():
        assert (learner.logprobs(batch.input_ids) - _hf_logprobs(hf, batch.input_ids)).abs().max() <= LEARNER_TOL
    cfg, initial = load_pretrained(granite)
    metrics = learner.train_step(batch)
    assert learner.version == 1 and metrics["skipped_nonfinite"] == 0.0
    published = {name: t.clone() for name, t in learner.publish_tensors()}
    assert learner.publish_spec() == [(n, tuple(t.shape), t.dtype) for n, t in published.items()]
    assert set(published) == set(initial) and any(not torch.equal(published[n], initial[n]) for n in initial)

    # The engine's generic model runs the published tensors bitwise (received into its staging buffers).
    engine = BuiltinEngine(cfg, initial)
    views = engine.staging_buffers(1)
    for name, tensor in published.items():
        views[name].copy_(tensor)
    engine.stage_weights(views, 1)
    engine.apply_staged()
    assert all(torch.equal(engine._weights.params[n], t) for n, t in published.items())

    # Checkpoint -> export -> from_pretrained: the logits of the learner's weights, bitwise.
    root = tmp_path / "ckpt"
    learner_state.save(learner, root, step=1, keep=2, model_dir=granite)
    exported = _hf(str(export_hf(root, tmp_path / "export")))
    with torch.no_grad():
        assert torch.equal(exported(batch.input_ids).logits, _hf(granite, published)(batch.input_ids).logits)

    # Resume: the same weights, and the same second step as the learner that never stopped.
    second = replace(_batch(hf, seed=6), learner_version=1)
    learner.train_step(second)
    after = {name: t.clone() for name, t in learner.publish_tensors()}
    del learner
    resumed = _learner(granite, zero_stage)
    learner_state.load(resumed, root)
    assert resumed.version == 1
    assert all(torch.equal(t, published[n]) for n, t in resumed.publish_tensors())
    resumed.train_step(second)
    assert all(torch.equal(t, after[n]) for n, t in resumed.publish_tensors())


def _cfg(*overrides):
    from megarl.config.load import load_config

    return load_config(REPO / "configs" / "demo.yaml", list(overrides))


@pytest.mark.parametrize("overrides, refusal", [
    ([], r"model_type 'granite'.*docs/models\.md.*generic path: learner\.backend=deepspeed"),
    (["learner.backend=deepspeed", "learner.lora.rank=8"], r"learner\.lora\.rank=8: .*generic path"),
    (["learner.backend=deepspeed", "sampler.model_impl=native"], r"sampler\.model_impl=native"),
])
def test_check_model_dir_takes_the_generic_path_on_deepspeed_only(granite, overrides, refusal):
    from megarl.cli import check_model_dir

    with pytest.raises(ValueError, match=refusal):
        check_model_dir(granite, _cfg(*overrides))
    check_model_dir(granite, _cfg("learner.backend=deepspeed"))  # accepted


def test_sampler_model_impl_is_one_of_auto_native_hf():
    from megarl.config.load import ConfigError

    with pytest.raises(ConfigError, match=r"^sampler\.model_impl:"):
        _cfg("sampler.model_impl=paged")
    assert _cfg("sampler.model_impl=hf").sampler.model_impl == "hf"


def _engine_batch(engine, prompts: list[list[int]], samples: int, new_tokens: int):
    """A TrainBatch of the engine's completions (`samples` per prompt, right-padded), trained on every completion
    token, with the engine's behaviour log-probs and versions."""
    from megarl.protocols import GenerationRequest, SamplingParams, TrainBatch

    requests = [GenerationRequest(f"{i}.{j}", p, SamplingParams(temperature=1.0, max_new_tokens=new_tokens), ())
                for i, p in enumerate(prompts) for j in range(samples)]
    done = engine.generate(requests)
    width = max(len(c.prompt_ids) + len(c.token_ids) for c in done)
    ids, mask, mu = (torch.zeros(len(done), width, dtype=d) for d in (torch.long, torch.float32, torch.float32))
    for b, c in enumerate(done):
        n, k = len(c.prompt_ids), len(c.token_ids)
        ids[b, :n + k] = torch.tensor(c.prompt_ids + c.token_ids)
        mask[b, n:n + k], mu[b, n:n + k] = 1.0, torch.tensor(c.logprobs)
    advantages = torch.randn(len(done), 1, generator=torch.Generator().manual_seed(0)).expand_as(mask) * mask
    return TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=mu, versions=torch.where(mask > 0, 0, -1),
                      advantages=advantages, learner_version=0)


@pytest.mark.parametrize("kind", ["qwen3_next", "nemotron_h"])
def test_a_hybrid_model_trains_at_lag_0_on_the_engines_log_probs(world, tmp_path, kind):  # noqa: F811
    """A tiny Qwen3-Next (gated-DeltaNet layers beside full attention) and a tiny Nemotron-H (Mamba-2 mixers,
    attention, MLP and MoE blocks): the DeepSpeed learner's log-probs of the engine's completions are the engine's
    behaviour log-probs, in the training step too (where rows of one prompt would be packed sharing their prefix by
    default: a hybrid trains unpacked, as a recurrence would leak across packed rows); the step publishes tensors
    the engine takes, and exports to a directory transformers loads back with the same logits."""
    from megarl.sampler.engine import BuiltinEngine
    from megarl.sampler.hf_model import load_pretrained
    from tests.sampler.test_hf_hybrid import SAVE, TOL

    path = str(SAVE[kind](tmp_path / kind, tokenizer=False))
    tol = TOL[kind]
    cfg, initial = load_pretrained(path)
    engine = BuiltinEngine(cfg, initial, max_running=8, max_seq_len=64, seed=2)
    gen = torch.Generator().manual_seed(4)
    batch = _engine_batch(engine, [torch.randint(0, 256, (k,), generator=gen).tolist() for k in (3, 5, 24)], 2, 6)
    learner = _learner(path, 2)
    assert learner.recurrent and learner.cfg.pack_sequences and learner.cfg.share_prefixes  # (the defaults)
    ours = learner.logprobs(batch.input_ids)
    assert ((ours - batch.behaviour_logprobs) * batch.loss_mask).abs().max() <= tol
    metrics = learner.train_step(batch)
    assert metrics["skipped_nonfinite"] == 0.0
    assert metrics["lag0/logprob_gap_abs"] <= tol, metrics["lag0/logprob_gap_abs"]
    published = {name: t.clone() for name, t in learner.publish_tensors()}
    engine.stage_weights(published, 1)
    engine.apply_staged()
    assert engine.version == 1 and any(not torch.equal(published[n], initial[n]) for n in initial)

    # Checkpoint -> export -> from_pretrained: the logits of the learner's weights, bitwise.
    from megarl.checkpoint import learner_state
    from megarl.checkpoint.export import export_hf

    learner_state.save(learner, tmp_path / "ckpt", step=1, keep=2, model_dir=path)
    exported = _hf(str(export_hf(tmp_path / "ckpt", tmp_path / "export")))
    with torch.no_grad():
        assert torch.equal(exported(batch.input_ids).logits, _hf(path, published)(batch.input_ids).logits)


def test_check_model_dir_takes_qwen3_5_on_either_learner_and_the_engines_generic_path(tmp_path):
    """Qwen3.5 text (families.LEARNER_FAMILIES): the megatron learner maps it (megarl.learner.hybrid), the DeepSpeed
    learner and the built-in engine take the generic path, so both backends pass the checks; what the hybrid does
    not do on either (LoRA, sampler.model_impl=native) is refused by name."""
    from megarl.cli import check_model_dir
    from megarl.embedded.tiny import build_tokenizer
    from tests.helpers import LEARNER_TINY, qwen3_5_model

    qwen3_5_model({**LEARNER_TINY, "vocab_size": 264}).save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    for backend in ("megatron", "deepspeed"):
        check_model_dir(tmp_path, _cfg(f"learner.backend={backend}"))  # accepted
        with pytest.raises(ValueError, match=r"learner\.lora\.rank=8"):
            check_model_dir(tmp_path, _cfg(f"learner.backend={backend}", "learner.lora.rank=8"))
        with pytest.raises(ValueError, match=r"sampler\.model_impl=native"):
            check_model_dir(tmp_path, _cfg(f"learner.backend={backend}", "sampler.model_impl=native"))
