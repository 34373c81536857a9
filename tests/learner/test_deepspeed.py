"""DeepSpeedLearner under a real 2-rank torchrun (gloo, ZeRO-1/2/3 at dp=2) on tiny HF models built here
(Qwen2 with tied embeddings, Llama untied), against independent references: the HF checkpoint files,
a transformers forward, and the megatron learner's first step on the same weights and batch."""
import json
import math
import os
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl.algo import values
from megarl.algo.config import CriticConfig, LossConfig
from megarl.config.load import ConfigError, load_config
from megarl.observe.sinks import train_records
from tests.helpers import (LEARNER_TOL, REPO, forked_ranks, run_python, save_tiny_dense, save_tiny_qwen2,
                           save_tiny_qwen3)
from tests.learner.test_megatron_learner import CRITIC, _batch, _hf, _hf_logprobs

VOCAB = 64


def save_tiny_llama(path: Path) -> Path:
    """An untied Llama-family model (no biases) of the tiny Qwen2's shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
        vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False)).save_pretrained(path)
    return path


# name -> (model, learner kwargs, loss kwargs). Between them: every ZeRO stage, fixed-row and token-budget
# micro-batches (whose counts differ between the two ranks), activation checkpointing, the KL reference
# model, CPU offload of optimizer state and parameters, publish buckets of several tensors each, and the learned
# critic of advantage.estimator=gae (CRITIC_CASES: V-trace targets, value clip; trained, checkpointed, resumed, exported).
CASES = {
    "qwen_zero1": ("qwen", {"micro_batch_size": 16, "deepspeed": {"zero_stage": 1},  # with an lr schedule
                            "lr_warmup_steps": 2, "lr_decay": "linear", "lr_decay_steps": 4, "lr_min_ratio": 0.5}, {}),
    "qwen_zero2_token_budget_recompute": ("qwen", {"micro_batch_size": 64, "micro_batch_tokens": 60,
                                                   "recompute_activations": "full",
                                                   "deepspeed": {"zero_stage": 2}}, {}),
    "qwen_zero3_kl": ("qwen", {"micro_batch_size": 16, "deepspeed": {"zero_stage": 3}}, {"kl_coef": 0.1}),
    "llama_zero3_offload": ("llama", {"micro_batch_size": 16, "deepspeed": {
        "zero_stage": 3, "offload_optimizer": True, "offload_params": True}}, {}),
    "qwen_zero2_critic": ("qwen", {"micro_batch_size": 16, "deepspeed": {"zero_stage": 2}}, {}),
    "qwen3_zero2": ("qwen3", {"micro_batch_size": 16, "deepspeed": {"zero_stage": 2}}, {}),  # dense Qwen3
    "mistral_zero2": ("mistral", {"micro_batch_size": 16, "deepspeed": {"zero_stage": 2}}, {}),  # sliding window
    "llama_yarn_zero2": ("llama_yarn", {"micro_batch_size": 16, "deepspeed": {"zero_stage": 2}}, {}),
    "phi3_zero2": ("phi3", {"micro_batch_size": 16, "deepspeed": {"zero_stage": 2}}, {}),  # fused qkv, gate_up
    "smollm3_zero2": ("smollm3", {"micro_batch_size": 16, "deepspeed": {"zero_stage": 2}}, {}),  # a layer, no RoPE
    "olmo2_zero2": ("olmo2", {"micro_batch_size": 16, "deepspeed": {"zero_stage": 2}}, {}),  # post-norms
    "gemma3_zero2": ("gemma3", {"micro_batch_size": 16, "deepspeed": {"zero_stage": 2}}, {}),  # local/global layers
}
# LoRA (peft) rides in the same launch: ZeRO-3 (the frozen base and the adapter partitioned, the adapter gathered
# to publish, frozen fragments in the checkpoint) with the KL penalty, whose reference is the base (adapter off).
LORA_CASES = {"qwen_zero3_lora_kl": ("qwen", {"micro_batch_size": 16, "deepspeed": {"zero_stage": 3},
                                              "lora": {"rank": 4, "alpha": 8.0, "target_modules": [
                                                  "q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]}},
                                     {"kl_coef": 0.1})}
ALL_CASES = {**CASES, **LORA_CASES}
CRITIC_CASES = {"qwen_zero2_critic": CRITIC}
BUCKET_MB = 0.01  # 10 KiB: two or three of the tiny models' tensors per publish bucket


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_models")
    return {"qwen": str(save_tiny_qwen2(root / "qwen", tie_word_embeddings=True, vocab_size=VOCAB)),
            "llama": str(save_tiny_llama(root / "llama")),
            "qwen3": str(save_tiny_qwen3(root / "qwen3", vocab_size=VOCAB)),
            **{kind: str(save_tiny_dense(root / kind, kind, vocab_size=VOCAB)) for kind in ("mistral", "llama_yarn", "phi3", "smollm3",
                                                                                         "olmo2", "gemma3")}}


@pytest.fixture(scope="module")
def runs(models, world, tmp_path_factory):
    """One torchrun over every case (deepspeed_worker.py); meanwhile the megatron reference of each
    case's first step, in this process. -> (batches, {case: [rank0, rank1] records}, {case: megatron metrics})."""
    from megarl.config.schema import LearnerConfig
    from megarl.learner.megatron import MegatronLearner

    out = tmp_path_factory.mktemp("ds_runs")
    batches = [_batch(_hf(models["qwen"]), seed=5), _batch(_hf(models["qwen"]), seed=6)]
    # Per-token rewards: what the critic cases train on (the group-advantage cases ignore them).
    batches = [replace(b, rewards=values.terminal_rewards(b.input_ids[:, 1].remainder(2).float(), b.loss_mask))
               for b in batches]
    torch.save(batches, out / "batches.pt")
    cases = [{"name": name, "model_dir": models[model], "learner": {"dp": 2, "lr": 1e-2, **learner},
              "loss": loss, "bucket_mb": BUCKET_MB, "critic": CRITIC_CASES.get(name)}
             for name, (model, learner, loss) in ALL_CASES.items()]
    extensions = out / "torch_extensions"  # where DeepSpeed would JIT-compile ops: nothing may land there
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(extensions))
    proc = subprocess.Popen(  # the ranks forked from one process that imported DeepSpeed (tests/forked_ranks.py)
        forked_ranks(2, Path(__file__).with_name("deepspeed_worker.py"), str(out), str(out / "batches.pt"),
                     json.dumps(cases), timeout_s=590, warm="deepspeed"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    megatron = {}
    for name, (model, _, loss) in CASES.items():
        critic = CriticConfig(**CRITIC_CASES[name]) if name in CRITIC_CASES else None
        learner = MegatronLearner(models[model], LearnerConfig(micro_batch_size=16, lr=1e-2), LossConfig(**loss),
                                  critic_cfg=critic)
        megatron[name] = learner.train_step(batches[0])
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-6000:]
    assert not extensions.exists() or not any(extensions.iterdir()), "a DeepSpeed op was JIT-compiled on CPU"
    records = {name: [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(2)]
               for name in ALL_CASES}
    return batches, records, megatron, out


@pytest.mark.parametrize("case", CASES)
def test_publish_before_any_step_is_bitwise_the_hf_checkpoint(runs, models, case):
    saved = load_file(f"{models[CASES[case][0]]}/model.safetensors")
    for rank in runs[1][case]:
        published = rank["initial"]
        assert set(published) == set(saved)  # tied Qwen2: no lm_head; Llama: lm_head
        # ...streamed in the order, shapes and dtypes publish_spec() announces
        assert rank["spec"] == [(n, tuple(t.shape), t.dtype) for n, t in published.items()], case
        for name, tensor in saved.items():
            assert published[name].dtype == torch.float32 and torch.equal(published[name], tensor), (case, name)


@pytest.mark.parametrize("case", ALL_CASES)
def test_logprobs_equal_a_transformers_forward(runs, models, case):
    batches, records, _, _ = runs
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(models[ALL_CASES[case][0]], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = _hf_logprobs(hf, batches[0].input_ids)
    for rank in records[case]:
        assert torch.all(rank["logprobs"][:, 0] == 0)
        assert (rank["logprobs"] - ref).abs().max().item() <= LEARNER_TOL, case


@pytest.mark.parametrize("case", CASES)
def test_first_step_equals_the_megatron_learner(runs, case):
    """Same HF weights, same batch: loss, grad norm and the ratio metric of step 1 to 1e-5 relative, so the
    DP-averaging and micro-batch scaling is undone exactly and the loss is the shared one."""
    _, records, megatron, _ = runs
    ref = megatron[case]
    for rank in records[case]:
        got = rank["step1"]
        assert got["skipped_nonfinite"] == 0.0
        critic_keys = ("critic/value_loss", "critic/grad_norm", "critic/explained_var") if case in CRITIC_CASES else ()
        for key in ("loss", "grad_norm", "ratio/mean", "ess", "entropy/mean", *critic_keys):
            assert abs(got[key] - ref[key]) <= 1e-5 * max(1e-3, abs(ref[key])), (case, key, got[key], ref[key])
        if "kl_coef" in CASES[case][2]:
            assert got["kl_ref/mean"] == 0.0 == ref["kl_ref/mean"]  # the reference is the initial policy


def test_token_budget_case_has_uneven_micro_batch_counts(runs):
    """The ranks of the token-budget case run 7 and 8 micro-batches of step 1: the shorter one pads (ZeRO
    collectives in every forward/backward), and its step still equals megatron's (test above)."""
    from megarl.learner import step

    learner = CASES["qwen_zero2_token_budget_recompute"][1]
    counts = [len(step.micro_batches(step.dp_share(runs[0][0], 2, r), learner["micro_batch_size"],
                                     learner["micro_batch_tokens"])) for r in range(2)]
    assert counts[0] != counts[1], counts


@pytest.mark.parametrize("case", ALL_CASES)
def test_every_rank_publishes_the_same_updated_weights(runs, case):
    first, second = runs[1][case]
    assert set(first["after_step1"]) == set(first["initial"])
    assert any(not torch.equal(first["after_step1"][n], first["initial"][n]) for n in first["initial"])
    for name, tensor in first["after_step2"].items():
        assert torch.equal(tensor, second["after_step2"][name]), (case, name)


@pytest.mark.parametrize("case", ALL_CASES)
def test_the_first_step_runs_at_the_scheduled_lr(runs, case):
    """Adam's first step moves every weight with a gradient by lr * g / (|g| + eps): the largest move is the lr the
    optimizer ran at, which is the schedule's (qwen_zero1 warms up: half the lr) and the one the step reports."""
    from megarl.config.schema import LearnerConfig
    from megarl.learner.lr_schedule import lr_at

    learner = {k: v for k, v in ALL_CASES[case][1].items() if k.startswith("lr")}
    expected = lr_at(0, LearnerConfig(lr=1e-2, **learner))
    for rank in runs[1][case]:
        moved = max((rank["after_step1"][n] - rank["initial"][n]).abs().max().item() for n in rank["initial"])
        assert moved == pytest.approx(expected, rel=1e-3), case
        assert rank["step1"]["lr"] == expected and rank["step2"]["lr"] == lr_at(1, LearnerConfig(lr=1e-2, **learner))


@pytest.mark.parametrize("case", ALL_CASES)
def test_resume_from_checkpoint_is_exact(runs, case):
    """A second learner loaded from the checkpoint after step 1 redoes step 2 bit for bit: weights, Adam
    moments and step came back, and the lr schedule continues from the checkpoint's version (qwen_zero1: step 2
    at the full lr after step 1's half); lr and the rest are the run's config."""
    for rank in runs[1][case]:
        assert rank["resumed_version"] == 1
        assert rank["resumed_step2"] == {**rank["step2"], "step_time_s": rank["resumed_step2"]["step_time_s"]}
        for name, tensor in rank["after_step2"].items():
            assert torch.equal(rank["resumed_after_step2"][name], tensor), (case, name)


@pytest.mark.parametrize("case", CASES)
def test_export_is_the_checkpointed_weights(runs, case):
    from transformers import AutoModelForCausalLM

    export = runs[3] / f"{case}.export"
    exported = load_file(export / "model.safetensors")
    after_step1 = runs[1][case][0]["after_step1"]
    assert set(exported) == set(after_step1)
    for name, tensor in after_step1.items():
        assert torch.equal(exported[name], tensor), (case, name)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)  # a loadable HF directory
    assert torch.equal(model.get_input_embeddings().weight, after_step1["model.embed_tokens.weight"])
    assert (export / "critic").is_dir() == (case in CRITIC_CASES)


@pytest.mark.parametrize("case", CRITIC_CASES)
def test_exported_critic_gives_the_learners_values(runs, case):
    """The critic saved with the checkpoint after step 1 (rank 0 wrote it; both ranks' replicas agree), exported
    next to the policy, loads as transformers' token-classification model and gives the learner's values."""
    from transformers import AutoModelForTokenClassification

    batches, records, _, out = runs
    first, second = records[case]
    assert torch.equal(first["critic_values_step1"], second["critic_values_step1"])  # replicas in step
    assert first["resumed_critic_steps"] == 1 and first["step2"]["critic/warmup"] == 0.0
    hf = AutoModelForTokenClassification.from_pretrained(out / f"{case}.export" / "critic").eval()
    with torch.no_grad():
        logits = hf(input_ids=batches[1].input_ids).logits[..., 0]
    torch.testing.assert_close(logits[:, :-1], first["critic_values_step1"][:, 1:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", ALL_CASES)
def test_nonfinite_step_is_skipped(runs, case):
    for rank in runs[1][case]:
        assert rank["nonfinite"]["skipped_nonfinite"] == 1.0 and rank["version_after_nonfinite"] == 2
        if case in CRITIC_CASES:  # (NaN rewards: the critic's step is skipped too)
            assert rank["nonfinite"]["critic/skipped_nonfinite"] == 1.0
        for name, tensor in rank["resumed_after_step2"].items():
            assert torch.equal(rank["after_nonfinite"][name], tensor), (case, name)


@pytest.mark.parametrize("case", LORA_CASES)
def test_lora_publishes_and_trains_only_the_adapter(runs, models, case):
    """Every version is the adapter alone, in megarl.models.lora's names (the megatron learner's, which the
    engine's AdapterStager takes) and adapter_spec's order; B starts at zero (the base is the initial policy),
    only the adapter requires gradients, the frozen base does not move, and the KL reference stays the base. On
    SGLang a version is the adapted weights merged, over the base gathered from the ZeRO-3 partitions."""
    from megarl.config.schema import LoraConfig
    from megarl.models.convert import load_pretrained
    from megarl.models.lora import adapter_spec, merge, scale
    from megarl.portable.lora_merge import merged_spec

    lora_cfg = LoraConfig(**LORA_CASES[case][1]["lora"])
    hf_config, base = load_pretrained(models[LORA_CASES[case][0]])
    spec = adapter_spec(hf_config, lora_cfg)
    for rank in runs[1][case]:
        assert rank["spec"] == spec and [(n, tuple(t.shape), t.dtype) for n, t in rank["initial"].items()] == spec
        assert all(not t.any() for n, t in rank["initial"].items() if n.endswith("lora_B.weight"))
        assert all(t.any() for n, t in rank["after_step1"].items() if n.endswith("lora_B.weight"))
        assert rank["trainable"] and all(".lora_A.default." in n or ".lora_B.default." in n for n in rank["trainable"])
        assert len(rank["trainable"]) == len(spec) and rank["base_moved"] == []
        assert rank["step1"]["kl_ref/mean"] == 0.0 and rank["step2"]["kl_ref/mean"] != 0.0
        # On SGLang (lora_publish.MergedLoraSource): the adapted weights only, the checkpoint's base + the adapter
        merged = merge(base, rank["after_step1"], scale(lora_cfg))
        assert list(rank["merged_after_step1"]) == [n for n, _, _ in merged_spec(spec)]
        assert all((t - merged[n]).abs().max() <= 1e-6 for n, t in rank["merged_after_step1"].items())


@pytest.mark.parametrize("case", LORA_CASES)
def test_lora_export_is_the_merged_model_and_the_peft_adapter(runs, models, case):
    """The export of the checkpoint after step 1 (merged from both ranks' ZeRO-3 partitions, frozen base
    included): the merged HF model and peft's PeftModel on the original base (from adapter/) both give the
    learner's log-probs after step 1; the adapter files are the published adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megarl.checkpoint.export import ADAPTER_DIR
    from megarl.models.lora import ADAPTER_WEIGHTS, PEFT_PREFIX

    export, model_dir = runs[3] / f"{case}.export", models[LORA_CASES[case][0]]
    rank0 = runs[1][case][0]
    ids = runs[0][0].input_ids
    with torch.no_grad():
        merged = _hf_logprobs(AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval(), ids)
        base_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft = _hf_logprobs(PeftModel.from_pretrained(base_model, str(export / ADAPTER_DIR)).eval(), ids)
        base = _hf_logprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), ids)
    ours = rank0["logprobs_after_step1"]
    assert (ours - base).abs().max() > 1e-3  # one step moved the adapter: an unmerged export would show
    assert (merged - ours).abs().max() <= 1e-5 and (peft - ours).abs().max() <= 1e-5
    saved = load_file(export / ADAPTER_DIR / ADAPTER_WEIGHTS)
    assert saved.keys() == {PEFT_PREFIX + n for n in rank0["after_step1"]}
    assert all(torch.equal(saved[PEFT_PREFIX + n], t) for n, t in rank0["after_step1"].items())


def test_lora_resume_with_another_adapter_is_refused_naming_it(runs):
    from megarl.checkpoint.learner_state import _load_deepspeed
    from megarl.checkpoint.storage import CheckpointError, resolve
    from megarl.config.schema import DeepSpeedConfig, LearnerConfig, LoraConfig

    path = resolve(runs[3] / "qwen_zero3_lora_kl.ckpt")
    manifest = json.loads((path / "megarl.json").read_text())

    class Learner:  # the refusal comes before anything is loaded: only the config is read
        cfg = LearnerConfig(backend="deepspeed", dp=2, deepspeed=DeepSpeedConfig(zero_stage=3),
                            lora=LoraConfig(rank=8, target_modules=["q_proj"]))

    with pytest.raises(CheckpointError,
                       match=r"saved with learner\.lora=.*'rank': 4.*this run has learner\.lora=.*'rank': 8"):
        _load_deepspeed(Learner(), path, manifest)
    Learner.cfg = LearnerConfig(backend="deepspeed", dp=2, deepspeed=DeepSpeedConfig(zero_stage=3))
    with pytest.raises(CheckpointError, match=r"this run has learner\.lora=off"):
        _load_deepspeed(Learner(), path, manifest)


def test_resume_under_another_layout_is_refused_naming_the_keys(runs):
    from megarl.checkpoint.learner_state import _load_deepspeed
    from megarl.checkpoint.storage import CheckpointError, resolve
    from megarl.config.schema import DeepSpeedConfig, LearnerConfig

    path = resolve(runs[3] / "qwen_zero3_kl.ckpt")
    manifest = json.loads((path / "megarl.json").read_text())
    assert manifest["layout"] == {"tp": 1, "pp": 1, "dp": 2, "backend": "deepspeed", "zero_stage": 3}

    class Learner:  # the refusal comes before anything is loaded: only the config is read
        cfg = LearnerConfig(backend="deepspeed", dp=4, deepspeed=DeepSpeedConfig(zero_stage=2))

    with pytest.raises(CheckpointError, match=r"learner\.dp.*\(2, 4\).*learner\.deepspeed\.zero_stage.*\(3, 2\)"):
        _load_deepspeed(Learner(), path, manifest)
    Learner.cfg = LearnerConfig(backend="megatron", dp=2)
    with pytest.raises(CheckpointError, match="learner.backend=deepspeed"):
        _load_deepspeed(Learner(), path, manifest)


def test_megarl_train_refuses_another_dp_before_launching_anything(runs, tmp_path):
    """The same refusal from `megarl train` itself, before torchrun starts a process."""
    proc = run_python("-m", "megarl.cli", "train", str(REPO / "configs" / "demo.yaml"), f"run.dir={tmp_path / 'run'}",
                      f"checkpoint.dir={runs[3] / 'qwen_zero3_kl.ckpt'}", "run.resume=true",
                      "learner.backend=deepspeed", "learner.deepspeed.zero_stage=3", "learner.dp=1", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert re.search(r"checkpoint: .*another layout.*'learner\.dp': \(2, 1\)", proc.stderr), proc.stderr[-2000:]
    assert "launching" not in proc.stdout and not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, key", [
    (["learner.tp=2"], "learner.tp"),
    (["learner.pp=2"], "learner.pp"),
    (["learner.deepspeed.zero_stage=4"], "learner.deepspeed.zero_stage"),
    (["learner.deepspeed.zero_stage=2", "learner.deepspeed.offload_params=true"], "learner.deepspeed.offload_params"),
    (["learner.use_distributed_optimizer=true"], "learner.use_distributed_optimizer"),
    (["learner.recompute_activations=selective"], "learner.recompute_activations"),
])
def test_config_refuses_what_deepspeed_cannot_do(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{key}:"):
        load_config(REPO / "configs" / "demo.yaml", ["learner.backend=deepspeed", *overrides])


@pytest.mark.parametrize("overrides, message", [
    (["learner.dp=2", "publish.senders=3"], "at most learner.dp=2"),
    (["learner.dp=2", "publish.senders=2", "sampler.engine=sglang"], "megarl's publish groups"),
])
def test_config_refuses_senders_that_cannot_send(overrides, message):
    with pytest.raises(ConfigError, match=rf"^publish\.senders:.*{message}"):
        load_config(REPO / "configs" / "demo.yaml", ["learner.backend=deepspeed", *overrides])


def test_config_refuses_deepspeed_flags_on_megatron():
    with pytest.raises(ConfigError, match=r"^learner\.deepspeed\.offload_optimizer:"):
        load_config(REPO / "configs" / "demo.yaml", ["learner.deepspeed.offload_optimizer=true"])
    load_config(REPO / "configs" / "demo.yaml", ["learner.backend=deepspeed", "learner.dp=2"])  # accepted


@pytest.mark.parametrize("zero_stage, senders, lora", [(3, 2, False), (2, 1, True)], ids=["zero3_two_senders", "lora"])
def test_megarl_train_runs_the_published_weights(embedded_think_model_dir, tmp_path, zero_stage, senders, lora):
    """End to end at max_lag=0: ZeRO-3 at dp=2 with both DP ranks publishing (publish.senders=2, each every other
    bucket): every trained token was generated by the version the learner is at, i.e. by weights that went
    through the publish, and the learner's log-probs equal the built-in engine's behaviour log-probs. LoRA
    (ZeRO-2, dp=1: two processes, one sender): each version is the peft adapter alone, which the engine's
    AdapterStager merges into its base. What ZeRO-1 and the other stages publish is checked bitwise by the tests
    on `runs` (one launch for every case), one sender's whole-model publish to the engine by
    tests/roles/test_train_e2e.py."""
    run_dir = tmp_path / "run"
    layout = ["learner.dp=1", "learner.lora.rank=8"] if lora else ["learner.dp=2", f"publish.senders={senders}"]
    proc = run_python("-m", "megarl.cli", "train", str(REPO / "configs" / "demo.yaml"), f"run.dir={run_dir}",
                      "run.steps=4", "algo.max_lag=0", "learner.backend=deepspeed",
                      f"learner.deepspeed.zero_stage={zero_stage}", "publish.bucket_mb=0.25", *layout,
                      f"model.path={embedded_think_model_dir}", timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = train_records([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])
    assert [m["version"] for m in metrics] == [1, 2, 3, 4]
    model_bytes = sum(t.numel() * 4 for t in load_file(Path(embedded_think_model_dir) / "model.safetensors").values())
    for m in metrics:
        assert m["lag0/token_share"] == 1.0
        assert m["lag0/logprob_gap_abs"] < 1e-4, (m["step"], m["lag0/logprob_gap_abs"])
        if lora:  # exactly the adapter's bytes (every projection of every layer at rank 8)
            from megarl.config.schema import LoraConfig
            from megarl.models.lora import adapter_spec

            hf_config = json.loads((Path(embedded_think_model_dir) / "config.json").read_text())
            assert m["publish_bytes"] == sum(math.prod(shape) * 4 for _, shape, _ in
                                             adapter_spec(hf_config, LoraConfig(rank=8))) < model_bytes
            continue
        share = m["publish_bytes"] / model_bytes  # the lead's link: its share with two senders
        assert 0.2 < share < 0.8 if senders == 2 else share == 1.0, share
