"""LoRA on the DeepSpeed learner through peft (one gloo rank, in this process): what it publishes is what the
built-in engine's AdapterStager takes, and base + that adapter in the engine is peft's merged model; only the
adapter trains; the KL reference is the base. (The 2-rank checkpoint / resume / export run is
tests/learner/test_deepspeed.py's `qwen_zero3_lora_kl` case; the run through the publish path is its
test_megarl_train_runs_the_published_weights[lora].)"""
import pytest
import torch
from transformers import AutoModelForCausalLM

from megarl.algo.config import LossConfig
from megarl.config.schema import DeepSpeedConfig, LearnerConfig, LoraConfig
from megarl.models import lora
from megarl.protocols import GenerationRequest, SamplingParams
from tests.helpers import LEARNER_TOL, save_tiny_qwen2
from tests.learner.test_deepspeed_moe import world  # noqa: F401 (a gloo group of one, LOCAL_RANK set; no megatron)
from tests.learner.test_lora import VOCAB, _logprobs, _train_batch

# Half of megatron's fused q/k/v and gate/up: peft adapts each HF projection alone.
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_ds_lora"), tie_word_embeddings=True,
                               vocab_size=VOCAB))


# Phi-3: peft's adapters on its fused qkv_proj and down_proj (q/k/v are one module there)
PHI3_LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"])


def _learner(model_dir, loss_cfg=None, lora_cfg=LORA, **cfg):
    from megarl.learner.deepspeed import DeepSpeedLearner

    cfg = LearnerConfig(backend="deepspeed", deepspeed=DeepSpeedConfig(zero_stage=1), lora=lora_cfg, **cfg)
    return DeepSpeedLearner(model_dir, cfg, loss_cfg or LossConfig())


@pytest.mark.parametrize("kind", ["qwen2", "phi3"])
def test_published_adapter_in_the_engine_is_peft_merged(model_dir, world, tmp_path, kind):  # noqa: F811
    """The learner's published adapter, staged by the built-in engine's AdapterStager: every sampled token's
    behaviour log-prob is peft's merged model's (from the PEFT directory of those tensors), and so is the
    learner's own log-prob of it (the lag-0 gap), to fp32 noise. On Phi-3 the adapters are peft's on its fused
    modules, under the names the megatron learner publishes too."""
    from peft import PeftModel

    from megarl.sampler.engine import BuiltinEngine
    from megarl.sampler.lora import AdapterStager
    from tests.helpers import fp32_logprob_tol
    from tests.sampler import TINY, make_tiny_model

    tol, lora_cfg = LEARNER_TOL, LORA
    if kind == "phi3":
        model_dir = str(make_tiny_model(tmp_path / kind, kind, vocab_size=VOCAB))
        tol, lora_cfg = fp32_logprob_tol({**TINY, "vocab_size": VOCAB}, max_logprob=8.0), PHI3_LORA
    learner = _learner(model_dir, lora_cfg=lora_cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a trained adapter's B is non-zero: draw one so the adapter shows
        for name, p in learner.module.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    adapter = {name: t.clone() for name, t in learner.publish_tensors()}
    assert learner.publish_spec() == [(n, tuple(t.shape), t.dtype) for n, t in adapter.items()]
    assert learner.publish_spec() == lora.adapter_spec(learner.hf_config, lora_cfg)

    engine = BuiltinEngine.from_pretrained(model_dir, max_running=2)
    AdapterStager.from_pretrained(engine, model_dir, lora_cfg).stage(adapter, 1)
    for i, ids in enumerate([[3, 5, 7, 11], [2, 4, 6, 8, 10, 12]]):
        engine.add_request(GenerationRequest(str(i), ids, SamplingParams(temperature=1.0, max_new_tokens=8)))
    done = []
    while engine.num_unfinished:
        done += engine.step()

    lora.save_peft(tmp_path / "adapter", adapter, lora_cfg, model_dir)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                       str(tmp_path / "adapter")).merge_and_unload().eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert len(done) == 2
    for c in done:
        assert c.versions == [1] * len(c.token_ids)
        ids, n = torch.tensor([c.prompt_ids + c.token_ids]), len(c.prompt_ids)
        with torch.no_grad():
            want = _logprobs(merged, ids)[0, n:]
            assert (want - _logprobs(base, ids)[0, n:]).abs().max() > 1e-2  # the adapter does show
        assert (torch.tensor(c.logprobs) - want).abs().max() <= tol  # the engine: base + published adapter
        assert (learner.logprobs(ids)[0, n:] - want).abs().max() <= tol  # the learner: peft, unmerged
    # What a version is on SGLang (MergedLoraSource): only the adapted weights, merged into peft's frozen base
    # layers; each is peft's merge.
    from megarl.learner.lora_publish import MergedLoraSource

    source = MergedLoraSource(learner, lora_cfg, keep=True)
    sent = dict(source.publish_tensors())
    assert list(sent) == [n.replace(".lora_A.weight", ".weight") for n in adapter if n.endswith(".lora_A.weight")]
    theirs = merged.state_dict()
    assert all((t - theirs[n]).abs().max() <= 1e-6 for n, t in sent.items())
    assert any((t - base.state_dict()[n]).abs().max() > 1e-2 for n, t in sent.items())


