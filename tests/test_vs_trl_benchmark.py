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
