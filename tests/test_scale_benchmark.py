"""benchmarks/scale.py (docs/benchmarks.md#scale--benchmarksscalepy): its parts run here on a tiny shape through
the same code as on the real ones (a megatron TP1 learner step with the delta measurement, the engine in fp32 and
bf16, publish vs raw broadcast with the swap stall), so that a change in megarl that breaks the benchmark is found
in CI rather than in a 15-minute run."""
import json

from tests.helpers import run_python

HEADLINE = {"params", "publish_vs_raw", "delta_bytes_frac", "sampler_rss_over_weights", "learner_rss_over_weights"}


def last_json(proc) -> dict:
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1].startswith("{"), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1])


def test_the_tiny_shape_runs_learner_engine_and_publish_and_ends_with_the_headline_json(tmp_path):
    proc = run_python("benchmarks/scale.py", "--tiny", "--only", "tp1", "engine", "publish", "--out",
                      str(tmp_path / "runs"), "--plots", str(tmp_path / "img"), timeout=240)
    head = last_json(proc)
    assert HEADLINE <= set(head), head
    assert head["errors"] == {}, "\n".join(f"{part}: {error}" for part, error in head["errors"].items())  # whole
    assert set(head["params"]) == {"tiny"}
    assert 0 < head["publish_vs_raw"]["tiny fp32 r1"] < 10
    # one optimizer step at lr 1e-6 changes a few bf16 words: the delta is a small part of a full bf16 publish
    assert 0 < head["delta_bytes_frac"] < 0.5 and 0 < head["delta"]["changed_frac"] < 0.2
    assert set(head["sampler_rss_over_weights"]) == {"engine tiny fp32", "engine tiny bf16",
                                                     "receiving sampler tiny fp32 r1"}
    assert set(head["learner_rss_over_weights"]) == {"megatron TP1 tiny"}
    # the learner's peak named per component of the theory's 16 B/param, and they add up to it
    learner = head["learner_bytes_per_param"]["megatron TP1 tiny"]
    parts = learner["components"]
    assert {name: part["theory"] for name, part in parts.items()} == {
        "params": 4.0, "built_rest": 4.0, "optimizer_state": 8.0, "step_transients": 0.0}
    assert abs(sum(part["measured"] for part in parts.values()) - learner["measured"]) < 0.05
    assert all(set(tok_s) == {"1", "4", "16"} and min(tok_s.values()) > 0 for tok_s in head["engine_tok_s"].values())
    stall = head["swap_stall"]["receiving sampler tiny fp32 r1"]
    assert stall["baseline_step_ms"] > 0 and stall["swap_ms"] >= 0
    assert {p.name for p in (tmp_path / "img").iterdir()} == {"scale_time.png", "scale_memory.png"}
    assert "megatron TP1" in proc.stdout and "left out:" in proc.stdout


def test_the_dry_run_plans_every_role_of_the_quick_run_and_says_what_is_left_out():
    head = last_json(run_python("benchmarks/scale.py", "--quick", "--dry-run", timeout=120))
    assert head["params"] == {"qwen2.5-0.5b": 494032768}
    assert head["plan"] == ["build_qwen2.5-0.5b", "learner_megatron_tp1_qwen2.5-0.5b",
                            "learner_megatron_tp2_qwen2.5-0.5b", "learner_deepspeed_z1_qwen2.5-0.5b",
                            "engine_fp32_qwen2.5-0.5b", "engine_bf16_qwen2.5-0.5b", "publish_fp32_r1_qwen2.5-0.5b"]


def test_the_swap_stall_skips_a_control_window_no_decode_step_overlaps():
    """On a loaded machine the decode loop can be descheduled between two steps for longer than an update lasts,
    so a control window may hold no step: it is left out (nothing to compare), not a crash of the whole part."""
    import sys

    sys.path.insert(0, "benchmarks")
    try:
        from weight_publish import summarise_stall
    finally:
        sys.path.remove("benchmarks")
    windows = [(t, t + 0.02) for t in (0.5, 1.0, 1.5, 2.0)]  # four publishes, the first two warm-ups
    swap_starts = {round(t + 0.04, 2) for t, _ in windows}  # each swapped in by the step 40 ms after its start
    steps = []
    for i in range(300):  # 10 ms decode steps, none from 2.48 s to 2.56 s: the last update's control window
        start = round(i * 0.01, 2)
        if not 2.48 <= start < 2.56:
            swapped = start in swap_starts
            steps.append((start, start + 0.01, False, swapped, 0.001 if swapped else 0.0,
                          start, start + 0.01, start, start + 0.01))
    out = summarise_stall(windows, [{"steps": steps}])
    (receiver,) = out["receivers"]
    assert receiver["baseline_step_ms"] == 10.0 and receiver["swap_ms"] == 1.0
    assert receiver["receive_cpu_ms"] == 0.0  # decode thread and process CPU are the same here
