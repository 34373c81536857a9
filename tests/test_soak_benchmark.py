"""benchmarks/soak.py without a run: its arguments, the `megarl train` command both runs share, the steps-per-minute
count (first logged step to the stop, eval records left out) and the JSON summary line."""
import json
import sys

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import soak  # noqa: E402


def test_defaults_and_the_command_both_runs_share():
    args = soak.parse_args([])
    assert (args.minutes, args.kill_every_s, args.engines, args.skip_baseline) == (30.0, 300.0, 2, False)
    args = soak.parse_args(["--minutes", "6", "--kill-every-s", "60", "--out", "/tmp/x", "learner.lr=0.001"])
    cmd = soak.train_command(args, REPO / "runs" / "s")
    assert cmd[1:5] == ["-m", "megarl.cli", "train", str(REPO / "configs" / "demo.yaml")]
    assert {"fault.on_failure=replace", "sampler.num_engines=2", "eval.sets=[]", "run.log_rollouts=false",
            "fault.max_sampler_restarts_per_hour=60"} <= set(cmd)  # a kill a minute: 60 replacements an hour
    assert cmd[-1] == "learner.lr=0.001"  # overrides last: they win


@pytest.mark.parametrize("argv", [["--engines", "1"], ["--minutes", "0"], ["--add-at", "0.8", "--remove-at", "0.5"]])
def test_arguments_that_cannot_soak_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        soak.parse_args(argv)
    assert "error:" in capsys.readouterr().err


def test_metrics_rate_and_the_json_summary(tmp_path):
    rows = [{"step": i, "time": 1000.0 + 3 * i, "samplers/replaced": float(i // 10), "samplers/rollouts_lost": 2.0,
             "samplers/alive": 2.0} for i in range(21)]
    rows.insert(4, {"kind": "eval", "eval_version": 3, "time": 1010.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = soak.metrics(tmp_path)
    assert len(records) == 21
    assert soak.steps_per_minute(records, stopped_at=1060.0) == pytest.approx(20.0)  # 20 steps after the first in 60 s
    assert soak.steps_per_minute([], stopped_at=1060.0) == 0.0
    assert soak.longest_gap_s(records) == pytest.approx(3.0) and soak.longest_gap_s([]) == 0.0
    run = {"steps": 21, "steps_per_min": 18.0, "kills": [{"minute": 1.0, "rank": 1, "incarnation": 0}],
           "replaced": 1.0, "rollouts_lost": 2.0, "alive": 2.0, "leaked": 0, "events": ["megarl: sampler 0 ..."],
           "load_mean": 12.0, "longest_gap_s": 9.5}
    report = soak.summary({**run, "steps_per_min": 20.0}, run)
    assert json.loads(json.dumps(report)) == {
        "baseline_steps_per_min": 20.0, "faults_steps_per_min": 18.0, "ratio": 0.9, "kills": 1, "replaced": 1.0,
        "rollouts_lost": 2.0, "alive_at_end": 2.0, "steps": {"baseline": 21, "faults": 21}, "leaked_processes": 0,
        "load_mean": {"baseline": 12.0, "faults": 12.0}, "longest_gap_s": {"baseline": 9.5, "faults": 9.5},
        "events": 1}
    assert soak.summary(None, run)["ratio"] is None  # --skip-baseline
