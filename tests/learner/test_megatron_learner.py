"""MegatronLearner on one gloo rank against an independent reference (HF transformers + hand-written PPO-clip)."""
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from megarl.algo.config import LossConfig
from megarl.protocols import TrainBatch
from tests.helpers import LEARNER_TOL, forked_ranks, save_tiny_dense, save_tiny_qwen2, save_tiny_qwen3

VOCAB, B, S, PROMPT = 64, 64, 16, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), tie_word_embeddings=True, vocab_size=VOCAB))


def _learner(model_dir, temperature=1.0, loss_cfg=None, **cfg):
    from megarl.config.schema import LearnerConfig
    from megarl.learner.megatron import MegatronLearner

    return MegatronLearner(model_dir, LearnerConfig(**cfg), loss_cfg or LossConfig(), temperature=temperature)


def _hf(model_dir):
    return Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_logprobs(hf, ids, temperature=1.0):
    logits = hf(ids).logits.float() / temperature
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (1, 0))


def _batch(hf, advantages=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    mask = torch.zeros(B, S)
    lengths = torch.randint(2, S - PROMPT + 1, (B,), generator=g)
    for b in range(B):
        mask[b, PROMPT:PROMPT + lengths[b]] = 1.0
    with torch.no_grad():
        # Behaviour log-probs of a slightly different policy, so ratios differ from 1 and some clip.
        mu = (_hf_logprobs(hf, ids) + 0.3 * torch.randn(B, S, generator=g)) * mask
    if advantages is None:
        advantages = torch.randn(B, 1, generator=g).expand(B, S).clone()
    return TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=mu,
                      versions=torch.where(mask > 0, 0, -1), advantages=advantages * mask, learner_version=0)


def test_logprobs_match_hf(model_dir, world):
    learner = _learner(model_dir, temperature=0.7, micro_batch_size=5)
    hf = _hf(model_dir)
    ids = torch.randint(0, VOCAB, (12, 20), generator=torch.Generator().manual_seed(3))
    ours = learner.logprobs(ids)
    with torch.no_grad():
        ref = _hf_logprobs(hf, ids, temperature=0.7)
    assert ours.shape == (12, 20) and ours.dtype == torch.float32
    assert torch.all(ours[:, 0] == 0)
    assert (ours - ref).abs().max().item() <= LEARNER_TOL


# A family-specific tensor each family's publish must hold (None: the plain decoder's names only).
FAMILY_TENSOR = {"qwen3": "model.layers.0.self_attn.q_norm.weight", "mistral": None, "llama_yarn": None,
                 "phi3": "model.layers.0.self_attn.qkv_proj.weight", "smollm3": None,
                 "olmo2": "model.layers.0.post_feedforward_layernorm.weight",
                 "gemma3": "model.layers.1.pre_feedforward_layernorm.weight",
                 "qwen3_5": "model.layers.0.linear_attn.in_proj_qkv.weight"}
# Qwen3.5's log-probs against transformers' own (its torch path: torch_chunk_gated_delta_rule, the torch causal conv):
# both sides compute the same fp32 operations on the same values, the chunked delta rule by the same algorithm with
# the same 64-position chunks, and differ only in how a matmul or a reduction is blocked; on these widths (<= 64)
# that moves a log-prob by a few ulps of its size (|log-prob| <= 8: ulp 1e-6; seen: 5e-7). 1e-5 is ten such
# ulps and two orders of magnitude below what a gate, a (1 + w) norm or a misplaced head moves (> 1e-3).
HYBRID_TOL = 1e-5


FAMILY_LAYOUTS = ("tp2", "pp2")


