"""The `megarl sft` run: every torchrun rank is a learner rank; the learner backend of `megarl train`
(megarl.learner.build_learner: megatron TP/PP/DP or DeepSpeed ZeRO) takes one optimizer step per batch
of records with the supervised objective (megarl.algo.config.NLLConfig -> megarl.algo.losses.nll_loss,
through the shared step code of megarl.learner.step), and at the end the weights are written as an HF
model directory.

    torchrun --standalone --nproc-per-node N -m megarl.sft.run CONFIG [key=value ...]

`megarl sft` runs exactly this after its checks (megarl/cli.py). Every rank reads and renders the data
itself (megarl.sft.data: deterministic, so every rank holds the same records in the same order) and
builds the same whole batch per step; each DP rank trains its share of the rows, as in `megarl train`.

Outputs: run.dir/config.yaml, run.dir/metrics.jsonl (+ tensorboard/), and sft.output_dir, an HF
directory (config.json, model.safetensors or shards + index, generation_config.json, the tokenizer
files and chat template of model.path, megarl_sft.json: what trained it). Every value in metrics
record `step` k is measured on the weights after k optimizer steps: `loss` (the token-mean NLL of
batch k, whose gradient makes update k+1), `heldout_loss` where evaluated (k = 0, every sft.eval_every,
and k = steps, the last record, which has no training loss).

The HF directory is written by the first rank of each pipeline stage (TP rank 0 of DP replica 0):
its stage's tensors as the learner publishes them to samplers (publish_tensors, collective over the
learner ranks), into a temporary directory that rank 0 completes and renames into place, so an
existing sft.output_dir (replaced under run.overwrite=true) stays whole until the new one is complete.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from megarl import run_lock
from megarl.config.schema import Config
from megarl.learner.nonfinite import NonfiniteSteps
from megarl.sft.data import Example, Records, batch_order, collate, load_records, num_steps, split_heldout

SFT_RECORD = "megarl_sft.json"  # written into the output directory: what trained it
CHECKED_ENV = "MEGARL_SFT_CHECKED"  # set by `megarl sft`: it printed the data summary already
# Files of the base model directory not copied to the output: the weights (rewritten) and the embedded
# model's build record (it describes the base's warm start, not this model).
_NOT_COPIED = ("config.json", "megarl_embedded.json", SFT_RECORD)


class SFTOutputError(RuntimeError):
    """An output location that this run must not write (another run's outputs, the base model itself)."""


@dataclass
class SFTData:
    train: list[Example]
    heldout: list[Example]
    records: Records
    eval_records: Records | None
    steps: int
    max_seq_len: int
    pad_id: int

    def lines(self) -> list[str]:
        out = [f"data {self.records.summary()}"]
        if self.eval_records is not None:
            out.append(f"held-out {self.eval_records.summary()}")
        held = (f"{len(self.heldout)} held-out records"
                + ("" if self.eval_records is not None else " (sft.eval_fraction of sft.data)") if self.heldout
                else "no held-out records (sft.eval_fraction=0, no sft.eval_data)")
        out.append(f"{len(self.train)} training records, {held}; context {self.max_seq_len} tokens")
        return out


def context_length(cfg: Config, hf_config: dict) -> tuple[int, str]:
    if cfg.sft.max_seq_len > 0:
        return cfg.sft.max_seq_len, "sft.max_seq_len"
    return int(hf_config["max_position_embeddings"]), "the model's max_position_embeddings; sft.max_seq_len sets another"


def load_data(cfg: Config, model_dir: str | Path) -> SFTData:
    """The run's records, rendered with the model directory's tokenizer; raises megarl.sft.data's BadRecord
    / SFTDataError naming FILE:LINE and what is wrong."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    max_len, source = context_length(cfg, json.loads((model_dir / "config.json").read_text()))
    sc = cfg.sft

    def load(path: str) -> Records:
        return load_records(path, tokenizer, max_len, sc.on_bad_row, sc.on_overlong, model_dir, source)

    records = load(sc.data)
    eval_records = load(sc.eval_data) if sc.eval_data else None
    if eval_records is not None:
        train, heldout = records.examples, eval_records.examples
    else:
        train, heldout = split_heldout(records.examples, sc.eval_fraction, cfg.run.seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return SFTData(train, heldout, records, eval_records, num_steps(len(train), sc.batch_size, sc.epochs, sc.steps),
                   max_len, pad if pad is not None else 0)


def check_outputs(cfg: Config, model_dir: str | Path) -> None:
    """SFTOutputError unless this run may write run.dir's metrics and sft.output_dir (read-only check)."""
    out, run_dir = Path(cfg.sft.output_dir).expanduser(), Path(cfg.run.dir)
    if out.resolve() == Path(model_dir).resolve():
        raise SFTOutputError(f"sft.output_dir {out} is model.path, the model this run starts from; write elsewhere")
    if out.exists() and not out.is_dir():
        raise SFTOutputError(f"sft.output_dir {out} exists and is not a directory")
    if cfg.run.overwrite:
        return
    if out.is_dir() and any(out.iterdir()):
        raise SFTOutputError(f"sft.output_dir {out} already holds files (a model written before?); choose another "
                             f"sft.output_dir, or set run.overwrite=true to replace it once the new model is complete")
    if (run_dir / "metrics.jsonl").exists():
        raise SFTOutputError(f"run.dir {run_dir} already holds another run's metrics.jsonl and this run would mix its "
                             f"records into it: choose a new run.dir, or set run.overwrite=true to delete it first")


def heldout_loss(learner, examples: list[Example], pad_id: int, rows: int) -> float:
    """Token-mean NLL of the held-out records under the current weights: the objective's own function
    (nll_loss) on the learner's log-probs, longest records first in chunks of `rows`. Collective: every
    learner rank calls it with the same records."""
    from megarl.algo.losses import nll_loss

    total = float(sum(e.trained_tokens for e in examples))
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i].ids))
    loss = 0.0
    for start in range(0, len(order), rows):
        batch = collate([examples[i] for i in order[start:start + rows]], pad_id)
        share, _ = nll_loss(learner.logprobs(batch.input_ids), batch.loss_mask, total)
        loss += float(share)
    return loss


