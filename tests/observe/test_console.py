"""The console a person watching a run sees: the progress line, notes that never glue onto it on a real
terminal (a pty), and the closing summary."""
import io
import math
import os
import pty
import re

import pytest

from megarl.observe.console import Console, format_duration, tenth_means
from megarl.observe.score_drop import drop_in_standard_errors


def read_all(fd: int) -> str:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return out.decode()
        if not chunk:
            return out.decode()
        out += chunk


def step_metrics(reward: float, errors: float = 0.0) -> dict:
    return {"reward_mean": reward, "lag_mean": 1.5, "lag_max": 2, "tokens_per_s": 900.0,
            "dropped/stale_groups_total": 3, "reward_errors": errors}


def test_plain_lines_carry_multi_version_share_eta_and_reward_errors_only_when_some_failed():
    out = io.StringIO()
    console = Console(4, True, "runs/x", stream=out)
    console.update(1, step_metrics(0.25), [1, 1, 2, 3])
    console.update(2, step_metrics(0.5, errors=1.0), [1, 2, 1, 1])
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in out.getvalue()  # not a terminal: plain lines (a short run: every step)
    assert lines[0].startswith("step 1/4  reward 0.250  multi-version 50%  lag 1.5/2") and "eta --" in lines[0]
    assert re.search(r"multi-version 38%.* eta \d+:\d\d  reward errors 25%$", lines[1]), lines[1]
    assert "reward errors" not in lines[0]