class FamilyRuns:
    """One 2-rank launch (layout_worker.py) over every family's TP2 and PP2 layouts and
    test_every_layout_matches_tp1's layouts of the tiny Qwen2 (as `every_{layout}`, on every_batch()), started when
    the first of those tests asks for it (one start-up and one set of megatron imports for them all); its results
    read once."""

    def __init__(self, root: Path, qwen2_dir: str):
        from transformers import AutoModelForCausalLM

        self.root, self.models, self.batches, layouts = root, {}, {}, {}
        self.every_batch = every_batch(qwen2_dir)
        torch.save(self.every_batch, root / "every.batch.pt")
        layouts.update({f"every_{name}": {**layout, "model_dir": qwen2_dir, "batch": str(root / "every.batch.pt")}
                        for name, layout in EVERY_LAYOUTS.items()})
        for kind in FAMILY_TENSOR:
            model_dir = str(save_tiny_qwen3(root / kind, vocab_size=VOCAB) if kind == "qwen3"
                            else save_tiny_dense(root / kind, kind, vocab_size=VOCAB))
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            self.models[kind], self.batches[kind] = model_dir, _batch(hf, seed=7)
            torch.save(self.batches[kind], root / f"{kind}.batch.pt")
            layouts.update({f"{kind}_{layout}": {**LAYOUTS[layout], "model_dir": model_dir,
                                                 "batch": str(root / f"{kind}.batch.pt")} for layout in FAMILY_LAYOUTS})
        self.layouts = layouts
        self.proc = _launch_layouts(self.models["qwen3"], self.batches["qwen3"], root, layouts, nproc=2,
                                    timeout_s=890)
        self._results = None

    def results(self, kind: str) -> dict[str, list[dict]]:
        """{layout: per-rank results} of `kind`'s layouts (the launch's whole time: one learner build per layout
        and rank, a few seconds each on loaded cores)."""
        if self._results is None:
            self._results = _layout_results(self.proc, self.root, self.layouts, nproc=2, timeout=900)
        return {layout: self._results[f"{kind}_{layout}"] for layout in
                (EVERY_LAYOUTS if kind == "every" else FAMILY_LAYOUTS)}


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory, model_dir):
    runs = FamilyRuns(tmp_path_factory.mktemp("families"), model_dir)
    yield runs
    if runs.proc.poll() is None:  # a test failed before reading the results: the launch is not left behind
        runs.proc.kill()
        runs.proc.communicate()


@pytest.mark.timeout(1200)  # the first family's test waits for every family's layouts (FamilyRuns.results)
@pytest.mark.parametrize("kind", list(FAMILY_TENSOR))
def test_family_logprobs_match_hf_at_tp1_and_its_tp2_and_pp2_steps_match_tp1(world, tmp_path, kind, family_runs):
    """Dense Qwen3 (q/k norms, heads wider than hidden / heads), Mistral (a sliding window shorter than the rows) and
    a Llama with YaRN RoPE (rows past its original context), Phi-3 (fused qkv_proj and gate_up_proj),
    SmolLM3 (its second layer, on PP2's second stage, without RoPE), OLMo 2 (norms after attention and the MLP;
    q/k norms over the whole projection, which TP2 splits by heads) and Gemma 3 (a local layer on PP2's first stage,
    a global one on its second, four (1 + w) norms per layer, scaled embeddings):
    and Qwen3.5 text (a gated-DeltaNet layer on PP2's first stage, TP2 one key head a rank; a gated full-attention
    layer with RoPE on a quarter of each head on its second; (1 + w) norms; unpacked rows; log-probs within
    HYBRID_TOL, and its publish before a step is the checkpoint bit for bit):
    the learner's log-probs are transformers' own, and real 2-process TP2 and PP2 runs give the TP1 log-probs,
    loss, grad norm and published weights; the trained state exports to an HF directory of the same function."""
    from transformers import AutoModelForCausalLM

    model_dir, batch = family_runs.models[kind], family_runs.batches[kind]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    learner = _learner(model_dir, micro_batch_size=16)
    ref_logprobs = learner.logprobs(batch.input_ids)
    with torch.no_grad():
        tol = HYBRID_TOL if kind == "qwen3_5" else LEARNER_TOL
        assert (ref_logprobs - _hf_logprobs(hf, batch.input_ids)).abs().max().item() <= tol
    if kind == "qwen3_5":
        loaded = load_file(Path(model_dir) / "model.safetensors")
        before = dict(learner.publish_tensors())
        assert set(before) == set(loaded) and all(torch.equal(before[n], t) for n, t in loaded.items())
    ref = learner.train_step(batch)
    ref_published = dict(learner.publish_tensors())
    assert FAMILY_TENSOR[kind] is None or FAMILY_TENSOR[kind] in ref_published
    # The trained state's HF export is bitwise what the learner publishes, and transformers loads it to the
    # learner's own log-probs.
    from megarl.checkpoint import learner_state
    from megarl.checkpoint.export import export_hf

    learner_state.save(learner, tmp_path / "ckpt", step=1, keep=1, model_dir=model_dir)
    exported = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    saved = load_file(exported / "model.safetensors")
    assert set(saved) == set(ref_published) and all(torch.equal(saved[n], t) for n, t in ref_published.items())
    trained = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    with torch.no_grad():
        after = _hf_logprobs(trained, batch.input_ids)
    assert (learner.logprobs(batch.input_ids) - after).abs().max().item() <= LEARNER_TOL
    assert (after - ref_logprobs).abs().max().item() > 1e-4  # the trained weights, not the initial ones
    for layout, ranks in family_runs.results(kind).items():
        published = {}
        for rank in ranks:
            assert _close(rank["logprobs"], ref_logprobs), layout
            for key in ("loss", "grad_norm"):
                assert abs(rank["metrics"][key] - ref[key]) <= 1e-5 * abs(ref[key]), (layout, key)
        for rank in _sources(ranks):
            published.update(rank["published"])
        assert set(published) == set(ref_published), layout
        assert all(_close(published[n], t) for n, t in ref_published.items()), (
            layout, [n for n, t in ref_published.items() if not _close(published[n], t)])


