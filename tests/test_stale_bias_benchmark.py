"""benchmarks/stale_bias.py: the time to the reward target with each training window reweighted to the prompt
stream, on a synthetic vs_trl.py output whose trained batches lack the long prompts (as stale drops leave them)."""
import json
import sys

from megarl.rollout.tasks import CountTask
from tests.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import stale_bias  # noqa: E402


def _run(tmp_path, steps=30):
    """Per step 30 groups of short prompts (3, 6, 10 letters) right from step 5 on, and one each of 15 and 25 letters
    (a fifth of the stream) right only from step 20; 40 groups dropped as stale."""
    run = tmp_path / "round0"
    (run / "megarl_pipeline").mkdir(parents=True)
    rollouts = []
    for step in range(steps):
        for g in range(30):
            rollouts.append({"trained_at_step": step, "group_id": f"s0-g{step}-{g}",
                             "prompt": ("a-c=", "a-f=", "a-j=")[g % 3], "reward": 1.0 if step >= 5 else 0.0})
        for prompt in ("a-o=", "a-y="):
            rollouts.append({"trained_at_step": step, "group_id": f"s0-g{step}-{prompt}", "prompt": prompt,
                             "reward": 1.0 if step >= 20 else 0.0})
    (run / "megarl_pipeline" / "rollouts.jsonl").write_text("\n".join(map(json.dumps, rollouts)))
    (run / "megarl_pipeline" / "config.yaml").write_text("task:\n  name: count\n  length_mean: 8.0\n  max_length: 48\n")
    (run / "megarl_pipeline" / "metrics.jsonl").write_text(
        json.dumps({"step": steps - 1, "dropped/stale_groups_total": 40}))
    (run / "results.json").write_text(json.dumps({
        "megarl pipeline": {"curve": {"train_s": [0.1 * (i + 1) for i in range(steps)]}},
        "TRL GRPOTrainer": {"summary": {"reached": {"0.9": {"step": 40, "train_s": 10.0}}}}}))
    return run


def test_the_reweighted_reward_waits_for_the_prompts_the_trained_batches_lack(tmp_path):
    run = _run(tmp_path)
    shares = stale_bias.stream_shares(stale_bias.run_task(run), 20_000)
    assert abs(sum(shares.values()) - 1.0) < 1e-9
    assert shares[stale_bias.bucket(15)] + shares[stale_bias.bucket(25)] > 0.15  # long prompts: ~a fifth of the stream
    out = stale_bias.analyse(run, shares)
    # Plain: 30 of 32 groups right from step 5, so the rolling 10-step mean crosses 0.9 with its first window of
    # steps 5-14; reweighted, the long buckets weigh their stream shares: only once the long prompts come right.
    assert out["plain"] == {"step": 15, "train_s": 1.5, "ratio_vs_trl": round(10.0 / 1.5, 3)}
    assert out["reweighted"]["step"] > 20 and out["reweighted"]["ratio_vs_trl"] < out["plain"]["ratio_vs_trl"]
    assert out["stale_dropped_frac"] == round(40 / (40 + 30 * 32), 3)
    assert out["trained_prompt_letters_mean"] == round((10 * 3 + 10 * 6 + 10 * 10 + 15 + 25) / 32, 2)


def test_the_stream_is_the_runs_own_task(tmp_path):
    run = _run(tmp_path)
    assert stale_bias.run_task(run) == CountTask(length_mean=8.0, max_length=48)
    (run / "megarl_pipeline" / "config.yaml").write_text("task:\n  length_mean: 16.0\n  max_length: 40\n")
    assert stale_bias.run_task(run) == CountTask(length_mean=16.0, max_length=40)
