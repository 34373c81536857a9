"""configs/long.yaml: the lap-count task with a context-parallel learner (learner.cp=2) in pipeline mode."""
from __future__ import annotations

import json

from megarl.config.load import load_config
from megarl.embedded.registry import EMBEDDED_MODELS, LAP_COUNT_MAX_NEW_TOKENS
from megarl.observe.sinks import train_records
from megarl.rollout.tasks import task_from_config
from tests.helpers import REPO, run_python

LONG = str(REPO / "configs" / "long.yaml")


def test_long_config_budgets_the_longest_completion():
    cfg = load_config(LONG)
    task = task_from_config(cfg.task)
    assert cfg.learner.cp == 2 and cfg.algo.mode == "pipeline"
    assert cfg.sampling.max_new_tokens == task.max_completion_tokens() == LAP_COUNT_MAX_NEW_TOKENS
    assert cfg.sampler.max_seq_len >= 3 + cfg.sampling.max_new_tokens  # the prompts are 3 tokens
    spec = EMBEDDED_MODELS[cfg.model.path.removeprefix("embedded:")]
    assert spec.task == task and dict(spec.config)["max_position_embeddings"] >= cfg.sampler.max_seq_len


def test_long_config_trains_with_a_context_parallel_learner(embedded_count_model_dir, tmp_path):
    """Two steps of configs/long.yaml (3 processes: learner.cp=2 and a sampler) on the demo's model with short
    completion budgets: the config's wiring end to end (building tiny-qwen2-lapcount takes minutes)."""
    run_dir = tmp_path / "long"
    proc = run_python("-m", "megarl.cli", "train", LONG, f"run.dir={run_dir}", "run.steps=2",
                      f"model.path={embedded_count_model_dir}", "sampling.max_new_tokens=40", "sampler.max_seq_len=64",
                      "algo.prompts_per_step=2", "algo.group_size=4", timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "step 2/2" in proc.stdout and "multi-version" in proc.stdout
    metrics = train_records([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])
    assert [m["step"] for m in metrics] == [0, 1]
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts and all(r["prompt"][0].isdigit() and r["prompt"].endswith("=") for r in rollouts)
