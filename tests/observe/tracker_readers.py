"""What each run tracker wrote, read back by its own reader: TensorBoard's EventAccumulator, MLflow's client on the
file store, wandb's record protobuf on the offline run's transaction log. {metric: {step: value}} for each."""
from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK, _HEADER = 32768, 7  # the LevelDB log framing of a .wandb file: 32 KiB blocks, crc32 + length + type


def tensorboard_curves(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def mlflow_run(run_dir: Path, experiment: str = "megarl"):
    """(client, run) of the one MLflow run in run_dir/mlruns."""
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when asked to
    from mlflow.tracking import MlflowClient

    client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, runs
    return client, runs[0]


def mlflow_curve(run_dir: Path, metric: str) -> dict[int, float]:
    client, run = mlflow_run(run_dir)
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, metric)}


def _wandb_log_records(path: Path):
    """The records of a .wandb transaction log. wandb's Python package no longer ships a reader of it (wandb-core
    writes it), so this undoes the LevelDB log framing: full, first, middle and last fragments in 32 KiB blocks."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a wandb transaction log"
    pos, parts = _HEADER, []
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER]) if left >= _HEADER else (0, 0, 0)
        if kind == 0:  # the zero padding at a block's end
            pos += left
            continue
        body, pos = data[pos + _HEADER:pos + _HEADER + length], pos + _HEADER + length
        if kind == 1:
            yield body
        elif kind == 2:
            parts = [body]
        else:
            parts.append(body)
            if kind == 4:
                yield b"".join(parts)


def wandb_run(run_dir: Path) -> tuple[list[dict], dict]:
    """(history rows, config) of the one offline wandb run under run_dir/wandb, decoded with wandb's own
    Record protobuf."""
    from wandb.proto import wandb_internal_pb2

    logs = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1, logs
    rows, config = [], {}
    for body in _wandb_log_records(logs[0]):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(body)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({u.key: json.loads(u.value_json) for u in updates})
    return rows, config


def wandb_curve(run_dir: Path, metric: str) -> dict[int, float]:
    """{megarl step: value}: megarl logs its step as the `step` key of every row (wandb's own _step counts rows)."""
    rows, _ = wandb_run(run_dir)
    return {row["step"]: row[metric] for row in rows if metric in row}
