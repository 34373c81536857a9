"""The frozen teacher of on-policy distillation (`algo.distill`, megarl.algo.distill): an HF causal LM that
scores the student's sampled tokens on the learner ranks, and the checks that refuse, before launch, a
teacher the student cannot be distilled from.

The teacher runs whole (no tensor or pipeline parallelism) through transformers on every learner rank that
computes a loss, in eval mode, without gradients or optimizer state, on exactly the micro-batches of the step
(so it works unchanged under both learner backends and any student layout). Cost per learner rank: one copy of
the teacher's weights (bf16 on GPU, fp32 on CPU) and one forward per micro-batch per step, plus its logits'
activation memory; at learner.tp > 1 every TP rank repeats the same forward (docs/algorithms.md#on-policy-distillation).
Under the megatron learner's context parallelism the CP ranks, which hold the same rows, split each micro-batch's
rows instead (`row_group`): each scores its share of whole rows and the log-probs are gathered back per token.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.learner.context_parallel import rows_in_shares
from megarl.models import convert

KEY = "algo.distill.teacher"


class Teacher:
    def __init__(self, model_dir: str | Path, device: torch.device, temperature: float = 1.0, row_group=None):
        """`row_group` (None: none): the ranks that hold the same rows and split them (the module docstring)."""
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
        self.model.requires_grad_(False).eval()
        self.device, self.temperature = device, temperature
        self.row_group = row_group
        self.row_split = (1, 0) if row_group is None else (dist.get_world_size(row_group), dist.get_rank(row_group))

    @torch.no_grad()
    def attach(self, micro: list[dict[str, torch.Tensor]]) -> float:
        """Store in each micro-batch its rows' teacher log-probs [B, S] (fp32, CPU; column 0 is 0) under
        `teacher_logprobs`, at the sampling temperature the student's log-probs use; return the seconds it took
        (the teacher's cost per step, reported as distill/teacher_s). Rows are right-padded, so causal attention
        without a mask leaves every real position's score exact."""
        from megarl.learner.step import token_logprobs

        start = time.perf_counter()
        def scores(ids):
            return token_logprobs(self.model(input_ids=ids, use_cache=False).logits, ids, self.temperature)

        for mb in micro:
            mb["teacher_logprobs"] = rows_in_shares(scores, mb["input_ids"], self.row_split, self.row_group,
                                                    self.device).cpu()
        return time.perf_counter() - start


def check_teacher(teacher_dir: str | Path, student_dir: str | Path, max_seq_len: int) -> None:
    """ValueError naming algo.distill.teacher (and both directories) if the teacher cannot score the student's
    samples: not a causal LM transformers loads, no weights, a tokenizer that differs from the student's
    (vocabulary or special tokens), a vocabulary too small for the student's token ids, or a context shorter
    than sampler.max_seq_len."""
    from transformers import AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    teacher_dir, student_dir = Path(teacher_dir), Path(student_dir)
    where = f"{KEY} ({teacher_dir})"
    teacher_cfg = convert.read_config(teacher_dir, where)
    student_cfg = json.loads((student_dir / "config.json").read_text())
    model_type = teacher_cfg.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{where}: model_type {model_type!r} is not a causal LM transformers can load "
                         f"(AutoModelForCausalLM); the teacher runs through transformers on the learner ranks")
    if not convert.has_weights(teacher_dir):
        raise ValueError(f"{where}: no weights (model.safetensors or model.safetensors.index.json)")
    teacher_vocab, student_vocab = teacher_cfg.get("vocab_size"), student_cfg.get("vocab_size")
    if not isinstance(teacher_vocab, int) or teacher_vocab < student_vocab:
        raise ValueError(f"{where}: vocab_size {teacher_vocab!r} is smaller than the student's ({student_dir}: "
                         f"{student_vocab}): token ids the student samples would fall outside the teacher's vocabulary")
    context = teacher_cfg.get("max_position_embeddings")
    if isinstance(context, int) and context < max_seq_len:
        raise ValueError(f"{where}: max_position_embeddings={context} is shorter than sampler.max_seq_len={max_seq_len}, "
                         f"the longest sequence the teacher must score")
    try:
        teacher_tok = AutoTokenizer.from_pretrained(teacher_dir)
    except Exception as exc:  # noqa: BLE001 - whatever a broken tokenizer file raises
        raise ValueError(f"{where}: the tokenizer does not load: {type(exc).__name__}: {str(exc)[:300]}") from exc
    difference = tokenizer_difference(AutoTokenizer.from_pretrained(student_dir), teacher_tok)
    if difference:
        raise ValueError(f"{where}: its tokenizer differs from the student's (model.path, {student_dir}): {difference}; "
                         f"the teacher scores the student's token ids, so both must share one tokenizer")


def tokenizer_difference(student, teacher) -> str:
    """'' if the two tokenizers map every token to the same id and name the same special tokens, else the
    first difference, in words."""
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        only_s = sorted(set(s_vocab.items()) - set(t_vocab.items()), key=lambda kv: kv[1])[:3]
        only_t = sorted(set(t_vocab.items()) - set(s_vocab.items()), key=lambda kv: kv[1])[:3]
        return (f"vocabularies differ ({len(s_vocab)} vs {len(t_vocab)} tokens; token -> id only in the student's: "
                f"{only_s}, only in the teacher's: {only_t})")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            return f"{name} {getattr(student, name)!r} vs {getattr(teacher, name)!r}"
    if sorted(student.all_special_tokens) != sorted(teacher.all_special_tokens):
        return f"special tokens {sorted(student.all_special_tokens)} vs {sorted(teacher.all_special_tokens)}"
    return ""
