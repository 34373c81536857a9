"""Each rank imports only what its role builds from: a sampler no learner framework (megatron-core, DeepSpeed,
dynamo, transformers' modeling code), a learner no inference engine. Every rank of every launch pays its imports on
the cores the others start on (docs/benchmarks.md, "Start-up, part by part"); checked on the modules a fresh
interpreter holds after `role_entry`, no timing."""
from __future__ import annotations

import json

import pytest

from tests.helpers import REPO, run_python

LEARNER_ONLY = ("megatron", "deepspeed", "torch._dynamo", "transformers.modeling_utils", "megarl.learner.megatron",
                "megarl.learner.deepspeed")
SAMPLER_ONLY = ("megarl.sampler", "sglang", "vllm", "transformers.modeling_utils")


@pytest.mark.parametrize("role, absent", [("sampler", LEARNER_ONLY), ("learner", SAMPLER_ONLY)])
def test_a_rank_imports_only_what_its_role_uses(role, absent):
    child = ("import json, sys; from megarl.config.load import load_config; from megarl.roles.worker import "
             f"role_entry; role_entry(load_config({str(REPO / 'configs' / 'demo.yaml')!r}, []), {role!r}); "
             "print(json.dumps(sorted(sys.modules)))")
    proc = run_python("-c", child, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = json.loads(proc.stdout.splitlines()[-1])
    assert [m for m in loaded if m in absent or m.startswith(tuple(a + "." for a in absent))] == []


def test_the_cli_checks_import_no_torch(embedded_count_model_dir, tmp_path):
    """`megarl train`'s checks before the launch (config, model directory, layout, LoRA, task, checkpoint) read
    config.json and files, not tensors: they run on the cores the ranks start on, so they import neither torch nor
    transformers (each ~1 CPU-s, which every rank imports again). The tokenizer check loads the tokenizer with
    transformers once per content (megarl/check_memo.py): this process fills the memo, a fresh one is checked."""
    from megarl.cli import checked_for_launch
    from megarl.config.load import load_config

    demo = str(REPO / "configs" / "demo.yaml")
    overrides = [f"model.path={embedded_count_model_dir}", f"model.cache_dir={tmp_path / 'cache'}",
                 f"run.dir={tmp_path / 'run'}"]
    assert checked_for_launch(load_config(demo, overrides)) is not None  # (the tokenizer and eval-set checks remembered)
    child = ("import json, sys; from megarl.cli import build_parser, checked_config, checked_for_launch; "
             f"args = build_parser().parse_args(['train', {demo!r}, *{overrides!r}]); "
             "assert checked_for_launch(checked_config(args)[0]) is not None; print(json.dumps(sorted(sys.modules)))")
    proc = run_python("-c", child, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = json.loads(proc.stdout.splitlines()[-1])
    assert [m for m in loaded if m.split(".")[0] in ("torch", "transformers", "megatron", "deepspeed")] == []
