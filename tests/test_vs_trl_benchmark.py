"""benchmarks/vs_trl.py's pieces, without TRL: the demo's settings mapped onto GRPOConfig and the table that says
what matches, the shared prompt stream, the time-to-threshold read-out and the JSON line's ratios (one round's, and
the median over repeated rounds)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import vs_trl  # noqa: E402

from megarl.config.load import load_config  # noqa: E402


@pytest.fixture(scope="module")
def demo():
    return load_config(str(vs_trl.ROOT / vs_trl.DEMO), list(vs_trl.MEGARL_OVERRIDES))


def test_the_demo_settings_map_onto_grpo_config_and_the_table_names_what_does_not_match(demo):
    kwargs, rows = vs_trl.trl_settings(demo, steps=200, seed=0, trl_threads=2)
    # 16 prompts x 8 samples per optimizer step, in micro-batches of 64: one generation per optimizer step
    assert kwargs["num_generations"] == 8
    assert kwargs["per_device_train_batch_size"] * kwargs["gradient_accumulation_steps"] == 128
    assert kwargs["steps_per_generation"] == kwargs["gradient_accumulation_steps"] and kwargs["num_iterations"] == 1
    assert (kwargs["max_completion_length"], kwargs["temperature"], kwargs["top_k"]) == (49, 1.0, 0)
    assert (kwargs["learning_rate"], kwargs["lr_scheduler_type"], kwargs["beta"]) == (5e-4, "constant", 0.0)
    assert (kwargs["epsilon"], kwargs["epsilon_high"], kwargs["loss_type"]) == (0.2, 0.28, "grpo")
    assert (kwargs["bf16"], kwargs["fp16"], kwargs["max_grad_norm"]) == (False, False, 0.0)
    unmatched = {setting for setting, _, _, ok in rows if not ok}
    assert unmatched == {"generation", "importance ratio denominator", "positions the learner computes"}
    table = vs_trl.format_settings(rows)
    assert table.splitlines()[0].split() == ["setting", "megarl", "TRL", "GRPOTrainer", "match"]
    assert len(table.splitlines()) == len(rows) + 1 and table.count(" NO") == 3


def test_a_setting_trl_cannot_take_is_reported_as_a_mismatch(demo):
    token_mean = load_config(str(vs_trl.ROOT / vs_trl.DEMO), ["algo.loss.aggregation=token_mean",
                                                               "algo.advantage.eps=1e-6"])
    unmatched = {setting for setting, _, _, ok in vs_trl.trl_settings(token_mean, 200, 0, trl_threads=1)[1] if not ok}
    assert {"loss aggregation", "advantage epsilon", "held-out evaluation", "torch threads"} <= unmatched


def test_trl_gets_the_prompts_megarl_sampler_0_draws(demo):
    from megarl.rollout.tasks import prompt_rng, task_from_config

    prompts = vs_trl.demo_prompts(demo, 3)
    first = task_from_config(demo.task).sample_prompts(prompt_rng(demo.run.seed, 0, 0), 1)[0]
    assert prompts[0] == {"prompt": first.text, "answer": first.answer} and len(prompts) == 3
    assert all(p["prompt"].endswith("=") and p["answer"] for p in prompts)


def test_time_to_threshold_and_the_json_ratios():
    # 30 steps of 1 s training each (wall time 10 s later); reward 0 then 1 from step 11 on: the rolling
    # 10-step mean reaches 0.7 at step 17, 0.9 at step 19.
    curve = {"train_s": [i + 1.0 for i in range(30)], "wall_s": [i + 11.0 for i in range(30)],
             "reward": [0.0] * 10 + [1.0] * 20, "tokens": [100] * 30}
    summary = vs_trl.curve_summary(curve)
    assert summary["reached"]["0.7"] == {"step": 17, "train_s": 17.0, "wall_s": 27.0}
    assert summary["reached"]["0.9"] == {"step": 19, "train_s": 19.0, "wall_s": 29.0}
    assert summary["tokens_per_s"] == 100.0 and summary["final_reward"] == 1.0
    slower = vs_trl.curve_summary({**curve, "train_s": [2 * t for t in curve["train_s"]],
                                   "wall_s": [2 * t + 5 for t in curve["train_s"]]})
    assert vs_trl.ratios(summary, slower) == {"time_to_target_ratio_vs_trl": 2.0,
                                              "wall_to_target_ratio_vs_trl": round(43 / 29, 3),
                                              "tokens_per_s_ratio_vs_trl": 2.0}
    never = vs_trl.curve_summary({**curve, "reward": [0.5] * 30})
    assert never["reached"]["0.9"] is None and vs_trl.ratios(summary, never)["time_to_target_ratio_vs_trl"] is None


def test_repeated_rounds_report_the_median_ratio_and_its_range():
    rounds = [{"time_to_target_ratio_vs_trl": 2.0, "wall_to_target_ratio_vs_trl": 1.5},
              {"time_to_target_ratio_vs_trl": 3.0, "wall_to_target_ratio_vs_trl": None},  # TRL never got there
              {"time_to_target_ratio_vs_trl": 2.5, "wall_to_target_ratio_vs_trl": 1.7}]
    assert vs_trl.median_ratios(rounds) == {"time_to_target_ratio_vs_trl": 2.5,
                                            "time_to_target_ratio_vs_trl_range": [2.0, 3.0],
                                            "wall_to_target_ratio_vs_trl": 1.6,
                                            "wall_to_target_ratio_vs_trl_range": [1.5, 1.7]}
    assert vs_trl.median_ratios([{"time_to_target_ratio_vs_trl": None}]) == {
        "time_to_target_ratio_vs_trl": None, "time_to_target_ratio_vs_trl_range": None}


def test_where_the_training_time_went():
    # TRL: 10 steps of 2 s, 1.5 s of each generating; megarl: the learner trains 0.5 s of each 1 s step, and the
    # samplers' running busy share ends at 0.4.
    trl = vs_trl.curve_summary({"train_s": [2.0 * (i + 1) for i in range(10)], "wall_s": [0.0] * 10,
                                "reward": [0.0] * 10, "tokens": [1] * 10, "generate_s": [1.5] * 10})
    assert trl["generate_frac"] == 0.75 and "learner_busy_frac" not in trl
    megarl = vs_trl.curve_summary({"train_s": [i + 1.0 for i in range(10)], "wall_s": [0.0] * 10,
                                   "reward": [0.0] * 10, "tokens": [1] * 10, "learner_s": [0.5] * 10,
                                   "sampler_busy_frac": [0.9] * 9 + [0.4]})
    assert megarl["learner_busy_frac"] == 0.5 and megarl["sampler_busy_frac"] == 0.4
    assert "generate_frac" not in megarl


def test_a_repeat_count_below_one_is_refused_naming_the_flag():
    import subprocess

    proc = subprocess.run([sys.executable, str(vs_trl.ROOT / "benchmarks" / "vs_trl.py"), "--repeats", "0", "--dry-run"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--repeats must be at least 1, got 0" in proc.stderr


def _dry_run(*flags) -> dict:
    import json
    import subprocess

    proc = subprocess.run([sys.executable, str(vs_trl.ROOT / "benchmarks" / "vs_trl.py"), "--dry-run", *flags],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_qwen3_shape_dry_run_plans_megarl_pipeline_and_trl_on_random_weights_at_that_shape():
    from shapes import SHAPE_OVERRIDES

    plan = _dry_run("--shape", "qwen3-0.6b")
    assert (plan["shape"], plan["steps"], plan["runs"]) == ("qwen3-0.6b", 3, ["megarl pipeline", "TRL"])
    assert "shape-qwen3-0.6b-" in plan["model_dir"]
    assert plan["megarl_overrides"] == list(SHAPE_OVERRIDES["qwen3-0.6b"]) and "no target" in plan["reports"]
    assert plan["parameters"] == 440_737_792  # 28 layers of 15.7M + the local vocabulary's tied embeddings


def test_the_with_eval_dry_run_plans_megarl_with_evaluation_on_and_off_and_no_trl():
    plan = _dry_run("--with-eval")
    assert plan["with_eval"] and plan["shape"] == "demo" and plan["steps"] == 200
    assert plan["runs"] == ["megarl pipeline, held-out evaluation on", "megarl pipeline, evaluation off"]


def test_shape_defaults_and_a_with_eval_at_a_real_shape_is_refused_naming_the_flags(capsys):
    assert (vs_trl.parse_args([]).steps, vs_trl.parse_args([]).skip) == (200, [])
    real = vs_trl.parse_args(["--shape", "qwen3-0.6b"])
    assert (real.steps, real.skip) == (3, ["sync"]) and vs_trl.parse_args(["--shape", "qwen3-0.6b", "--steps", "5"]).steps == 5
    with pytest.raises(SystemExit):
        vs_trl.parse_args(["--with-eval", "--shape", "qwen3-0.6b"])
    assert "drop --shape or --with-eval" in capsys.readouterr().err
    assert vs_trl.shape_overrides("demo", None) == []
    assert vs_trl.shape_overrides("qwen3-0.6b", Path("/m"))[0] == "model.path=/m"


def test_the_parameter_count_is_the_qwen3_models():
    import torch
    from shapes import QWEN3_06B, parameter_count, qwen3_config
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = AutoModelForCausalLM.from_config(qwen3_config(QWEN3_06B))
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size) == (1024, 28, 16, 8, 128, 3072)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(QWEN3_06B)


def test_the_step_time_split_of_each_system():
    # megarl: steps end at 3, 4, 5 s (the first holds start-up and is left out): 1 s each, of which the learner
    # waits 0.2, trains 0.7, publishes 0.1; the samplers decode 60% of the time.
    megarl = {"train_s": [3.0, 4.0, 5.0], "learner_s": [2.0, 0.7, 0.7], "wait_s": [0.9, 0.2, 0.2],
              "publish_s": [0.1, 0.1, 0.1], "sampler_busy_frac": [0.5, 0.6, 0.6]}
    assert vs_trl.time_split(megarl) == {"step_s": 1.0, "steps_averaged": 2, "wait_s": 0.2, "train_s": 0.7,
                                         "publish_s": 0.1, "generate_s (samplers, beside the learner)": 0.6}
    trl = {"train_s": [4.0, 8.0], "generate_s": [3.0, 3.0]}
    assert vs_trl.time_split(trl) == {"step_s": 4.0, "steps_averaged": 1, "generate_s": 3.0, "train_s": 1.0}
    assert vs_trl.time_split({"train_s": [2.0], "generate_s": [1.5]})["steps_averaged"] == 1  # one step: kept


def test_what_evaluation_costs_the_learner():
    # 20 steps waiting 0.1 s; the 8 steps after the evaluation at step 10 wait 0.3 s each (0.2 s extra each);
    # the final evaluation is reported 1.5 s after the last step.
    steps = [{"step": s, "queue_wait_s": 0.3 if 10 < s <= 18 else 0.1, "time": float(s)} for s in range(1, 21)]
    evals = [{"kind": "eval", "step": 10, "time": 10.5, "eval_s": 0.4},
             {"kind": "eval", "step": 20, "time": 21.5, "eval_s": 0.6}]
    cost = vs_trl.eval_cost(steps + evals)
    assert cost == {"evaluations": 2, "eval_s": 1.0, "mean_queue_wait_s": 0.1, "extra_queue_wait_s": 1.6,
                    "final_eval_wait_s": 1.5}
    assert vs_trl.eval_cost(steps)["final_eval_wait_s"] == 0.0 and vs_trl.eval_cost(steps)["extra_queue_wait_s"] == 0.0


def test_the_real_shape_json_line_holds_the_ratio_and_each_systems_memory():
    results = {"megarl pipeline": {"summary": {"tokens_per_s": 30.0, "steps": 3}, "split": {"step_s": 1.0},
                                   "peak_rss_mb": {"learner0": 9000.0, "sampler0": 2500.0}},
               "TRL GRPOTrainer": {"summary": {"tokens_per_s": 10.0, "steps": 3}, "split": {"step_s": 3.0},
                                   "peak_rss_mb": {"TRL": 8000.0}}}
    line = vs_trl.shape_line(results, "qwen3-0.6b")
    assert line["tokens_per_s_ratio_vs_trl"] == 3.0 and line["TRL GRPOTrainer"]["peak_rss_mb"] == {"TRL": 8000.0}
    assert "not time to a target" in line["note"]


def test_megarl_processes_are_named_by_their_torchrun_rank():
    label = vs_trl.megarl_process_label(learners=1)
    assert label(1, "python -m megarl.worker", {"RANK": "0", "LOCAL_RANK": "0"}) == "learner0"
    assert label(2, "python -m megarl.worker", {"RANK": "2", "LOCAL_RANK": "2"}) == "sampler1"
    assert label(3, "/venv/bin/python /venv/bin/torchrun --nproc-per-node 2", {}) == "torchrun"
    assert label(4, "python -m megarl.cli train configs/demo.yaml", {}) == "megarl cli"
    assert label(5, "sh -c true", {}) is None


def test_peak_rss_reads_a_childs_high_water_mark():
    import subprocess

    from peak_rss import PeakRss

    # The child touches 64 MiB, then lives long enough for a few readings.
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(2)"])
    with PeakRss(child.pid, lambda pid, cmdline, env: "child", interval_s=0.1) as peaks:
        child.wait(timeout=60)
    assert peaks.by_label()["child"] >= 64