def test_a_hybrid_model_trains_one_sequence_per_row(world, tmp_path):
    """Qwen3.5's gated-DeltaNet layers run a recurrence along the row (megatron's module refuses packed_seq_params,
    and megarl's packed rows would carry one sequence's state into the next): with learner.pack_sequences on, its
    micro-batches are still one sequence per row."""
    from megarl.learner.megatron import check_recurrent
    from megarl.config.schema import LearnerConfig, LoraConfig
    from transformers import AutoModelForCausalLM

    model_dir = str(save_tiny_dense(tmp_path / "qwen3_5", "qwen3_5", vocab_size=VOCAB))
    batch = _batch(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), seed=7)
    learner = _learner(model_dir, micro_batch_size=16, pack_sequences=True)
    seen, run = [], learner._run
    learner._run = lambda model, micro, *args, **kwargs: (seen.extend(micro), run(model, micro, *args, **kwargs))[1]
    loss = learner.train_step(batch)["loss"]
    assert seen and not any("unpack_index" in mb for mb in seen)
    assert sum(mb["input_ids"].shape[0] for mb in seen) == batch.input_ids.shape[0]
    assert math.isfinite(loss)
    with pytest.raises(ValueError, match="learner.lora"):
        check_recurrent(LearnerConfig(lora=LoraConfig(rank=4)), "off")


def spec_of(tensors: dict) -> list:
    return [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]


def test_publish_tensors_are_the_hf_state(model_dir, world):
    """...in the order, shapes and dtypes publish_spec() announces (the publisher streams against it)."""
    learner = _learner(model_dir)
    published = dict(learner.publish_tensors())
    assert learner.publish_spec() == spec_of(published)
    saved = load_file(f"{model_dir}/model.safetensors")
    assert set(published) == set(saved)  # tied: no lm_head.weight
    for name, tensor in saved.items():
        assert published[name].dtype == torch.float32 and torch.equal(published[name], tensor), name


@pytest.mark.parametrize("micro_batch_size", [16, 24])  # 4 equal micro-batches; 3 uneven ones
def test_train_step_matches_reference(model_dir, world, micro_batch_size):
    learner = _learner(model_dir, micro_batch_size=micro_batch_size, lr=1e-2)
    hf = _hf(model_dir)
    batch = _batch(hf)
    before = dict(learner.publish_tensors())

    # Independent reference: HF forward + hand-written PPO-clip (eps 0.2 / 0.28), token mean.
    logp = _hf_logprobs(hf, batch.input_ids)
    ratio = torch.exp(logp - batch.behaviour_logprobs)
    adv = batch.advantages
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 0.2, 1 + 0.28))
    ref_loss = (per_token * batch.loss_mask).sum() / batch.loss_mask.sum()
    ref_loss.backward()
    ref_grad_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in hf.parameters())).item()

    assert learner.version == 0
    metrics = learner.train_step(batch)
    assert learner.version == 1
    assert metrics["skipped_nonfinite"] == 0.0
    assert metrics["num_tokens"] == batch.loss_mask.sum().item()
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    assert abs(metrics["loss"] - ref_loss.item()) <= 1e-5
    # The grad norm checks megatron's micro-batch / DP loss scaling is undone exactly.
    assert abs(metrics["grad_norm"] - ref_grad_norm) <= 1e-5 * max(1.0, ref_grad_norm)
    after = dict(learner.publish_tensors())
    assert any(not torch.equal(before[n], after[n]) for n in before)
    # The policy's entropy (loss.entropy_metric, on by default): the mean over trained tokens of the entropy of
    # softmax(logits / T) at the position predicting each, from the transformers forward.
    with torch.no_grad():
        logp = torch.log_softmax(hf(batch.input_ids).logits.double(), -1)[:, :-1]
        entropy = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))
    ref_entropy = ((entropy * batch.loss_mask).sum() / batch.loss_mask.sum()).item()
    assert metrics["entropy/mean"] == pytest.approx(ref_entropy, rel=1e-5)