@pytest.fixture(scope="module")
def trained(model_dir, world):  # noqa: F811
    """A ZeRO-1 learner with the KL penalty and HF gradient checkpointing (through peft's frozen base) after one
    step: (learner, the frozen base before it, batch, metrics)."""
    learner = _learner(model_dir, LossConfig(kl_coef=0.1), lr=1e-2, recompute_activations="full")
    frozen = {n: p.detach().clone() for n, p in learner.module.named_parameters() if not p.requires_grad}
    batch = _train_batch(learner, 3)
    return learner, frozen, batch, learner.train_step(batch)


def test_only_the_adapter_trains_and_the_kl_reference_is_the_base(trained, model_dir):
    learner, frozen, batch, metrics = trained
    trainable = {n for n, p in learner.module.named_parameters() if p.requires_grad}
    assert trainable == {n for n in dict(learner.module.named_parameters()) if ".lora_" in n}
    assert len(trainable) == 2 * len(LORA.target_modules) * learner.hf_config["num_hidden_layers"]
    assert metrics["skipped_nonfinite"] == 0.0 and learner.version == 1
    assert metrics["kl_ref/mean"] == 0.0  # B starts at zero: the first step's policy is the base
    after = dict(learner.module.named_parameters())
    assert all(torch.equal(frozen[n], after[n]) for n in frozen)  # the frozen base never moves
    assert all(after[n].abs().sum() > 0 for n in trainable if ".lora_B." in n)  # B left zero
    # Adam moments for the adapter only (ZeRO's flat fp32 partition of the trainable parameters)
    moments = sum(st["exp_avg"].numel() for st in learner.optimizer.optimizer.state.values())
    assert moments == sum(after[n].numel() for n in trainable)
    # The reference is the base (the adapter switched off), not the policy the step moved.
    with torch.no_grad():
        base = _logprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), batch.input_ids)
    ref = learner._forward_logprobs(learner.ref_model, [{"input_ids": batch.input_ids}])[0]
    assert (ref - base).abs().max() <= LEARNER_TOL and (learner.logprobs(batch.input_ids) - base).abs().max() > 1e-3


def test_zero1_checkpoint_exports_the_merged_model_and_the_peft_adapter(trained, model_dir, tmp_path):
    """Below ZeRO-2 DeepSpeed keeps no frozen fragments: the export takes the base from the module state. The
    merged HF model and peft on the original base (from adapter/) both give the learner's log-probs."""
    from peft import PeftModel

    from megarl.checkpoint import learner_state
    from megarl.checkpoint.export import ADAPTER_DIR, export_hf

    learner, _, batch, _ = trained
    learner_state.save(learner, tmp_path / "ckpt", 1, keep=1, model_dir=model_dir)
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    ids = batch.input_ids
    with torch.no_grad():
        merged = _logprobs(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), ids)
        peft = _logprobs(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                                   str(out / ADAPTER_DIR)).eval(), ids)
    ours = learner.logprobs(ids)
    assert (merged - ours).abs().max() <= LEARNER_TOL and (peft - ours).abs().max() <= LEARNER_TOL
