"""Run trackers (observe.trackers): TensorBoard, Weights & Biases, MLflow, each given the same scalars (every
learner step's and every evaluation's numbers, as metrics.jsonl holds them) and the run's config.

None of them runs on the learner's step path: TensorBoard's FileWriter queues events to its own writer thread;
wandb and MLflow calls (an HTTP request or a file-store write per call) run on a thread of their own here
(`Background`), so a step only enqueues. `check_trackers` says before launch why a tracker cannot start (its
package missing, a bad setting); `open_trackers` starts them in the learner's lead process.
"""
from __future__ import annotations

import importlib.util
import math
import os
import queue
import re
import sys
import threading
from pathlib import Path
from typing import Protocol

from megarl.config.schema import Config

# The package each tracker imports, and what installs it.
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
INSTALL = 'pip install "megarl[trackers]"'
# MLflow accepts metric and param names of letters, digits, _ - . space : / only; its file store makes each "/" a
# directory, so "loss" and "loss/pg" would be a file and a directory of one name: "/" becomes "." there too.
_MLFLOW_NAME = re.compile(r"[^\w.\- :]")


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def scalars(metrics: dict) -> dict[str, float]:
    """The finite numbers of a metrics record (no strings such as kind=eval, no NaN), as floats."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def flat_config(cfg: Config) -> dict[str, object]:
    """The resolved config as {dotted key: value}: what every tracker records of the run's config."""
    from megarl.config.load import to_dict
    from megarl.config.reference import flatten

    return flatten(to_dict(cfg))


def config_text(value) -> str:
    """A config value as text (MLflow params, TensorBoard's text), as `megarl config` writes it."""
    from megarl.config.reference import format_value

    return value if isinstance(value, str) else format_value(value)


def run_name(cfg: Config) -> str:
    return cfg.observe.run_name or Path(cfg.run.dir).resolve().name


def mlflow_uri(cfg: Config) -> str:
    """observe.mlflow_tracking_uri, or the file store run.dir/mlruns."""
    return cfg.observe.mlflow_tracking_uri or (Path(cfg.run.dir).resolve() / "mlruns").as_uri()


def mlflow_name(name: str) -> str:
    """A metric name MLflow takes in every store: eval/heldout/pass@4 -> eval.heldout.pass_at_4, any other character
    it refuses -> _."""
    return _MLFLOW_NAME.sub("_", name.replace("@", "_at_").replace("/", "."))


def wandb_mode(cfg: Config) -> str:
    """The mode wandb will run in: observe.wandb_mode, else WANDB_MODE, else online."""
    return cfg.observe.wandb_mode or os.environ.get("WANDB_MODE") or "online"


def wandb_credentials() -> bool:
    """Whether wandb finds credentials where `wandb login` and its docs put them (the environment, ~/.netrc)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def check_trackers(cfg: Config) -> list[str]:
    """What `megarl train` says about observe.trackers before launch; ValueError naming the tracker and why it
    cannot start (its package is not installed, a setting it refuses)."""
    oc = cfg.observe
    for name in oc.trackers:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise ValueError(f"observe.trackers: {name} needs the {PACKAGES[name]!r} package, which is not installed "
                             f"({INSTALL}, or drop {name} from observe.trackers)")
    if "wandb" in oc.trackers and wandb_mode(cfg) == "online" and not wandb_credentials():
        raise ValueError("observe.trackers: wandb runs online (observe.wandb_mode, else WANDB_MODE) and finds no "
                         "credentials (WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc); log in, or set "
                         "observe.wandb_mode=offline to write the run to files (`wandb sync` uploads them later)")
    if "mlflow" in oc.trackers:
        uri = mlflow_uri(cfg)
        scheme = uri.split(":", 1)[0] if ":" in uri else ""
        if scheme not in ("file", "http", "https", "sqlite", "postgresql", "mysql", "databricks"):
            raise ValueError(f"observe.mlflow_tracking_uri: {uri!r} is not a tracking URI MLflow takes "
                             f"(file:///path, http(s)://host, sqlite:///file.db, ...; '' = {cfg.run.dir}/mlruns)")
    if not oc.trackers:
        return ["trackers: none (metrics.jsonl only)"]
    where = {"tensorboard": f"{cfg.run.dir}/tensorboard",
             "wandb": f"wandb project {oc.wandb_project!r}, mode {wandb_mode(cfg)}",
             "mlflow": f"mlflow {mlflow_uri(cfg)}, experiment {oc.mlflow_experiment!r}"}
    return ["trackers: " + "; ".join(where[name] for name in oc.trackers)]


class TensorBoardTracker:
    """run.dir/tensorboard/: one event per step holding all its scalars (TensorBoard's FileWriter writes on its own
    thread), the config as text at step 0."""

    def __init__(self, run_dir: Path, config: dict[str, object]):
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.summary import text
        from torch.utils.tensorboard.writer import FileWriter

        self.writer, self.summary = FileWriter(str(run_dir / "tensorboard")), Summary
        if config:
            lines = [f"    {key}: {config_text(value)}" for key, value in config.items()]  # Markdown: code
            self.writer.add_summary(text("config", "\n".join(lines)), 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        # All of a step's scalars in one event (SummaryWriter.add_scalar writes one event each: ~60 per step
        # cost the learner ~10 ms of its step loop; this costs < 1 ms). TensorBoard reads both the same.
        self.writer.add_summary(self.summary(value=[self.summary.Value(tag=k, simple_value=v)
                                                    for k, v in scalars.items()]), step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A wandb run (its files under observe.wandb_dir/wandb/); megarl's step is the x-axis of every metric (the
    `step` key): evaluations arrive after later training steps were logged, which wandb's own step refuses."""

    def __init__(self, cfg: Config, config: dict[str, object]):
        import wandb

        oc = cfg.observe
        Path(oc.wandb_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=oc.wandb_project, entity=oc.wandb_entity or None, name=run_name(cfg),
                              dir=oc.wandb_dir, mode=oc.wandb_mode or None, config=config,
                              settings=wandb.Settings(console="off", silent=True))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({**scalars, "step": step})

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # stops wandb's service process, which writes the run's last records before it exits