def test_a_reported_entropy_is_computed_in_slices_without_gradient_and_can_be_turned_off(model_dir, world,
                                                                                       monkeypatch):
    """Slices of 3 positions (the module's bound, lowered) give the whole-tensor entropy, and the step's loss and
    gradient are those of a step that does not report it (loss.entropy_metric=false: no entropy/mean)."""
    from megarl.learner import step

    hf = _hf(model_dir)
    batch = _batch(hf)
    whole = _learner(model_dir, lr=1e-2).train_step(batch)
    monkeypatch.setattr(step, "ENTROPY_SLICE_ELEMENTS", 3 * B * VOCAB)
    sliced = _learner(model_dir, lr=1e-2).train_step(batch)
    off = _learner(model_dir, lr=1e-2, loss_cfg=LossConfig(entropy_metric=False)).train_step(batch)
    assert sliced["entropy/mean"] == pytest.approx(whole["entropy/mean"], rel=1e-6) and "entropy/mean" not in off
    for key in ("loss", "grad_norm"):
        assert sliced[key] == whole[key] == off[key], key


def test_each_step_trains_at_the_scheduled_lr(model_dir, world):
    """learner.lr_warmup_steps / lr_decay reach the optimizer: Adam's first step moves every weight with a
    gradient by lr * g / (|g| + eps), so the largest move is the lr the step ran at (here lr / 4, warming up);
    each step reports the schedule's lr (megarl.learner.lr_schedule)."""
    from megarl.learner.lr_schedule import lr_at

    learner = _learner(model_dir, lr=1e-2, lr_warmup_steps=4, lr_decay="cosine", lr_decay_steps=6, lr_min_ratio=0.1)
    hf = _hf(model_dir)
    before = dict(learner.publish_tensors())
    metrics = [learner.train_step(_batch(hf, seed=0))]
    moved = max((after - before[name]).abs().max().item() for name, after in learner.publish_tensors())
    assert moved == pytest.approx(1e-2 / 4, rel=1e-3)
    for seed in range(1, 7):
        metrics.append(learner.train_step(replace(_batch(hf, seed=seed), learner_version=learner.version)))
    assert [m["lr"] for m in metrics] == [lr_at(s, learner.cfg) for s in range(7)]
    assert [round(m["lr"], 6) for m in metrics] == [0.0025, 0.005, 0.0075, 0.01, 0.01, 0.0055, 0.001]


def test_nonfinite_step_is_skipped(model_dir, world):
    learner = _learner(model_dir)
    hf = _hf(model_dir)
    batch = _batch(hf, advantages=torch.full((B, 1), float("nan")).expand(B, S).clone())
    before = dict(learner.publish_tensors())
    metrics = learner.train_step(batch)
    assert metrics["skipped_nonfinite"] == 1.0
    assert learner.version == 0
    after = dict(learner.publish_tensors())
    assert all(torch.equal(before[n], after[n]) for n in before)


# ---------------------------------------------------------------- KL to the frozen reference policy


def test_kl_is_zero_while_policy_equals_reference(model_dir, world):
    """Step 0: policy = reference, so the k3 term (value and gradient) vanishes and the step is the no-KL step."""
    batch = _batch(_hf(model_dir), seed=1)
    plain = _learner(model_dir, micro_batch_size=16, lr=1e-2).train_step(batch)
    with_kl = _learner(model_dir, loss_cfg=LossConfig(kl_coef=0.5), micro_batch_size=16, lr=1e-2).train_step(batch)
    assert with_kl["kl_ref/mean"] == 0.0 and with_kl["loss/kl"] == 0.0
    assert abs(with_kl["loss"] - plain["loss"]) <= 1e-7
    assert abs(with_kl["grad_norm"] - plain["grad_norm"]) <= 1e-7 * plain["grad_norm"]


@pytest.fixture(scope="module")
def kl_run(model_dir, world):
    """Two optimizer steps with kl_coef > 0; the reference's weights before and after, the policy after step 1."""
    kl_coef = 0.1
    learner = _learner(model_dir, loss_cfg=LossConfig(kl_coef=kl_coef, kl_estimator="k3"),
                       micro_batch_size=24, lr=1e-2)
    hf = _hf(model_dir)
    batches = [_batch(hf, seed=2), _batch(hf, seed=3)]
    ref_before = {n: p.detach().clone() for n, p in learner.ref_model.named_parameters()}
    first = learner.train_step(batches[0])
    policy_after_first = dict(learner.publish_tensors())
    second = learner.train_step(batches[1])
    return dict(learner=learner, kl_coef=kl_coef, batch=batches[1], first=first, second=second,
                policy=policy_after_first, ref_before=ref_before)