def test_a_long_run_s_log_holds_about_a_hundred_progress_lines_and_the_last_step():
    out = io.StringIO()
    console = Console(1500, True, "runs/x", stream=out)
    for step in range(1, 1501):
        console.update(step, step_metrics(0.5), [1])
    steps = [int(line.split()[1].split("/")[0]) for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert steps == list(range(15, 1501, 15))  # every ceil(1500 / 100) = 15 steps, the last among them


def test_summary_gives_reward_first_to_last_tenth_shares_outputs_and_the_plot_commands():
    out = io.StringIO()
    console = Console(20, True, "runs/demo", stream=out)
    for step in range(1, 21):
        console.update(step, step_metrics(0.1 if step <= 2 else 0.9 if step > 18 else 0.5), [1, 2, 2, 3])
    console.close()
    summary = out.getvalue().split("step 20/20")[1]
    assert "reward 0.100 -> 0.900" in summary
    assert "80 rollouts trained; 75.0% hold tokens of >= 2 policy versions, 25.0% of >= 3; 2.00 versions" in summary
    assert "outputs in runs/demo/" in summary
    assert "python benchmarks/plot_rollouts.py runs/demo" in summary and "plot_timeline.py runs/demo" in summary


def test_tokens_the_lag_bound_masked_show_on_the_progress_line_and_in_the_summary_only_with_a_bound():
    out = io.StringIO()
    console = Console(2, True, "runs/x", stream=out)
    console.update(1, {**step_metrics(0.5), "mask/lag_frac": 0.1, "mask/tokens": 100}, [1])
    console.update(2, {**step_metrics(0.5), "mask/lag_frac": 0.0, "mask/tokens": 100}, [1])
    console.close()
    lines = out.getvalue().splitlines()
    assert "stale 3 (masked 10.0%)" in lines[0] and "stale 3 (masked 5.0%)" in lines[1]
    assert "10 tokens older than loss.max_token_lag given no policy gradient (5.0% of the trained tokens" in out.getvalue()
    out = io.StringIO()
    console = Console(1, True, "runs/x", stream=out)  # no lag bound (algo.stale=drop_group): no mask/lag_frac
    console.update(1, step_metrics(0.5), [1])
    console.close()
    assert "masked" not in out.getvalue()


def test_the_summary_gives_each_source_s_reward_first_to_last_tenth_of_the_steps_holding_it():
    out = io.StringIO()
    console = Console(10, True, "runs/x", stream=out)
    for step in range(1, 11):
        sources = {"reward/source/gsm8k": 0.1 * step, **({"reward/source/math": 0.5} if step % 2 else {})}
        console.update(step, {**step_metrics(0.5), **sources}, [1])
    console.close()
    assert ("megarl: reward by source: gsm8k 0.100 -> 1.000, math 0.500 -> 0.500 (first -> last 10% of the steps "
            "holding the source)") in out.getvalue()


def test_the_summary_gives_the_policy_entropy_first_to_last_tenth_when_the_learner_reports_it():
    out = io.StringIO()
    console = Console(20, True, "runs/x", stream=out)
    for step in range(1, 21):
        console.update(step, {**step_metrics(0.5), "entropy/mean": 1.0 - 0.04 * step}, [1])
    console.close()
    assert "megarl: policy entropy 0.940 -> 0.220 nats per trained token (first -> last 10% of steps" in out.getvalue()
    out = io.StringIO()
    console = Console(1, True, "runs/x", stream=out)
    console.update(1, step_metrics(0.5), [1])  # loss.entropy_metric=false
    console.close()
    assert "entropy" not in out.getvalue()


def test_the_summary_counts_the_samples_overlong_shaping_penalised_only_when_it_is_on():
    out = io.StringIO()
    console = Console(2, True, "runs/x", stream=out)
    console.update(1, {**step_metrics(0.5), "samples/overlong_penalised": 1, "reward/overlong_penalty_mean": -0.1},
                   [1, 1, 1, 1])
    console.update(2, {**step_metrics(0.5), "samples/overlong_penalised": 2, "reward/overlong_penalty_mean": -0.3},
                   [1, 1, 1, 1])
    console.close()
    assert ("3 of 8 trained samples came within algo.advantage.overlong_buffer of their length limit and lost reward "
            "for it (mean penalty -0.200 per sample; the rewards above are the task's)") in out.getvalue()
    out = io.StringIO()
    console = Console(1, True, "runs/x", stream=out)
    console.update(1, step_metrics(0.5), [1])
    console.close()
    assert "overlong" not in out.getvalue()


def test_no_summary_for_a_run_that_stopped_early_or_a_disabled_console():
    for total, enabled in [(5, True), (2, False)]:
        out = io.StringIO()
        console = Console(total, enabled, "runs/x", stream=out)
        console.update(1, step_metrics(0.5), [1])
        console.update(2, step_metrics(0.5), [1])
        console.close()
        assert "megarl: done" not in out.getvalue()
        assert bool(out.getvalue()) == enabled


def test_on_a_terminal_a_note_clears_the_progress_line_and_the_line_comes_back():
    master, slave = pty.openpty()
    os.set_blocking(master, False)
    with os.fdopen(slave, "w") as tty:
        console = Console(3, True, "runs/x", stream=tty)
        assert console.tty
        console.update(1, step_metrics(0.5), [1, 2])
        console.note("megarl: checkpoint runs/x/checkpoints/step_1 (0.3s)")
        console.update(2, step_metrics(0.6), [1])
        console.update(3, step_metrics(0.7), [1])
        console.close()
        shown = read_all(master)
    # The note starts on a cleared line (never glued after "eta --"), then the progress line is redrawn.
    before, after = shown.split("megarl: checkpoint runs/x/checkpoints/step_1 (0.3s)")
    assert re.search(r"eta --\s*\r *\r$", before), repr(before[-200:])
    assert after.startswith("\r\n\rstep 1/3"), repr(after[:40])  # the pty turns "\n" into "\r\n"
    assert "\rstep 3/3" in after and "megarl: done, 3 steps" in after
    # Every progress line overwrites the last one on the same terminal row: no newline before the last step.
    assert "\n" not in after.split("\rstep 1/3")[1].split("step 3/3")[0]


def test_durations_and_tenths():
    assert format_duration(59.6) == "1:00" and format_duration(3725) == "1:02:05" and format_duration(-3) == "0:00"
    assert tenth_means([0.0] * 5 + [1.0] * 5) == (0.0, 1.0) and tenth_means([0.5]) == (0.5, 0.5)


def test_tok_s_is_the_tokens_of_the_last_steps_over_their_time_not_one_steps_rate():
    out = io.StringIO()
    console = Console(12, True, "runs/x", stream=out)
    # Alternating steps: 100 tokens in 0.01 s (a batch that was waiting: 10,000 tok/s), 100 tokens in 1 s (100 tok/s).
    for step in range(1, 13):
        fast = step % 2
        console.update(step, {**step_metrics(0.5), "tokens_per_s": 10_000.0 if fast else 100.0,
                              "step_s": 0.01 if fast else 1.0}, [1])
    lines = out.getvalue().splitlines()
    assert "tok/s 10000 (1-step mean)" in lines[0]
    assert "tok/s 198 (10-step mean)" in lines[-1]  # 1000 tokens in 5 * 1.01 s


def test_the_summary_counts_failed_and_dropped_episodes_only_when_there_were_some():
    out = io.StringIO()
    console = Console(2, True, "runs/x", stream=out)
    console.update(1, {**step_metrics(0.5), "sampler1/env_failures": 2.0, "sampler1/dropped_samples": 1.0,
                       "sampler1/failed_groups": 0.0, "sampler2/env_failures": 0.0}, [1])
    console.update(2, {**step_metrics(0.5), "sampler1/env_failures": 6.0, "sampler1/dropped_samples": 6.0,
                       "sampler1/failed_groups": 1.0, "sampler2/env_failures": 1.0}, [1])  # running counts
    assert ("megarl: 7 episodes failed (environment or agent errors, scored 0); 6 episodes without a model turn "
            "dropped before sending, 1 groups left empty and replaced") in console.summary()
    quiet = Console(1, True, "runs/x", stream=io.StringIO())
    quiet.update(1, {**step_metrics(0.5), "sampler1/env_failures": 0.0}, [1])
    assert "episodes failed" not in quiet.summary()


def test_eval_lines_say_what_was_scored_and_label_the_greedy_mean_reward_apart_from_pass_at_k():
    out = io.StringIO()
    console = Console(0, True, "runs/x", stream=out)
    metrics = {"eval/heldout/reward_mean": 0.5, "eval/heldout/pass@1": 0.5, "eval/heldout/pass@4": 0.75,
               "eval/heldout/greedy": 0.625, "eval_s": 1.0}
    console.evaluated(0, 0, metrics, what="of the model at hf/ (model.path)")
    console.evaluated(3, 3, metrics)
    first, second = out.getvalue().splitlines()
    assert first.startswith("megarl: eval of the model at hf/ (model.path) (1.0s): heldout reward_mean 0.500 ")
    assert "version 0" not in first
    assert second.startswith("megarl: eval version 3 (step 3, 1.0s): ")
    assert "pass@1 (share correct) 0.500 pass@4 0.750 greedy reward_mean 0.625" in first


def test_the_summary_gives_the_critic_the_teacher_kl_and_the_tokens_router_agreement_rests_on():
    console = Console(10, True, "runs/x", stream=io.StringIO())
    for step in range(1, 11):
        console.update(step, {**step_metrics(0.5), "critic/explained_var": step / 10, "critic/value_loss": 1 / step,
                              "distill/teacher_kl": 0.2 / step, "router/agreement": 0.99, "router/tokens": 100.0,
                              "router/token_diff_frac": 0.01, "lag0/router_agreement": 1.0,
                              "lag0/router_tokens": 40.0}, [1])
    summary = console.summary()
    assert "megarl: critic explained variance 0.100 -> 1.000, value loss 1.000 -> 0.100 (first -> last 10% of steps)" \
        in summary
    assert "megarl: KL from the teacher 0.200 -> 0.020 nats per trained token" in summary
    assert "router agreement sampler vs learner 99.0% of routing decisions over 1000 tokens (lag0 100.0% over 400 " \
           "tokens)" in summary
    plain = Console(1, True, "runs/x", stream=io.StringIO())
    plain.update(1, step_metrics(0.5), [1])
    assert "critic" not in plain.summary() and "teacher" not in plain.summary()


def eval_metrics(pass1: float, prompts: int = 64) -> dict:
    return {"eval/heldout/prompts": float(prompts), "eval/heldout/reward_mean": pass1, "eval/heldout/pass@1": pass1,
            "eval/heldout/pass@4": min(1.0, pass1 + 0.02), "eval/heldout/greedy": 0.0, "eval_s": 0.1}


def test_drop_in_standard_errors_is_the_binomial_difference_bound():
    # best 0.977, now 0.727 over 64 prompts: SE = sqrt((0.977 * 0.023 + 0.727 * 0.273) / 64) = 0.05876
    assert drop_in_standard_errors(0.977, 0.727, 64) == pytest.approx(0.25 / 0.05876, rel=1e-3)
    assert drop_in_standard_errors(0.9, 0.95, 64) == 0.0  # no drop
    assert drop_in_standard_errors(1.0, 0.0, 64) == math.inf  # two exact scores
    # The same drop is noise on a small set and a signal on a large one.
    assert drop_in_standard_errors(0.9, 0.8, 16) < 3 < drop_in_standard_errors(0.9, 0.8, 256)


def test_a_held_out_score_well_below_its_best_is_warned_about_with_the_key_that_helps():
    out = io.StringIO()
    console = Console(3, True, "runs/demo", stream=out)
    console.evaluated(0, 0, eval_metrics(0.30))
    console.evaluated(50, 50, eval_metrics(0.977))
    console.evaluated(100, 100, eval_metrics(0.93))  # 1.3 standard errors below: noise, no warning
    assert "warning" not in out.getvalue()
    console.evaluated(150, 150, eval_metrics(0.727))  # 4.3 below
    warning = out.getvalue().splitlines()[-1]
    assert warning.startswith("megarl: warning: held-out scores well below their best: heldout pass@1 0.727 "
                              "(best 0.977 at version 50, 4.3 standard errors of 64 prompts below)")
    assert "heldout pass@4 0.747 (best 0.997" in warning and "learner.lr_decay" in warning
    assert "greedy" not in warning  # a mean reward, of no known range: not judged
    for step in range(1, 4):
        console.update(step, step_metrics(0.5), [1])
    console.close()
    assert "megarl: warning: eval heldout pass@1 0.727 (best 0.977 at version 50" in out.getvalue().split("step 3/3")[1]


def test_a_drop_that_is_noise_at_the_sets_size_is_not_warned_about():
    out = io.StringIO()
    console = Console(1, True, "runs/demo", stream=out)
    console.evaluated(0, 0, eval_metrics(0.9, prompts=16))
    console.evaluated(50, 50, eval_metrics(0.7, prompts=16))  # 1.5 standard errors of 16 prompts
    assert "warning" not in out.getvalue()


def test_a_resumed_run_compares_with_the_evaluations_before_its_checkpoint():
    out = io.StringIO()
    console = Console(1, True, "runs/demo", stream=out)
    console.earlier_evaluations([{"kind": "eval", "eval_version": 450, "step": 450, **eval_metrics(0.977)}])
    assert out.getvalue() == ""  # nothing printed for them
    console.evaluated(500, 500, eval_metrics(0.727))
    assert "heldout pass@1 0.727 (best 0.977 at version 450" in out.getvalue().splitlines()[-1]
