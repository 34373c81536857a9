"""LoRA on the megatron learner (one gloo rank) against peft's LoraLayer on the same HF weights."""
import pytest
import torch
from transformers import Qwen2ForCausalLM

from megarl.algo.config import LossConfig
from megarl.config.schema import LearnerConfig, LoraConfig
from megarl.learner import hf_lora
from megarl.models import lora
from megarl.protocols import TrainBatch
from tests.helpers import save_tiny_qwen2

VOCAB = 64
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_lora"), tie_word_embeddings=True, vocab_size=VOCAB))


def _learner(model_dir, targets=ALL, **cfg):
    from megarl.learner.megatron import MegatronLearner

    lora_cfg = LoraConfig(rank=4, alpha=8.0, target_modules=list(targets))
    return MegatronLearner(model_dir, LearnerConfig(lora=lora_cfg, **cfg), LossConfig())


def _logprobs(model, ids):
    logp = torch.log_softmax(model(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(logp, (1, 0))


def _randomise_b(learner, seed=1):
    """A trained adapter's B is non-zero; draw one so the adapter's output shows in the log-probs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.gpt.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def test_adapter_equals_peft_and_the_merged_weights(model_dir, world, tmp_path):
    from peft import PeftModel

    learner = _learner(model_dir)
    _randomise_b(learner)
    ids = torch.randint(0, VOCAB, (6, 12), generator=torch.Generator().manual_seed(0))
    ours = learner.logprobs(ids)
    adapter = dict(learner.publish_tensors())
    assert learner.publish_spec() == [(n, tuple(t.shape), t.dtype) for n, t in adapter.items()]
    assert learner.publish_spec() == lora.adapter_spec(learner.hf_config, learner.lora)
    # peft's LoraLayer on the HF base, loaded from the PEFT directory megarl writes.
    lora.save_peft(tmp_path / "adapter", adapter, learner.lora, model_dir)
    peft_model = PeftModel.from_pretrained(Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                           str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        theirs = _logprobs(peft_model, ids)
        base = _logprobs(Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), ids)
    assert (ours - base).abs().max() > 1e-2  # the adapter does show
    assert (ours - theirs).abs().max() <= 2e-5
    # W + alpha / r * B @ A (what the engine applies) is peft's merge.
    merged = lora.merge(dict(Qwen2ForCausalLM.from_pretrained(model_dir).state_dict()), adapter, lora.scale(learner.lora))
    hf = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.load_state_dict(merged, strict=False)
    with torch.no_grad():
        assert (_logprobs(hf, ids) - theirs).abs().max() <= 2e-5
    # What a version is on SGLang (MergedLoraSource): only the adapted weights, merged into the base the learner
    # gathered from itself, which is the checkpoint's.
    from megarl.learner.lora_publish import MergedLoraSource

    source = MergedLoraSource(learner, learner.lora, keep=True)
    checkpoint = dict(Qwen2ForCausalLM.from_pretrained(model_dir).state_dict())
    targets = [n.replace(".lora_A.weight", ".weight") for n, _, _ in learner.publish_spec() if "lora_A" in n]
    assert list(source.base) == targets and all(torch.equal(source.base[n], checkpoint[n]) for n in targets)
    sent = dict(source.publish_tensors())
    assert source.publish_spec() == [(n, tuple(t.shape), torch.float32) for n, t in sent.items()]
    assert list(sent) == targets and source.base_bytes == sum(t.numel() * 4 for t in sent.values())
    hf.load_state_dict({**checkpoint, **sent}, strict=False)
    with torch.no_grad():
        assert (_logprobs(hf, ids) - theirs).abs().max() <= 2e-5


def _adapter_gradients(learner, ids) -> dict[str, torch.Tensor]:
    """d(sum of the rows' log-probs) / d(adapter) through the learner's own schedule (one micro-batch, one
    backward), under HF adapter names (a shared A once per projection)."""
    learner.model.zero_grad_buffer()
    learner._run(learner.model, [{"input_ids": ids}], forward_only=False,
                 loss_fn=lambda logits, mb, cp_layout, width: (learner._row_logprobs(logits, mb).sum(),
                                                               torch.zeros(())))
    return dict(learner._adapter_tensors(lambda name, param: param.main_grad.detach().float().clone()))


def _ours_and_pefts(learner, model_dir: str, vocab: int, tmp_path, tol: float):
    """Log-probs of random rows under the learner with a drawn adapter, under peft's LoraLayer on transformers'
    model loaded with the PEFT directory megarl writes of that adapter, under the base model alone, and under
    transformers' model with the adapted weights the learner merges for SGLang (MergedLoraSource, over the base it
    gathers from itself), and under the merged model a checkpoint of it exports (whose PEFT adapter is the published
    one, bit for bit). The gradients of the rows' summed log-probs are peft's too: every B's, and every A's
    where one HF module is one megatron linear (Phi-3's fused modules, the latent attention's, o/down); where the
    linear is several (q/k/v, gate/up) they share its A, whose gradient is the sum of peft's for their As."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megarl.checkpoint import learner_state
    from megarl.checkpoint.export import ADAPTER_DIR, export_hf
    from megarl.learner.lora import adapted_linears
    from megarl.learner.lora_publish import MergedLoraSource

    _randomise_b(learner)
    ids = torch.randint(0, vocab, (4, 12), generator=torch.Generator().manual_seed(0))
    ours = learner.logprobs(ids)
    adapter = dict(learner.publish_tensors())
    assert learner.publish_spec() == lora.adapter_spec(learner.hf_config, learner.lora)
    lora.save_peft(tmp_path / "adapter", adapter, learner.lora, model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sent = dict(MergedLoraSource(learner, learner.lora, keep=True).publish_tensors())
    assert sent and not merged.load_state_dict(sent, strict=False).unexpected_keys
    learner_state.save(learner, tmp_path / "ckpt", 0, keep=1, model_dir=model_dir)
    exported = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert load_file(str(exported / ADAPTER_DIR / lora.ADAPTER_WEIGHTS)).keys() == {
        lora.PEFT_PREFIX + n for n in adapter}
    assert all(torch.equal(t, adapter[n.removeprefix(lora.PEFT_PREFIX)])
               for n, t in load_file(str(exported / ADAPTER_DIR / lora.ADAPTER_WEIGHTS)).items())
    with torch.no_grad():
        untouched = _logprobs(base, ids)
        merged_logprobs = torch.stack([_logprobs(merged, ids), _logprobs(
            AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval(), ids)])
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter"), is_trainable=True).eval()
    theirs = _logprobs(peft_model, ids)
    theirs.sum().backward()
    peft_grads = {name: p.grad for name, p in peft_model.named_parameters() if p.requires_grad}
    grads = _adapter_gradients(learner, ids)
    # The backward passes the forward's matmuls in another order: `tol` (the fp32 bound of log-probs up to 8 in
    # size, tests/helpers.fp32_logprob_tol) taken relative to the largest gradient instead.
    grad_tol = tol / 8.0 * max(float(g.abs().max()) for g in grads.values())
    for path, modules in adapted_linears(learner.hf_config, learner.lora.target_modules).items():
        for layer in range(int(learner.hf_config["num_hidden_layers"])):
            names = [lora.adapter_names(layer, m) for m in modules]
            peft_a = sum(peft_grads[hf_lora.peft_key(a)] for a, _ in names)
            for a, b in names:
                assert (grads[a] - peft_a).abs().max() <= grad_tol, a
                assert (grads[b] - peft_grads[hf_lora.peft_key(b)]).abs().max() <= grad_tol, b
    return ours, theirs.detach(), untouched, merged_logprobs


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral", "phi3", "smollm3", "olmo2", "gemma3"])
def test_every_dense_familys_adapter_equals_peft(world, tmp_path, kind):
    """The adapter on each dense family's own layout (Qwen3's and Gemma 3's heads wider than hidden, OLMo 2's and
    Gemma 3's norms after the projections, Mistral's and Gemma 3's windows, SmolLM3's layer without RoPE, Phi-3's
    one adapter on its fused qkv_proj and one on gate_up_proj) is peft's LoraLayer on transformers' model of the
    same directory, loaded from the PEFT directory megarl writes."""
    from tests.sampler import TINY, TOL, make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / kind, kind))
    ours, theirs, untouched, merged = _ours_and_pefts(_learner(model_dir), model_dir, TINY["vocab_size"], tmp_path, TOL)
    assert (ours - untouched).abs().max() > 1e-2  # the adapter does show
    assert (ours - theirs).abs().max() <= TOL  # fp32, two programs' reduction orders
    assert (merged - theirs).abs().max() <= TOL


@pytest.mark.parametrize("kind", ["qwen3_moe", "glm4_moe", "gpt_oss", "deepseek_v3", "deepseek_v3_q_proj"])
def test_an_moe_familys_attention_adapter_equals_peft(world, tmp_path, kind):
    """On a mixture-of-experts family the adapters sit on the attention projections (its experts are not adapted,
    megarl.models.lora_targets): Qwen3-MoE's, GLM-4.5's (q/k/v biases, partial RoPE, after a dense first layer),
    gpt-oss's (biases, sinks) and DeepSeek-V3's multi-latent attention's (q_a_proj, q_b_proj around the q latent, or
    one q_proj; kv_a_proj_with_mqa, kv_b_proj around the k/v latent; o_proj) equal peft's LoraLayer on
    transformers' model of the same directory."""
    from tests.helpers import save_tiny_deepseek_v3, save_tiny_glm4_moe, save_tiny_gpt_oss, save_tiny_moe
    from tests.learner.test_moe_learner import _tol

    save = {"qwen3_moe": lambda path: save_tiny_moe(path, "qwen3_moe"), "glm4_moe": save_tiny_glm4_moe,
            "gpt_oss": save_tiny_gpt_oss, "deepseek_v3": save_tiny_deepseek_v3,
            "deepseek_v3_q_proj": lambda path: save_tiny_deepseek_v3(path, q_lora_rank=None)}[kind]
    model_dir = str(save(tmp_path / kind))
    learner = _learner(model_dir, ["q_proj", "k_proj", "v_proj", "o_proj"])
    ours, theirs, untouched, merged = _ours_and_pefts(learner, model_dir, VOCAB, tmp_path, _tol(model_dir))
    assert (ours - untouched).abs().max() > 1e-2  # the adapter does show
    assert (ours - theirs).abs().max() <= _tol(model_dir) and (merged - theirs).abs().max() <= _tol(model_dir)


def test_only_the_adapter_trains(model_dir, world):
    learner = _learner(model_dir, targets=["q_proj", "k_proj", "v_proj", "o_proj"], lr=1e-2)
    trainable = {n for n, p in learner.gpt.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    base = {n: p.detach().clone() for n, p in learner.gpt.named_parameters() if not p.requires_grad}
    g = torch.Generator().manual_seed(2)
    b, s = 16, 12
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    mask = torch.zeros(b, s)
    mask[:, 4:] = 1.0
    batch = TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=learner.logprobs(ids) * mask,
                       versions=torch.where(mask > 0, 0, -1),
                       advantages=torch.randn(b, 1, generator=g).expand(b, s) * mask, learner_version=0)
    metrics = learner.train_step(batch)
    assert metrics["skipped_nonfinite"] == 0.0 and learner.version == 1
    after = dict(learner.gpt.named_parameters())
    assert all(torch.equal(base[n], after[n]) for n in base)  # the frozen base never moves
    assert all(after[n].abs().sum() > 0 for n in trainable if n.endswith("lora_B"))  # B left zero
    state = learner.optimizer.state_dict()["state"]
    assert len(state) == len(trainable)  # Adam moments for the adapter only


def _train_batch(learner, seed):
    g = torch.Generator().manual_seed(seed)
    b, s = 16, 12
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    mask = torch.zeros(b, s)
    mask[:, 4:] = 1.0
    return TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=learner.logprobs(ids) * mask,
                      versions=torch.where(mask > 0, learner.version, -1),
                      advantages=torch.randn(b, 1, generator=g).expand(b, s) * mask, learner_version=learner.version)