def test_kl_after_a_step_matches_independent_reference(model_dir, kl_run):
    """Step 2's kl_ref/mean = hand-written k3 between HF models: policy (published weights), reference (the dir)."""
    config = Qwen2Config.from_pretrained(model_dir)
    policy = Qwen2ForCausalLM(config).eval()
    missing, unexpected = policy.load_state_dict(kl_run["policy"], strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # tied to the embedding
    batch = kl_run["batch"]
    with torch.no_grad():
        logp = _hf_logprobs(policy, batch.input_ids)
        ref = _hf_logprobs(_hf(model_dir), batch.input_ids)
    x = ref - logp  # log(ref / pi)
    k3 = torch.exp(x) - 1 - x
    mask = batch.loss_mask
    expected = ((k3 * mask).sum() / mask.sum()).item()

    metrics = kl_run["second"]
    assert kl_run["first"]["kl_ref/mean"] == 0.0
    assert metrics["skipped_nonfinite"] == 0.0 and kl_run["learner"].version == 2
    assert metrics["kl_ref/mean"] > 1e-4
    assert abs(metrics["kl_ref/mean"] - expected) <= 1e-5
    assert abs(metrics["loss/kl"] - kl_run["kl_coef"] * expected) <= 1e-6  # token_mean aggregation


def test_reference_weights_stay_frozen(kl_run):
    learner = kl_run["learner"]
    ref = dict(learner.ref_model.named_parameters())
    assert not learner.ref_model.training
    assert set(ref) == set(kl_run["ref_before"])
    for name, param in ref.items():
        assert not param.requires_grad and param.grad is None, name
        assert torch.equal(param, kl_run["ref_before"][name]), name
    # Its own storage (not aliasing the policy), and nothing of it in the optimizer.
    policy = list(learner.gpt.parameters())
    assert not {p.data_ptr() for p in policy} & {p.data_ptr() for p in ref.values()}
    optimized = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in ref.values()}
    assert not all(torch.equal(a, b) for a, b in zip(policy, ref.values()))  # ... while the policy moved


# Two-process layouts, each against the TP1 reference computed in the test process. Micro-batches are
# trimmed to their own longest row, so PP exchanges variable activation shapes between stages.
LAYOUTS = {
    "tp2": {"tp": 2, "micro_batch_size": 16},
    "dp2": {"dp": 2, "micro_batch_size": 16},
    "pp2": {"pp": 2, "micro_batch_size": 16},
    "pp2_token_budget": {"pp": 2, "micro_batch_size": 64, "micro_batch_tokens": 160},
    "dp2_distributed_optimizer": {"dp": 2, "micro_batch_size": 16, "use_distributed_optimizer": True},
    "tp2_distributed_optimizer_recompute": {"tp": 2, "micro_batch_size": 16, "use_distributed_optimizer": True,
                                            "recompute_activations": "full"},
}
# advantage.estimator=gae: the replicated critic (megarl.learner.critic) over DP2 (rows split, grads and whitening
# statistics summed) and PP2 (every stage computes the same advantages), against its own TP1 reference.
CRITIC = {"target": "vtrace", "lr": 1e-2, "value_clip": 0.2, "gamma": 0.9, "lam": 0.95}
CRITIC_LAYOUTS = {"dp2_critic": {"dp": 2, "micro_batch_size": 16, "critic": CRITIC},
                  "pp2_critic": {"pp": 2, "micro_batch_size": 16, "critic": CRITIC}}
# learner.lora over TP2 (every projection: column- and row-parallel linears, the fused q/k/v and gate/up), two steps
# (the first moves only B; the second trains A through the TP collectives), against its own TP1 reference.
LORA = {"rank": 4, "alpha": 8.0}
LORA_LAYOUTS = {"tp2_lora": {"tp": 2, "micro_batch_size": 16, "lr": 1e-2, "lora": LORA}}
EVERY_LAYOUTS = {**LAYOUTS, **CRITIC_LAYOUTS, **LORA_LAYOUTS}


