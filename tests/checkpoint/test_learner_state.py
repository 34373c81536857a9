"""Learner checkpoints with real processes: exact resume, loading under another layout, a save killed
before its commit, a save that hits a real write error, and the HF export.

The processes (tests/checkpoint/learner_worker.py):
  reference  trains N+M steps untouched; a second learner trains N steps and saves checkpoint N
  resume     a NEW process loads checkpoint N and trains M steps; then saves again and is SIGKILLed
             inside that save, after its files are complete but before the commit
  layouts    two torchrun ranks load checkpoint N under TP=2, DP=2 and PP=2; a save in which rank 1
             hits RLIMIT_FSIZE (EFBIG from the kernel); a distributed optimizer saved under DP=2
             continues under TP=2
resume and layouts run side by side once reference has written checkpoint N.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.checkpoint import storage
from megarl.checkpoint.export import export_hf
from megarl.checkpoint.learner_state import check_architecture, check_optimizer
from megarl.checkpoint.storage import CheckpointError
from tests.helpers import LEARNER_TOL, REPO, forked_ranks, save_tiny_qwen2

WORKER = REPO / "tests" / "checkpoint" / "learner_worker.py"
N, M = 2, 2  # as in the worker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 with untied embeddings and non-zero q/k/v biases, plus a real tokenizer."""
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_untied"), tie_word_embeddings=False, tokenizer=True)


def _env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def _check(proc: subprocess.CompletedProcess | subprocess.Popen, out: str = "", err: str = ""):
    assert proc.returncode == 0, (out or getattr(proc, "stdout", ""))[-2000:] + (err or getattr(proc, "stderr", ""))[-4000:]


@pytest.fixture(scope="module")
def work(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("ckpt_work")
    args = [str(model_dir), str(work)]
    reference = subprocess.run([sys.executable, str(WORKER), "reference", *args], capture_output=True, text=True,
                               timeout=180, env=_env(), cwd=REPO)
    _check(reference)
    logs = {name: open(work / f"{name}.log", "w+") for name in ("resume", "layouts")}
    resume = subprocess.Popen([sys.executable, str(WORKER), "resume", *args], stdout=logs["resume"],
                              stderr=subprocess.STDOUT, env=_env(**{storage.PAUSE_ENV: "600"}), cwd=REPO)
    layouts = subprocess.Popen(forked_ranks(2, WORKER, "layouts", *args, timeout_s=230), stdout=logs["layouts"],
                               stderr=subprocess.STDOUT, env=_env(), cwd=REPO)  # (ranks forked: tests/forked_ranks.py)
    try:
        # `resume` is held in its second save once that save is complete in the temp dir: kill it there.
        held = storage.temp_dir(work / "ckpt", N + M) / storage.MANIFEST
        deadline = time.monotonic() + 240
        while not held.exists():
            assert resume.poll() is None, "resume exited early: " + _tail(logs["resume"])
            assert time.monotonic() < deadline, "resume never reached its commit: " + _tail(logs["resume"])
            time.sleep(0.1)
        resume.send_signal(signal.SIGKILL)
        resume.wait(30)
        layouts.wait(240)
        _check(layouts, _tail(logs["layouts"]))
    finally:
        for proc in (resume, layouts):
            if proc.poll() is None:
                proc.kill()
    return work


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]


def _load(path):
    return torch.load(path, weights_only=False)


def test_resume_in_a_new_process_continues_exactly_like_an_uninterrupted_run(work):
    reference, resumed = _load(work / "reference.pt"), _load(work / "resumed.pt")
    assert resumed["manifest"]["step"] == N and resumed["manifest"]["version"] == N
    assert resumed["manifest"]["run"] == {"note": "from the reference scenario"}
    assert resumed["losses"] == reference["losses"][N:]  # bit-identical per-step losses
    assert set(resumed["final"]) == set(reference["final"])
    for name, tensor in reference["final"].items():
        assert torch.equal(resumed["final"][name], tensor), name


