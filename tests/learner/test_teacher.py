"""The distillation teacher (megarl.learner.teacher): its checks refuse, naming algo.distill.teacher and both
directories, what cannot score the student's tokens; `megarl train` refuses before launch; its log-probs are
an independent HF recomputation's."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.learner.teacher import Teacher, check_teacher
from tests.helpers import REPO, save_tiny_qwen2


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return save_tiny_qwen2(tmp_path_factory.mktemp("student"), tie_word_embeddings=True, vocab_size=264, tokenizer=True)


def variant(student, tmp_path, edit_config=None, edit_tokenizer=None):
    teacher = tmp_path / "teacher"
    shutil.copytree(student, teacher)
    if edit_config:
        cfg = json.loads((teacher / "config.json").read_text())
        edit_config(cfg)
        (teacher / "config.json").write_text(json.dumps(cfg))
    if edit_tokenizer:
        tok = AutoTokenizer.from_pretrained(teacher)
        edit_tokenizer(tok)
        tok.save_pretrained(teacher)
    return teacher


def test_same_tokenizer_passes(student, tmp_path):
    check_teacher(variant(student, tmp_path), student, max_seq_len=64)


@pytest.mark.parametrize("edit_tokenizer,why", [
    (lambda tok: tok.add_tokens(["<|extra|>"], special_tokens=True), "vocabularies differ"),
    (lambda tok: setattr(tok, "eos_token", "<|reserved_0|>"), "eos_token_id"),
])
def test_another_tokenizer_is_refused_naming_both(student, tmp_path, edit_tokenizer, why):
    teacher = variant(student, tmp_path, edit_tokenizer=edit_tokenizer)
    with pytest.raises(ValueError, match=why) as err:
        check_teacher(teacher, student, max_seq_len=64)
    assert str(err.value).startswith(f"algo.distill.teacher ({teacher})") and str(student) in str(err.value)


@pytest.mark.parametrize("edit,why", [
    (lambda cfg: cfg.update(vocab_size=200), "vocab_size 200 is smaller than the student's"),
    (lambda cfg: cfg.update(max_position_embeddings=32), "max_position_embeddings=32 is shorter than sampler.max_seq_len=64"),
    (lambda cfg: cfg.update(model_type="vit"), "not a causal LM"),
])
def test_a_teacher_that_does_not_fit_is_refused(student, tmp_path, edit, why):
    with pytest.raises(ValueError, match=f"^algo.distill.teacher .*{why}"):
        check_teacher(variant(student, tmp_path, edit_config=edit), student, max_seq_len=64)


def test_megarl_train_refuses_before_launch(student, tmp_path, capsys):
    """`megarl train`'s check (megarl.cli.teacher_fits, called before the task, eval and torchrun)."""
    from megarl.cli import teacher_fits
    from megarl.config.load import load_config

    teacher = variant(student, tmp_path, edit_tokenizer=lambda tok: tok.add_tokens(["<|extra|>"], special_tokens=True))
    cfg = load_config(REPO / "configs" / "demo.yaml", [f"model.path={student}", f"algo.distill.teacher={teacher}"])
    assert not teacher_fits(cfg, student)
    err = capsys.readouterr().err
    assert err.startswith(f"megarl: algo.distill.teacher ({teacher})") and str(student) in err
    cfg.algo.distill.teacher = str(tmp_path / "nowhere")
    assert not teacher_fits(cfg, student)
    assert capsys.readouterr().err.startswith("megarl: algo.distill.teacher: model path")


def test_teacher_logprobs_are_hf_recomputed(student, tmp_path):
    """Right-padded rows scored at the sampling temperature: each real position's log-prob equals a forward of
    that row alone, unpadded."""
    teacher = Teacher(student, torch.device("cpu"), temperature=0.7)
    ids = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(0))
    lengths = [12, 7, 4]
    micro = [{"input_ids": ids}]
    teacher.attach(micro)
    hf = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).eval()
    for row, n in enumerate(lengths):
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids[row:row + 1, :n]).logits[0, :-1].double() / 0.7, -1)
        expected = logp.gather(1, ids[row, 1:n, None])[:, 0]
        torch.testing.assert_close(micro[0]["teacher_logprobs"][row, 1:n].double(), expected, rtol=0, atol=1e-5)
        assert micro[0]["teacher_logprobs"][row, 0] == 0