class MlflowTracker:
    """An MLflow run in observe.mlflow_experiment at mlflow_uri(cfg); params = the config, metrics named by
    mlflow_name."""

    def __init__(self, cfg: Config, config: dict[str, object]):
        uri = mlflow_uri(cfg)
        if uri.startswith("file:"):  # MLflow 3 takes its file store only when asked to (MLflow's own opt-out)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.client, self.metric = MlflowClient(uri), Metric
        experiment = self.client.get_experiment_by_name(cfg.observe.mlflow_experiment)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(cfg.observe.mlflow_experiment))
        self.run_id = self.client.create_run(experiment_id, run_name=run_name(cfg)).info.run_id
        # 6000 characters: MLflow's longest param value
        params = [Param(mlflow_name(k), config_text(v)[:6000]) for k, v in config.items()]
        for start in range(0, len(params), 100):  # MLflow's largest batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        import time

        now = int(time.time() * 1000)
        metrics = [self.metric(mlflow_name(k), v, now, step) for k, v in scalars.items()]
        for start in range(0, len(metrics), 1000):  # MLflow's largest batch of metrics
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Background:
    """A tracker fed from a thread of its own: `log` only enqueues, so a slow tracker (network, file store) never
    holds the learner's step. A tracker that raises is said on stderr at once and gets nothing more (the run and
    metrics.jsonl go on); `close` waits up to `timeout_s` for what is queued."""

    def __init__(self, name: str, tracker: Tracker, timeout_s: float):
        self.name, self.tracker, self.timeout_s = name, tracker, timeout_s
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"tracker-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is None:
                try:
                    self.tracker.log(*item)
                except Exception as exc:  # noqa: BLE001 (a tracker's failure does not stop the training)
                    self.error = exc
                    print(f"megarl: observe.trackers: {self.name} stopped logging at step {item[0]}: "
                          f"{type(exc).__name__}: {exc} (metrics.jsonl keeps every record)", file=sys.stderr,
                          flush=True)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.queue.put((step, scalars))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(self.timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"observe.trackers: {self.name} did not take the run's last metrics within "
                               f"{self.timeout_s:.0f} s (observe.close_timeout_s)")
        self.tracker.close()


def open_trackers(cfg: Config) -> list:
    """The trackers of observe.trackers, started (the learner's lead process, once)."""
    config = flat_config(cfg)
    opened = []
    for name in cfg.observe.trackers:
        if name == "tensorboard":
            opened.append(TensorBoardTracker(Path(cfg.run.dir), config))
        elif name == "wandb":
            opened.append(Background(name, WandbTracker(cfg, config), cfg.observe.close_timeout_s))
        else:
            opened.append(Background(name, MlflowTracker(cfg, config), cfg.observe.close_timeout_s))
    return opened