def test_every_rng_continues_where_the_saved_process_left_it(work):
    saved, resumed = _load(work / "saved.pt")["draws"], _load(work / "resumed.pt")
    assert resumed["manifest"]["rng_restored"]
    got = resumed["draws"]
    assert torch.equal(got["torch"], saved["torch"])
    assert got["python"] == saved["python"] and got["numpy"] == saved["numpy"]
    assert set(got["tracker"]) == set(saved["tracker"]) and got["tracker"]
    for name, state in saved["tracker"].items():
        assert torch.equal(got["tracker"][name], state), name


@pytest.mark.parametrize("layout", ["tp2", "dp2", "pp2", "distopt_dp2_to_tp2"])
def test_a_checkpoint_continues_under_another_layout(work, layout):
    """tp2, dp2, pp2: the TP=1 checkpoint N.  distopt_dp2_to_tp2: a distributed optimizer's checkpoint
    N written under DP=2, loaded under TP=2.  Both: the uninterrupted TP=1 run's numbers."""
    saved, reference = _load(work / "saved.pt"), _load(work / "reference.pt")
    ranks = [_load(work / f"layout_{layout}.rank{r}.pt") for r in (0, 1)]
    got = ranks[0]
    assert not got["manifest"]["rng_restored"]  # RNG streams belong to the layout that wrote them
    assert (got["logprobs"] - saved["logprobs"]).abs().max().item() <= LEARNER_TOL
    # The next step (Adam moments and step count restored) gives the uninterrupted run's step N+1.
    assert abs(got["metrics"]["loss"] - reference["losses"][N]) <= 1e-5 * abs(reference["losses"][N])
    published = {**ranks[0]["published"], **ranks[1]["published"]}  # a PP stage publishes its own layers
    assert set(published) == set(reference["after_next"])
    for name, tensor in reference["after_next"].items():
        assert (published[name] - tensor).abs().max().item() <= 1e-5, name


def test_what_any_layout_publishes_is_bitwise_the_hf_export_of_the_same_state(work, tmp_path):
    """Checkpoint N exported to HF safetensors equals, byte for byte, what the learner publishes of that
    state: under TP1 (the run that wrote it) and after loading it under TP2, DP2 and PP2 (stages merged)."""
    from safetensors.torch import load_file

    exported = load_file(export_hf(work / "ckpt" / "step_00000002", tmp_path / "hf") / "model.safetensors")
    layouts = {"tp1": _load(work / "saved.pt")["published"]}
    for layout in ("tp2", "dp2", "pp2"):
        ranks = [_load(work / f"layout_{layout}.rank{r}.pt")["published_at_load"] for r in (0, 1)]
        layouts[layout] = {**ranks[0], **ranks[1]}
    for layout, published in layouts.items():
        assert set(published) == set(exported), layout
        for name, tensor in exported.items():
            assert published[name].dtype == tensor.dtype and torch.equal(published[name], tensor), (layout, name)


def test_a_save_killed_before_its_commit_leaves_latest_on_the_previous_checkpoint(work, tmp_path):
    root = work / "ckpt"
    assert storage.latest_name(root) == "step_00000002"
    assert storage.temp_dir(root, N + M).is_dir()  # the killed save's complete but uncommitted files
    assert not (root / storage.step_dir_name(N + M)).exists()
    # ... and `latest` loads: through the export, which reads it with no process group.
    saved = _load(work / "saved.pt")
    model = AutoModelForCausalLM.from_pretrained(export_hf(root, tmp_path / "hf"), dtype=torch.float32).eval()
    assert (_hf_logprobs(model, saved["probe"]) - saved["logprobs"]).abs().max().item() <= LEARNER_TOL