# --------------------------------------------------------------------------------------------- the HF directory

class _Shards:
    """Greedy safetensors files of at most `max_bytes` in `directory` (a larger tensor gets one of its own)."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.files: list[tuple[str, list[str], int]] = []  # (path, tensor names, bytes)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + nbytes > self.max_bytes:
            self.flush()
        self.current[name] = tensor
        self.current_bytes += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.current:
            return
        path = self.directory / f"part-{len(self.files):05d}.safetensors"
        save_file(self.current, str(path), metadata={"format": "pt"})
        self.files.append((str(path), list(self.current), self.current_bytes))
        self.current, self.current_bytes = {}, 0


def _model_dtype(hf_config: dict) -> torch.dtype:
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def write_hf_model(learner, cfg: Config, model_dir: Path, out_dir: Path, record: dict,
                   max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write the learner's current weights as an HF model directory at `out_dir` (collective over the
    learner ranks; module docstring). Tensors are stored in model.path's dtype (config.json)."""
    import torch.distributed as dist

    from megarl.checkpoint.export import _default_file_mode
    from megarl.checkpoint.learner_state import _WEIGHT_SUFFIXES

    rank, per_stage = dist.get_rank(), cfg.learner.tp * cfg.learner.dp
    hf_config = json.loads((model_dir / "config.json").read_text())
    dtype = _model_dtype(hf_config)
    temp = out_dir.parent / f".tmp-{out_dir.name}"
    if rank == 0:
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(parents=True)
    dist.barrier()
    shards = None
    if rank % per_stage == 0:  # the first rank of pipeline stage rank // per_stage
        stage_dir = temp / f"stage{rank // per_stage}"
        stage_dir.mkdir()
        shards = _Shards(stage_dir, max_shard_bytes)
    for name, tensor in learner.publish_tensors():  # collective: every rank iterates
        if shards is not None:
            shards.add(name, tensor.detach().to(device="cpu", dtype=dtype, copy=True).contiguous())
    if shards is not None:
        shards.flush()
    files: list = [None] * dist.get_world_size()
    dist.all_gather_object(files, shards.files if shards is not None else [])
    if rank == 0:
        parts = [f for rank_files in files for f in rank_files]
        weight_map, total = {}, 0
        for i, (path, names, nbytes) in enumerate(parts):
            final = "model.safetensors" if len(parts) == 1 else f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            os.rename(path, temp / final)
            os.chmod(temp / final, _default_file_mode())  # safetensors creates 0600
            weight_map.update({name: final for name in names})
            total += nbytes
        for stage_dir in temp.glob("stage*"):
            stage_dir.rmdir()
        if len(parts) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (temp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        for path in sorted(model_dir.iterdir()):
            if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES) and path.name not in _NOT_COPIED:
                shutil.copyfile(path, temp / path.name)
        hf_config["dtype" if "dtype" in hf_config or "torch_dtype" not in hf_config else "torch_dtype"] = \
            str(dtype).removeprefix("torch.")
        (temp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if not (temp / "generation_config.json").exists():  # what samplers and generate() stop on
            gen = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf_config.get(k) is not None}
            (temp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        (temp / SFT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        old = out_dir.parent / f".old-{out_dir.name}"
        if out_dir.exists():  # empty, or replaced under run.overwrite (check_outputs): kept until the new one is whole
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out_dir, old)
        os.rename(temp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return out_dir


# --------------------------------------------------------------------------------------------- the console

class SFTConsole:
    """Rank 0's console: a progress line per step (on a terminal it overwrites itself; elsewhere at most
    about 100 lines per run, plus every evaluation) and the closing summary."""

    def __init__(self, steps: int, enabled: bool, stream=None):
        self.steps, self.enabled = steps, enabled
        self.stream = sys.stdout if stream is None else stream
        self.tty = self.stream.isatty()
        self.every = 1 if self.tty else max(1, math.ceil(steps / 100))
        self.losses: list[float] = []
        self.heldout: list[tuple[int, float]] = []
        self.start = time.monotonic()

    def update(self, step: int, metrics: dict) -> None:
        """`step` (1-based) optimizer steps done; metrics of the batch it trained on."""
        self.losses.append(metrics["loss"])
        if not self.enabled:
            return
        from megarl.observe.console import format_duration

        elapsed = time.monotonic() - self.start
        held = f"  held-out {self.heldout[-1][1]:.4f}" if self.heldout else ""
        line = (f"sft step {step}/{self.steps}  loss {metrics['loss']:.4f}{held}  epoch {metrics['epoch']:.2f}  "
                f"tok/s {metrics['tokens_per_s']:.0f}  eta {format_duration(elapsed / step * (self.steps - step))}")
        if self.tty:
            self.stream.write("\r" + line.ljust(100) + ("\n" if step == self.steps else ""))
        elif step % self.every == 0 or step == self.steps:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        if self.tty and self.losses and len(self.losses) < self.steps:
            self.stream.write("\r" + " " * 100 + "\r")
        self.stream.write(text + "\n")
        self.stream.flush()

    def evaluated(self, step: int, loss: float) -> None:
        self.heldout.append((step, loss))
        if 0 < step < self.steps:
            self.note(f"megarl sft: held-out loss {loss:.4f} after {step} steps")

    def summary(self, out_dir: Path, records: int) -> str:
        from megarl.observe.console import format_duration, tenth_means

        first, last = tenth_means(self.losses)
        lines = [f"megarl sft: done, {len(self.losses)} steps over {records} training records, trained in "
                 f"{format_duration(time.monotonic() - self.start)}. loss {first:.4f} -> {last:.4f} "
                 f"(mean of the first -> last 10% of steps)"]
        if self.heldout:
            lines.append(f"megarl sft: held-out loss {self.heldout[0][1]:.4f} (before) -> {self.heldout[-1][1]:.4f} (after)")
        lines.append(f"megarl sft: model written to {out_dir} (HF format); RL from it: megarl train CONFIG "
                     f"model.path={out_dir}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------- the run

def _any_rank_stopped() -> int:
    """The stop signal (SIGTERM/SIGINT/SIGHUP) some learner rank received, or 0: one all-reduce per step, so
    every rank leaves at the same step boundary."""
    import torch.distributed as dist

    from megarl.distributed.lifetime import stop_signal

    flag = torch.tensor([stop_signal() or 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag)


def run_sft(cfg: Config, rank: int, world: int) -> None:
    from megarl.algo.config import NLLConfig
    from megarl.config.load import ConfigError, save_config
    from megarl.distributed import launch_gate
    from megarl.distributed.lifetime import exit_status, install_stop_handlers
    from megarl.distributed.ranks import Topology
    from megarl.distributed.topology import connect_store, init_learner_group
    from megarl.learner import build_learner, import_backend, with_decay_steps
    from megarl.embedded.registry import resolve_model_path
    from megarl.models.layout import check_layout
    from megarl.observe.sinks import MetricsSink
    from megarl.observe.trackers import open_trackers

    lc = cfg.learner
    torch.set_num_threads(lc.threads)
    topo = Topology(rank=rank, world_size=world, num_learners=world, num_samplers=0,
                    learners_per_stage=lc.tp * lc.dp, learner_tp=lc.tp)
    store = connect_store(topo, cfg.dist.timeout_s)
    if launch_gate.gated():  # `megarl sft` may still be checking: import ahead, act only once it lets the run go
        import_backend(lc.backend)
        if not launch_gate.wait_for_go(store, cfg.dist.timeout_s, rank):
            return  # refused: nothing was done
    install_stop_handlers()  # a stop signal ends the run at the next step boundary, on every rank
    model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    try:  # a raw torchrun launch skipped `megarl sft`'s checks: refuse the layout naming its key
        check_layout(json.loads((model_dir / "config.json").read_text()), lc.tp, lc.pp, 1)
    except ValueError as exc:
        raise ConfigError(f"{model_dir / 'config.json'}: {exc}") from None
    lead = rank == 0
    if lead:  # the rank that writes run.dir holds it (a raw torchrun launch), or its launcher does
        try:
            run_lock.hold(cfg.run.dir)
        except run_lock.RunDirError as exc:
            sys.exit(f"megarl sft: {exc}")
    data = load_data(cfg, model_dir)
    check_outputs(cfg, model_dir)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    init_learner_group(topo, store, cfg.dist.backend, cfg.dist.timeout_s)
    # megarl sft's lr is sft.lr; every other optimizer and layout key is learner.*'s (the lr schedule's decay spans
    # the SFT steps unless learner.lr_decay_steps is set).
    try:
        sft_learner = with_decay_steps(replace(lc, lr=cfg.sft.lr), data.steps)
    except ValueError as exc:
        sys.exit(f"megarl sft: {exc}")
    learner = build_learner(str(model_dir), replace(cfg, learner=sft_learner), NLLConfig(), 1.0)
    sc = cfg.sft
    console = SFTConsole(data.steps, cfg.run.progress)
    sink = None
    if lead:
        run_dir = Path(cfg.run.dir)
        if cfg.run.overwrite:
            for name in ("metrics.jsonl", "tensorboard"):
                path = run_dir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        sink = MetricsSink(run_dir, open_trackers(cfg))
        if os.environ.get(CHECKED_ENV) != "1":
            for line in data.lines():
                console.note(f"megarl sft: {line}")
        console.note(f"megarl sft: {data.steps} steps of {sc.batch_size} records "
                     f"({data.steps * sc.batch_size / len(data.train):.2f} epochs), sft.lr {sc.lr}, learner.backend "
                     f"{lc.backend}, {world} learner ranks (tp {lc.tp}, pp {lc.pp}, dp {lc.dp})")
    order = batch_order(len(data.train), sc.batch_size, data.steps, cfg.run.seed)
    rows = lc.micro_batch_size
    nonfinite = NonfiniteSteps(lc.max_nonfinite_in_row, "megarl sft", "Lower sft.lr or check the data.")
    last = time.perf_counter()
    try:
        for step in range(data.steps + 1):
            record: dict = {}
            if data.heldout and (step in (0, data.steps) or (sc.eval_every and step % sc.eval_every == 0)):
                record["heldout_loss"] = heldout_loss(learner, data.heldout, data.pad_id, rows)
                console.evaluated(step, record["heldout_loss"])
            if step == data.steps:
                if lead and record:
                    sink.log(step, record)
                break
            signum = _any_rank_stopped()
            if signum:
                if lead:
                    console.note(f"megarl sft: stopped by {signal.Signals(signum).name} after {step} steps; the model was not written "
                                 f"(sft.output_dir is written once training ends); metrics so far in {cfg.run.dir}")
                raise SystemExit(exit_status(signum))
            batch = collate([data.train[i] for i in order[step]], data.pad_id, learner.version)
            metrics = learner.train_step(batch)
            nonfinite.count(metrics, step, last=step == data.steps - 1)
            now = time.perf_counter()
            metrics = {**metrics, **record, "epoch": (step + 1) * sc.batch_size / len(data.train),
                       "tokens_per_s": batch.num_tokens / (now - last), "version": learner.version}
            last = now
            if lead:
                sink.log(step, metrics)
                console.update(step + 1, metrics)
        losses = [loss for _, loss in console.heldout]
        out_dir = Path(sc.output_dir).expanduser()
        record = {"base_model": str(model_dir.resolve()), "data": str(Path(sc.data).resolve()), "steps": data.steps,
                  "batch_size": sc.batch_size, "lr": sc.lr, "train_records": len(data.train),
                  "heldout_records": len(data.heldout), "heldout_loss_before": losses[0] if losses else None,
                  "heldout_loss_after": losses[-1] if losses else None,
                  "loss_first_step": console.losses[0] if console.losses else None,
                  "loss_last_step": console.losses[-1] if console.losses else None}
        write_hf_model(learner, cfg, model_dir, out_dir, record)
        if lead:
            console.note(console.summary(out_dir, len(data.train)))
    finally:
        if sink is not None:
            sink.close()


def main(argv: list[str] | None = None) -> None:
    from megarl.config.load import load_config, validate_sft
    from megarl.observe.quiet import silence_known_library_warnings

    silence_known_library_warnings()
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit("usage: torchrun ... -m megarl.sft.run CONFIG [key=value ...]")
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError as exc:
        raise RuntimeError(f"{exc.args[0]} is not set: megarl sft ranks are started by torchrun (megarl sft does)") from None
    cfg = load_config(argv[0], argv[1:])
    validate_sft(cfg, world_size=world)
    run_sft(cfg, rank, world)


if __name__ == "__main__":
    from megarl.distributed.lifetime import run_then_exit

    run_then_exit(main)