def _close(got: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> bool:
    return got.shape == ref.shape and float((got - ref).abs().max()) <= rel * max(1.0, float(ref.abs().max()))


def _launch_layouts(model_dir, batch, tmp_path, layouts: dict, nproc: int, timeout_s: float):
    """Start layout_worker.py's `nproc` gloo ranks over `layouts`, forked from one process that imported megatron
    once (tests/forked_ranks.py: what is checked is the layouts' math, not the launch); a rank still running after
    `timeout_s` is killed."""
    import json
    import os
    import subprocess

    torch.save(batch, tmp_path / "batch.pt")
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        forked_ranks(nproc, Path(__file__).with_name("layout_worker.py"), model_dir, str(tmp_path / "batch.pt"),
                     str(tmp_path), json.dumps(layouts), timeout_s=timeout_s),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _layout_results(proc, tmp_path, layouts: dict, nproc: int, timeout: float) -> dict[str, list[dict]]:
    """Each layout's per-rank results (layout_worker.py), once the launch ended cleanly."""
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return {layout: [torch.load(tmp_path / f"{layout}.rank{r}.pt") for r in range(nproc)] for layout in layouts}


def _sources(ranks: list[dict]) -> list[dict]:
    """The publish source of each PP stage: its TP rank 0 of DP rank 0."""
    return [r for r in ranks if r["tp_rank"] == 0 and r["dp_rank"] == 0]


def every_batch(model_dir: str):
    """test_every_layout_matches_tp1's batch, with terminal rewards for the critic's layouts."""
    from dataclasses import replace

    from megarl.algo.values import terminal_rewards

    batch = _batch(_hf(model_dir), seed=5)
    return replace(batch, rewards=terminal_rewards(batch.input_ids[:, PROMPT].float() % 3, batch.loss_mask))


@pytest.mark.timeout(1200)  # it may be the first to wait for FamilyRuns' launch (every family's layouts too)
def test_every_layout_matches_tp1(model_dir, world, family_runs):
    """Two gloo ranks: TP2, DP2, PP2 (fixed rows and token-budget micro-batches) and the
    distributed optimizer give the TP1 per-token log-probs, loss and grad norm, and one optimizer step
    gives the same full weights, all to 1e-5 relative.  Every layout's publish_shards are its TP slices. The critic
    (advantage.estimator=gae) gives the TP1 critic's metrics and the policy loss over DP2 and PP2. LoRA over TP2
    gives the TP1 adapter's second step, log-probs and whole published adapter, and its SGLang publish (the adapted
    weights merged over the base gathered over TP) is the checkpoint's base + that adapter; its checkpoint (TP-split
    adapter and Adam moments) exports the TP1 adapter and resumes on a TP1 learner to the TP1 run's third step."""
    from megarl.algo.config import CriticConfig
    from megarl.checkpoint import export, learner_state
    from megarl.config.schema import LearnerConfig, LoraConfig
    from megarl.learner.megatron import MegatronLearner
    from megarl.models import convert, lora
    from megarl.portable.lora_merge import merged_spec

    batch = family_runs.every_batch

    critic_ref = MegatronLearner(model_dir, LearnerConfig(micro_batch_size=16), LossConfig(),
                                 critic_cfg=CriticConfig(**CRITIC)).train_step(batch)

    # The TP=1 reference.
    learner = _learner(model_dir, micro_batch_size=16)
    ref_logprobs = learner.logprobs(batch.input_ids)
    ref = learner.train_step(batch)
    ref_published = dict(learner.publish_tensors())
    assert_publish_shards_are_tp_slices(ref_published, [{"tp_rank": 0, "shards": dict(learner.publish_shards())}], 1)

    def lora_learner():
        return MegatronLearner(model_dir, LearnerConfig(micro_batch_size=16, lr=1e-2, lora=LoraConfig(**LORA)),
                               LossConfig())

    lora_ref = lora_learner()
    lora_ref.train_step(batch)
    lora_step = lora_ref.train_step(batch)
    lora_logprobs, lora_published = lora_ref.logprobs(batch.input_ids), dict(lora_ref.publish_tensors())
    assert (lora_logprobs - ref_logprobs).abs().max() > 1e-2  # the adapter moved: B and A both matter below
    # On SGLang a version is the adapted weights merged: the checkpoint's base + the TP1 adapter.
    lora_merged = lora.merge(convert.load_pretrained(model_dir)[1], lora_published, lora.scale(lora_ref.lora))
    lora_merged = {n: lora_merged[n] for n, _, _ in merged_spec(lora_ref.publish_spec())}

    results = family_runs.results("every")
    for layout in LORA_LAYOUTS:
        for rank in results.pop(layout):
            assert _close(rank["logprobs"], lora_logprobs), layout
            for key in ("loss", "grad_norm"):
                assert abs(rank["metrics"][key] - lora_step[key]) <= 1e-5 * abs(lora_step[key]), (layout, key)
            assert rank["spec"] == lora_ref.publish_spec() and set(rank["published"]) == set(lora_published)
            assert all(_close(rank["published"][n], t) for n, t in lora_published.items()), layout
            assert list(rank["merged"]) == list(lora_merged), layout
            assert all(_close(rank["merged"][n], t) for n, t in lora_merged.items()), layout
        exported = dict(export.hf_tensors(family_runs.root / f"every_{layout}.ckpt", adapter_only=True))
        assert all(_close(exported[n], t) for n, t in lora_published.items()) and set(exported) == set(lora_published)
        resumed = lora_learner()
        learner_state.load(resumed, family_runs.root / f"every_{layout}.ckpt")
        third = lora_ref.train_step(batch)["loss"]
        assert abs(resumed.train_step(batch)["loss"] - third) <= 1e-5 * abs(third), layout  # Adam moments too
    for layout in CRITIC_LAYOUTS:
        for rank in results.pop(layout):
            for key in ("loss", "grad_norm", "critic/value_loss", "critic/grad_norm", "critic/explained_var",
                        "lag0/critic_return_mean"):
                assert abs(rank["metrics"][key] - critic_ref[key]) <= 1e-5 * max(1.0, abs(critic_ref[key])), (layout, key)
    for layout, ranks in results.items():
        for rank in ranks:  # every rank (each PP stage too) sees the same log-probs and loss
            assert _close(rank["logprobs"], ref_logprobs), layout
            assert abs(rank["metrics"]["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), layout
            assert abs(rank["metrics"]["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"], layout
            assert abs(rank["metrics"]["ratio/mean"] - ref["ratio/mean"]) <= 1e-5, layout
            # the reported entropy: over the vocab shards at TP2 (collectives per slice), per stage at PP2
            assert abs(rank["metrics"]["entropy/mean"] - ref["entropy/mean"]) <= 1e-5 * ref["entropy/mean"], layout
        published = {}
        for rank in _sources(ranks):
            assert not set(rank["published"]) & set(published), f"{layout}: a tensor published twice"
            published.update(rank["published"])
        assert set(published) == set(ref_published), layout
        if layout.startswith("pp2"):  # each stage publishes only its own tensors
            assert all(rank["published"] for rank in ranks), layout
        for name, tensor in ref_published.items():
            assert _close(published[name], tensor), (layout, name)
        _check_stage_shards(ranks, LAYOUTS[layout].get("tp", 1))


def assert_publish_shards_are_tp_slices(whole: dict, tp_ranks: list[dict], tp: int) -> None:
    """Every TP rank's publish_shards() is bitwise tp_shard.shard of the whole publish_tensors(), and the
    TP ranks' shards (all of them given, in any order) unshard to the whole tensors exactly."""
    from megarl.models import tp_shard

    tp_ranks = sorted(tp_ranks, key=lambda r: r["tp_rank"])
    assert [r["tp_rank"] for r in tp_ranks] == list(range(tp))
    for rank in tp_ranks:
        assert set(rank["shards"]) == set(whole)
        for name, tensor in whole.items():
            got, want = rank["shards"][name], tp_shard.shard(name, tensor, tp, rank["tp_rank"])
            assert got.dtype == torch.float32 and got.is_contiguous(), name
            assert got.shape == want.shape and torch.equal(got, want), (rank["tp_rank"], name)
    for name, tensor in whole.items():
        assert torch.equal(tp_shard.unshard(name, [r["shards"][name] for r in tp_ranks]), tensor), name


def _check_stage_shards(ranks: list[dict], tp: int) -> None:
    """Per PP stage: every rank publishes the same whole tensors as the stage's source, every DP replica's
    TP ranks hold its TP slices, and each TP rank's link carries 1/tp of the split tensors' bytes plus
    the whole ones (the norms)."""
    from megarl.learner.megatron import publish_bytes
    from megarl.models import tp_shard

    for source in _sources(ranks):
        whole = source["published"]
        stage = [r for r in ranks if r["pp_rank"] == source["pp_rank"]]
        for rank in stage:
            assert set(rank["published"]) == set(whole)
            assert rank["spec"] == spec_of(rank["published"]) and rank["shard_spec"] == spec_of(rank["shards"])
            assert all(torch.equal(rank["published"][n], t) for n, t in whole.items())
        for dp_rank in {r["dp_rank"] for r in stage}:
            assert_publish_shards_are_tp_slices(whole, [r for r in stage if r["dp_rank"] == dp_rank], tp)
        split = publish_bytes({n: t.shape for n, t in whole.items() if tp_shard.split_kind(n) != "whole"})
        kept = publish_bytes({n: t.shape for n, t in whole.items() if tp_shard.split_kind(n) == "whole"})
        assert split > 0 or not any(n.startswith("model.layers.") for n in whole)
        for rank in stage:
            assert rank["shard_bytes"] == split // tp + kept, (source["pp_rank"], rank["tp_rank"])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """An untied Llama-family model (no biases) of the same tiny shape, 4 layers: two per PP stage."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
        vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False))
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return str(path)


def test_tp2_pp2_publish_shards(model_dir, llama_dir, tmp_path):
    """Four gloo ranks, TP2 x PP2 on the untied Llama, after one step: on each stage each
    TP rank's publish_shards() are exactly its tp_shard slices of publish_tensors() and unshard to them,
    and lm_head (last stage) is split by vocab rows.  (Qwen2's q/k/v biases: the TP2 layouts above.)"""
    layouts = {"tp2pp2": {"tp": 2, "pp": 2, "micro_batch_size": 16}}
    batch = _batch(_hf(model_dir), seed=6)  # token ids and log-probs: valid data for the Llama too
    ranks = _layout_results(_launch_layouts(llama_dir, batch, tmp_path, layouts, nproc=4, timeout_s=230), tmp_path,
                            layouts, nproc=4, timeout=240)["tp2pp2"]
    assert all(r["metrics"]["skipped_nonfinite"] == 0.0 for r in ranks)
    _check_stage_shards(ranks, tp=2)
    assert {n for r in _sources(ranks) for n in r["published"]} == set(load_file(f"{llama_dir}/model.safetensors"))
    last = [r for r in ranks if r["pp_rank"] == 1]
    assert all(r["shards"]["lm_head.weight"].shape == (VOCAB // 2, 32) for r in last)  # vocab rows, not gathered


def _cheapest_cuts(lengths: list[int], max_rows: int, max_tokens: int, cost: int) -> float:
    """Brute force over every way to cut the sorted rows into consecutive runs (the reference)."""
    n, best = len(lengths), float("inf")
    for mask in range(1 << (n - 1)):
        cuts = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        runs = [(a, b) for a, b in zip(cuts, cuts[1:])]
        if all(b - a <= max_rows and (b - a == 1 or max_tokens <= 0 or (b - a) * lengths[a] <= max_tokens)
               for a, b in runs):
            best = min(best, sum((b - a) * lengths[a] + cost for a, b in runs))
    return best


def test_micro_batches_are_cut_where_the_work_is_least():
    from megarl.learner.step import micro_batch_rows

    def work(groups, lengths, cost):
        return sum(len(g) * lengths[int(g[0])] + cost for g in groups)

    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        n = int(torch.randint(1, 11, (1,), generator=gen))
        lengths = torch.randint(1, 40, (n,), generator=gen).sort(descending=True).values
        max_rows, cost = int(torch.randint(1, 6, (1,), generator=gen)), [0, 8, 64, 512][trial % 4]
        max_tokens = [0, 40, 80][trial % 3]
        groups = micro_batch_rows(lengths, max_rows, max_tokens, cost)
        assert torch.equal(torch.cat(groups), torch.arange(n))  # every row once, in order
        assert all(len(g) <= max_rows for g in groups)
        assert all(len(g) == 1 or max_tokens == 0 or len(g) * lengths[int(g[0])] <= max_tokens for g in groups)
        assert work(groups, lengths.tolist(), cost) == _cheapest_cuts(lengths.tolist(), max_rows, max_tokens, cost)


def test_long_tail_rows_are_cut_off_and_equal_rows_are_not():
    from megarl.learner.step import micro_batch_rows

    # Two long rows and many short ones: the long ones travel alone instead of widening 64 rows.
    lengths = torch.tensor([40, 38] + [8] * 62)
    assert [len(g) for g in micro_batch_rows(lengths, max_rows=64)] == [2, 62]
    # Rows of one length: only as many micro-batches as max_rows forces.
    assert sorted(len(g) for g in micro_batch_rows(torch.full((10,), 5), max_rows=4)) == [2, 4, 4]
    # A row longer than the token budget still gets a micro-batch of its own.
    assert [g.tolist() for g in micro_batch_rows(torch.tensor([30, 3]), 8, 20)] == [[0], [1]]


def test_sequence_lengths_end_at_the_last_trained_token():
    from megarl.learner.step import sequence_lengths

    mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    assert sequence_lengths(mask).tolist() == [4, 6, 1]