def test_a_write_error_on_one_rank_fails_the_save_on_every_rank_and_keeps_the_last_checkpoint(work):
    root = work / "full_ckpt"
    for rank in (0, 1):
        report = json.loads((work / f"diskfull.rank{rank}.json").read_text())
        error = report["error"]
        assert error is not None, f"rank {rank} did not see the failed save"
        assert str(storage.temp_dir(root, N + 2)) in error and "File too large" in error and "rank 1" in error
        assert f"previous checkpoint {root / 'step_00000003'} is intact" in error
        assert report["reloaded_diff"] == 0.0  # the previous checkpoint loads back exactly
    assert storage.latest_name(root) == "step_00000003"
    assert not storage.temp_dir(root, N + 2).exists() and not (root / "step_00000004").exists()


def _hf_logprobs(model, ids):
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(logp, (1, 0))


def test_export_is_an_hf_model_with_the_learners_logits(work, model_dir, tmp_path):
    saved = _load(work / "saved.pt")
    checkpoint = work / "ckpt" / "step_00000002"
    single = export_hf(checkpoint, tmp_path / "single")
    sharded = export_hf(checkpoint, tmp_path / "sharded", max_shard_bytes=20_000)
    assert (single / "model.safetensors").is_file() and (single / "tokenizer.json").is_file()
    # Every exported file is readable by others, as open() creates files (safetensors alone makes 0600).
    assert {path.name: oct(path.stat().st_mode & 0o777) for path in [*single.iterdir(), *sharded.iterdir()]
            if path.stat().st_mode & 0o777 != 0o644} == {}
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" in index["weight_map"]
    for out in (single, sharded):
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert (_hf_logprobs(model, saved["probe"]) - saved["logprobs"]).abs().max().item() <= LEARNER_TOL
    text = "12+7=19"
    assert AutoTokenizer.from_pretrained(single)(text)["input_ids"] == AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
    with pytest.raises(CheckpointError, match="not an empty directory"):
        export_hf(checkpoint, single)


def test_switching_the_optimizer_kind_on_resume_is_refused_by_name():
    check_optimizer({"version": 3, "optimizer": "plain"}, False, "ckpt")
    check_optimizer({"version": 0, "optimizer": "plain"}, True, "ckpt")  # no optimizer state saved yet
    with pytest.raises(CheckpointError, match="plain optimizer's state but learner.use_distributed_optimizer=True"):
        check_optimizer({"version": 3, "optimizer": "plain"}, True, "ckpt")


def test_a_checkpoint_of_another_architecture_is_refused_by_name():
    config = {"model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 2}
    check_architecture({"hf_config": config}, dict(config), "ckpt")
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        check_architecture({"hf_config": config}, {**config, "num_hidden_layers": 4}, "ckpt")


def test_a_checkpoint_resumes_under_another_tp_pp_dp_but_only_under_the_learner_ep_that_saved_it():
    """megatron-core chains a second Adam for expert-parallel experts at learner.ep > 1 and numbers its state by the
    experts a rank holds: its loader, given a checkpoint saved at ep=2 under ep=1, fails deep inside with a KeyError
    over `chained_0.` keys, so `megarl train` and the learner refuse it by name first. A manifest without an ep (one
    written at ep=1) reads as ep=1."""
    from megarl.checkpoint.manifest import check_resumable, layout_of
    from megarl.config.schema import LearnerConfig

    saved = {"layout": layout_of(LearnerConfig(dp=2, ep=2))}
    assert saved["layout"] == {"tp": 1, "pp": 1, "dp": 2, "ep": 2}
    check_resumable("ckpt", saved, LearnerConfig(tp=2, ep=2))
    check_resumable("ckpt", {"layout": {"tp": 1, "pp": 1, "dp": 2}}, LearnerConfig(tp=2, pp=2))
    with pytest.raises(CheckpointError, match=r"saved with learner\.ep=2, this run has learner\.ep=1.*resume with "
                                              r"learner\.ep=2"):
        check_resumable("ckpt", saved, LearnerConfig(dp=2))
    with pytest.raises(CheckpointError, match=r"saved with learner\.ep=1, this run has learner\.ep=2"):
        check_resumable("ckpt", {"layout": {"tp": 1, "pp": 1, "dp": 2}}, LearnerConfig(dp=2, ep=2))
