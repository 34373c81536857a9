"""observe.trackers: TensorBoard, wandb (offline) and MLflow (a file store under the run) get the same scalars,
evaluation curves and config from MetricsSink, read back by each tracker's own reader; a tracker that cannot start
is refused by name before launch; a slow tracker does not hold the step that logs."""
import importlib.util
import json
import threading
import time

import pytest

from megarl.config.load import ConfigError, load_config
from megarl.observe import trackers
from megarl.observe.sinks import MetricsSink
from tests.observe.tracker_readers import mlflow_curve, mlflow_run, tensorboard_curves, wandb_curve, wandb_run


def config(tmp_path, *overrides):
    return load_config(None, [f"run.dir={tmp_path}", "observe.wandb_mode=offline", *overrides], check_files=False)


def test_three_trackers_hold_the_same_curves_and_config(tmp_path):
    cfg = config(tmp_path, "observe.trackers=[tensorboard,wandb,mlflow]", "learner.lr=0.0005")
    sink = MetricsSink(tmp_path, trackers.open_trackers(cfg))
    rewards = {0: 0.25, 1: 0.5, 2: 0.75}
    for step, reward in rewards.items():
        sink.log(step, {"reward_mean": reward, "loss": float("nan"), "loss/pg": 0.5, "time": 1.0 + step})
    # an evaluation arrives after later steps were logged, at the step it was published by
    sink.log(1, {"kind": "eval", "eval_version": 1, "eval/heldout/pass@1": 0.5})
    sink.close()

    assert tensorboard_curves(tmp_path)["reward_mean"] == pytest.approx(rewards)
    assert wandb_curve(tmp_path, "reward_mean") == pytest.approx(rewards)
    assert mlflow_curve(tmp_path, "reward_mean") == pytest.approx(rewards)
    assert tensorboard_curves(tmp_path)["eval/heldout/pass@1"] == {1: 0.5}
    assert wandb_curve(tmp_path, "eval/heldout/pass@1") == {1: 0.5}
    assert mlflow_curve(tmp_path, "eval.heldout.pass_at_1") == {1: 0.5}  # MLflow: no '@'; '/' is a directory in its file store
    assert "loss" not in tensorboard_curves(tmp_path) and wandb_curve(tmp_path, "loss") == {}  # NaN: not logged

    _, wandb_config = wandb_run(tmp_path)
    _, run = mlflow_run(tmp_path)
    assert run.data.params["learner.lr"] == "0.0005" and run.data.params["observe.wandb_mode"] == "offline"
    assert wandb_config["learner.lr"] == 0.0005
    assert wandb_config["observe.trackers"] == ["tensorboard", "wandb", "mlflow"]
    assert run.info.run_name == tmp_path.name and run.info.status == "FINISHED"


def test_a_tracker_that_cannot_start_is_named(tmp_path, monkeypatch):
    cfg = config(tmp_path, "observe.trackers=[tensorboard,mlflow]")
    assert trackers.check_trackers(cfg) == [
        f"trackers: {tmp_path}/tensorboard; mlflow {(tmp_path / 'mlruns').as_uri()}, experiment 'megarl'"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ValueError, match=r"observe.trackers: mlflow needs the 'mlflow' package, which is not "
                                         r"installed \(pip install \"megarl\[trackers\]\""):
        trackers.check_trackers(cfg)
    monkeypatch.setattr(importlib.util, "find_spec", real)
    with pytest.raises(ValueError, match="observe.mlflow_tracking_uri: 'mlruns' is not a tracking URI"):
        trackers.check_trackers(config(tmp_path, "observe.trackers=[mlflow]", "observe.mlflow_tracking_uri=mlruns"))
    with pytest.raises(ConfigError, match=r"observe.trackers: unknown tracker\(s\) \['comet'\]"):
        config(tmp_path, "observe.trackers=[comet]")
    with pytest.raises(ConfigError, match="observe.wandb_mode: must be online, offline, disabled"):
        config(tmp_path, "observe.wandb_mode=shared")
    assert trackers.check_trackers(config(tmp_path, "observe.trackers=[]")) == ["trackers: none (metrics.jsonl only)"]