def test_checkpoint_resumes_the_adapter_and_exports_merged_and_peft(model_dir, world, tmp_path):
    """Save after 2 steps; a fresh learner loads it and its third step equals the saved learner's; the export is
    the merged HF model and a PEFT adapter, both giving the learner's log-probs; a run without LoRA is refused."""
    from peft import PeftModel

    from megarl.checkpoint import learner_state
    from megarl.checkpoint.export import ADAPTER_DIR, export_hf
    from megarl.checkpoint.storage import CheckpointError

    saved = _learner(model_dir, lr=1e-2)
    for seed in (3, 4):
        saved.train_step(_train_batch(saved, seed))
    learner_state.save(saved, tmp_path / "ckpt", 2, keep=2, model_dir=model_dir)
    resumed = _learner(model_dir, lr=1e-2)
    assert learner_state.load(resumed, tmp_path / "ckpt")["version"] == 2
    batch = _train_batch(saved, 5)
    assert saved.train_step(batch)["loss"] == resumed.train_step(batch)["loss"]  # Adam moments came back too
    assert all(torch.equal(a, b) for a, b in zip(dict(saved.publish_tensors()).values(),
                                                 dict(resumed.publish_tensors()).values()))
    with pytest.raises(CheckpointError, match="learner.lora"):
        from megarl.learner.megatron import MegatronLearner

        learner_state.load(MegatronLearner(model_dir, LearnerConfig(), LossConfig()), tmp_path / "ckpt")

    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(6))
    learner = _learner(model_dir)
    learner_state.load(learner, tmp_path / "ckpt")
    ours = learner.logprobs(ids)
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    with torch.no_grad():
        merged = _logprobs(Qwen2ForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), ids)
        peft_model = PeftModel.from_pretrained(Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                               str(out / ADAPTER_DIR)).eval()
        adapted = _logprobs(peft_model, ids)
        base = _logprobs(Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), ids)
    assert (ours - base).abs().max() > 1e-3  # two steps moved the adapter: an unmerged export would show
    assert (merged - ours).abs().max() <= 2e-5 and (adapted - ours).abs().max() <= 2e-5
