"""End to end: a sync-mode run resumed under another learner layout (TP=1 -> TP=2, TP=2 -> TP=1) continues as the
uninterrupted run did, step by step: the same completions (sync mode samples each batch from a seed of its own,
megarl.rollout.tasks.sync_sampling_seed), the same learning rates, and losses, gradient norms and weights equal
to float tolerance.

Four `megarl train` runs of 4 steps, checkpointing every step: uninterrupted at TP=1 and at TP=2, then each one's
checkpoint 2 continued under the other layout. The learning rate decays (cosine over the 4 steps), so a resume that
restarted the schedule, or lost the Adam moments or step count, moves the weights by O(lr) and fails.
"""
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
from safetensors.torch import load_file

from megarl.checkpoint import storage
from megarl.checkpoint.export import export_hf
from megarl.observe.sinks import train_records
from tests.helpers import REPO, run_python

DEMO = str(REPO / "configs" / "demo.yaml")
STEPS, AT = 4, 2  # the run's steps; the checkpoint the resumed runs continue from
LR = 5e-4
FP32_EPS = 2.0 ** -23
# The longest reductions whose order TP changes: a weight gradient sums over the batch's tokens (4 groups of 4,
# completions <= 49 tokens: n <= 16 * 64 positions), the logits' softmax over the vocabulary shards. Relative
# reassociation error of such an fp32 sum ~ eps * sqrt(n) = 1.2e-7 * 32 = 3.8e-6; the bounds below allow a factor
# of ~25 for cancellation (group advantages sum to zero, so per-token terms largely cancel).
GRAD_NORM_RTOL = 25 * FP32_EPS * (16 * 64) ** 0.5  # 9.5e-5; measured <= 1.4e-6
# The loss is a token mean of ratio * advantage with |advantage| <= sqrt(G - 1) = 1.7 (G = 4, std-normalised):
# its error is at most 1.7 x the per-token log-prob error, which TP's split reductions keep below 1e-5
# (tests/checkpoint/test_learner_state.py: measured 4.8e-7).
LOSS_ATOL = 1.7 * 1e-5  # measured <= 8.2e-8
# Adam moves a weight by ~lr * m / sqrt(v) per step, |m / sqrt(v)| <~ 1. Where a gradient is mostly cancellation its
# rounding error is a sizeable part of it, and Adam's normalisation turns that into a sizeable part of the step: allow
# 5% of the summed learning rates since the runs diverged (measured at ADAM_EPS: <= 0.04% after a resume, 0.5% between
# the uninterrupted layouts after their first step). Adam's first step is lr * g / (|g| + eps), whose slope in g is at
# most lr / eps: at torch's eps of 1e-8 a gradient of order eps moves by its rounding error alone, which depends on
# the CPU's kernels (one element of the tied embedding, whose gradient differed by ~3e-9 between the layouts, moved
# 28% of lr apart on one machine). At ADAM_EPS = 1e-6 the same rounding moves it at most 0.3% of lr, while the
# gradients that carry the test (|g| >> 1e-6) step as before. A restarted schedule, lost moments or a lost step count
# change the steps themselves, by O(lr): with the first Adam moments zeroed after loading, the resumed runs already
# sample other completions at step 3.
WEIGHT_STEP_FRACTION = 0.05
ADAM_EPS = 1e-6


def lr_at(step: int) -> float:
    """The cosine schedule of these runs (learner.lr_decay=cosine over run.steps, floor 0)."""
    import math

    return LR * 0.5 * (1 + math.cos(math.pi * step / STEPS))


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(embedded_count_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("layout_resume")
    common = [DEMO, f"run.steps={STEPS}", f"model.path={embedded_count_model_dir}", "algo.mode=sync",
              "algo.prompts_per_step=4", "algo.group_size=4", "checkpoint.every_steps=1", f"checkpoint.keep={STEPS}",
              f"learner.lr={LR}", f"learner.adam_eps={ADAM_EPS}", "learner.lr_decay=cosine", "eval.every_steps=0", "run.progress=false",
              "observe.trackers=[]"]

    def train(*runs):
        """(name, tp, *extra) runs side by side: each run is mostly process starts and waits, so two overlap."""
        with ThreadPoolExecutor(len(runs)) as pool:
            done = list(pool.map(lambda run: run_python("-m", "megarl.cli", "train", *common, f"run.dir={root / run[0]}",
                                                        f"learner.tp={run[1]}", *run[2:], timeout=400), runs))
        for proc in done:
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    train(("tp1", 1), ("tp2", 2))
    resumed = []
    for source, target_tp in (("tp1", 2), ("tp2", 1)):
        name = f"{source}_to_tp{target_tp}"
        shutil.copytree(root / source, root / name)
        ckpt = root / name / "checkpoints"
        for step in range(AT + 1, STEPS + 1):  # as if the run had stopped after its checkpoint AT
            shutil.rmtree(ckpt / storage.step_dir_name(step))
        (ckpt / "latest").write_text(storage.step_dir_name(AT) + "\n")
        resumed.append((name, target_tp, "run.resume=true"))
    train(*resumed)
    return root


def weights(root, run, step, out):
    return load_file(export_hf(root / run / "checkpoints" / storage.step_dir_name(step), out / f"{run}_{step}")
                     / "model.safetensors")


@pytest.mark.parametrize("run, reference", [("tp1_to_tp2", "tp1"), ("tp2_to_tp1", "tp2"), ("tp2", "tp1")])
def test_a_run_resumed_under_another_layout_continues_like_the_uninterrupted_run(runs, run, reference, tmp_path):
    """tp1_to_tp2, tp2_to_tp1: checkpoint AT of one layout continued under the other, against the uninterrupted
    run of the layout that wrote it. tp2: the uninterrupted runs of the two layouts, against each other."""
    rollouts = {name: [(r["trained_at_step"], r["group_id"], r["token_ids"])
                       for r in read_jsonl(runs / name / "rollouts.jsonl")] for name in (run, reference)}
    assert sorted(rollouts[run]) == sorted(rollouts[reference])  # the same completions, trained at the same steps
    got, want = (train_records(read_jsonl(runs / name / "metrics.jsonl")) for name in (run, reference))
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(STEPS))
    for g, w in zip(got, want):
        assert g["lr"] == w["lr"] == pytest.approx(lr_at(g["step"]), rel=1e-12), g["step"]
        assert g["reward_mean"] == w["reward_mean"], g["step"]
        assert abs(g["loss"] - w["loss"]) <= LOSS_ATOL, g["step"]
        assert abs(g["grad_norm"] - w["grad_norm"]) <= GRAD_NORM_RTOL * w["grad_norm"], g["step"]
    diverged = 0 if run == "tp2" else AT  # the step from which the two runs' arithmetic differs
    for step in range(diverged + 1, STEPS + 1):
        a, b = weights(runs, run, step, tmp_path), weights(runs, reference, step, tmp_path)
        assert set(a) == set(b)
        bound = WEIGHT_STEP_FRACTION * sum(lr_at(s) for s in range(diverged, step))
        worst = max((a[name] - b[name]).abs().max().item() for name in b)
        assert worst <= bound, (step, worst, bound)