def test_wandb_online_without_credentials_is_refused(tmp_path, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    online = load_config(None, [f"run.dir={tmp_path}", "observe.trackers=[wandb]"], check_files=False)
    with pytest.raises(ValueError, match=r"wandb runs online .* finds no credentials .*observe.wandb_mode=offline"):
        trackers.check_trackers(online)
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "0" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert trackers.check_trackers(online) == ["trackers: wandb project 'megarl', mode online"]
    monkeypatch.setenv("WANDB_MODE", "offline")
    (tmp_path / ".netrc").unlink()
    assert trackers.check_trackers(online) == ["trackers: wandb project 'megarl', mode offline"]


class SlowTracker:
    def __init__(self):
        self.release, self.logged = threading.Event(), []

    def log(self, step, scalars):
        self.release.wait(30)
        self.logged.append((step, scalars))

    def close(self):
        pass


def test_a_slow_tracker_does_not_hold_the_step(tmp_path):
    slow = SlowTracker()
    sink = MetricsSink(tmp_path, [trackers.Background("slow", slow, timeout_s=30)])
    start = time.monotonic()
    for step in range(5):
        sink.log(step, {"reward_mean": 1.0})
    assert time.monotonic() - start < 5  # each log only enqueued; the tracker itself is blocked
    slow.release.set()
    sink.close()
    assert [step for step, _ in slow.logged] == list(range(5))
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 5


def test_a_failing_tracker_is_said_once_and_the_run_goes_on(tmp_path, capfd):
    class Broken(SlowTracker):
        def log(self, step, scalars):
            raise OSError("disk full")

    sink = MetricsSink(tmp_path, [trackers.Background("broken", Broken(), timeout_s=30)])
    sink.log(0, {"reward_mean": 1.0})
    sink.log(1, {"reward_mean": 1.0})
    sink.close()
    assert capfd.readouterr().err == ("megarl: observe.trackers: broken stopped logging at step 0: OSError: disk full "
                                      "(metrics.jsonl keeps every record)\n")
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2  # the run's own records are whole


def test_mlflow_names():
    # "loss" and "loss/pg" would be a file and a directory of one name in MLflow's file store
    assert trackers.mlflow_name("loss/pg") == "loss.pg"
    assert trackers.mlflow_name("eval/heldout/pass@4") == "eval.heldout.pass_at_4"
    assert trackers.mlflow_name("reward/source/gsm8k (main)") == "reward.source.gsm8k _main_"


def test_a_demo_run_logs_the_same_reward_curve_to_all_three(embedded_count_model_dir, tmp_path):
    """`megarl train` on the demo, a few steps, observe.trackers=[tensorboard,wandb,mlflow] (wandb offline, MLflow's
    file store under run.dir): each tracker holds metrics.jsonl's reward curve and the held-out evaluations."""
    from megarl.observe.sinks import eval_records, train_records
    from tests.helpers import REPO, run_python

    run_dir = tmp_path / "run"
    proc = run_python("-m", "megarl.cli", "train", str(REPO / "configs" / "demo.yaml"), f"run.dir={run_dir}",
                      "run.steps=3", f"model.path={embedded_count_model_dir}", "eval.sets=[{name: heldout, prompts: 8}]",
                      "observe.trackers=[tensorboard,wandb,mlflow]", "observe.wandb_mode=offline", timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"megarl: trackers: {run_dir}/tensorboard; wandb project 'megarl', mode offline; mlflow " in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = {r["step"]: r["reward_mean"] for r in train_records(records)}
    assert sorted(rewards) == [0, 1, 2]
    assert tensorboard_curves(run_dir)["reward_mean"] == pytest.approx(rewards)
    assert wandb_curve(run_dir, "reward_mean") == pytest.approx(rewards)
    assert mlflow_curve(run_dir, "reward_mean") == pytest.approx(rewards)
    evals = {r["step"]: r["eval/heldout/pass@1"] for r in eval_records(records)}
    assert len(evals) == 2  # the start and the end
    assert tensorboard_curves(run_dir)["eval/heldout/pass@1"] == pytest.approx(evals)
    assert wandb_curve(run_dir, "eval/heldout/pass@1") == pytest.approx(evals)
    assert mlflow_curve(run_dir, "eval.heldout.pass_at_1") == pytest.approx(evals)
    _, run = mlflow_run(run_dir)
    assert run.data.params["run.steps"] == "3" and wandb_run(run_dir)[1]["run.steps"] == 3


def test_a_run_with_a_tracker_that_cannot_start_is_refused_before_launch(tmp_path):
    from tests.helpers import REPO, run_python

    proc = run_python("-m", "megarl.cli", "train", str(REPO / "configs" / "demo.yaml"), f"run.dir={tmp_path}",
                      "observe.trackers=[mlflow]", "observe.mlflow_tracking_uri=mlruns", "--dry-run", timeout=120)
    assert proc.returncode == 2 and "launching" not in proc.stdout
    assert "megarl: observe.mlflow_tracking_uri: 'mlruns' is not a tracking URI MLflow takes" in proc.stderr
