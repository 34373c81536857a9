"""Load a run configuration from YAML + `key=value` overrides, and check it before any process starts.

Errors are `ConfigError`s whose message names the offending key, so a typo in a 200-line YAML or
on the command line is found in one read.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from megarl.algo.config import validate_advantage_config, validate_loss_config
from megarl.config.schema import Config


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key."""


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Merge the YAML file at `path` (optional) and dotlist `overrides` onto the schema, then validate."""
    schema = OmegaConf.structured(Config)
    layers = [schema]
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            layers.append(OmegaConf.load(path))
        except Exception as exc:  # YAML syntax errors come in several exception types
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
    try:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
    except OmegaConfBaseException as exc:
        raise ConfigError(_describe(exc)) from exc
    cfg: Config = OmegaConf.to_object(merged)
    validate(cfg)
    return cfg


def _describe(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None)
    msg = str(exc).splitlines()[0]
    if isinstance(exc, ConfigKeyError):
        return f"unknown config key '{key}': {msg}"
    return f"bad value for config key '{key}': {msg}" if key else msg


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), Path(path))


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def world_size_for(cfg: Config) -> int:
    """Processes a run needs: every learner rank plus one per sampler engine."""
    return cfg.learner.tp * cfg.learner.pp * cfg.learner.dp + cfg.sampler.num_engines


def _require(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Cross-field rules. `world_size`, when known (inside torchrun), must match the topology."""
    _check_positive(cfg)
    lc = cfg.learner
    _require(lc.backend == "megatron", "learner.backend", f"unknown backend {lc.backend!r}; known: megatron")
    _require(cfg.sampler.engine == "builtin", "sampler.engine", f"unknown engine {cfg.sampler.engine!r}; known: builtin")
    _require(cfg.sampler.kv_on_update in ("keep", "recompute"), "sampler.kv_on_update", "must be 'keep' or 'recompute'")
    _require(cfg.algo.mode in ("pipeline", "sync"), "algo.mode", f"must be 'pipeline' or 'sync', got {cfg.algo.mode!r}")
    if cfg.algo.mode == "pipeline":
        _require(cfg.algo.sync_epochs == 1, "algo.sync_epochs",
                 "epochs over one batch are a sync-mode setting; in pipeline mode every batch gets exactly one "
                 "optimizer step (set algo.mode=sync for the K-epoch baseline)")
    else:
        _require(cfg.algo.prompts_per_step % cfg.sampler.num_engines == 0, "algo.prompts_per_step",
                 f"sync mode splits each batch evenly over the samplers: {cfg.algo.prompts_per_step} prompts do not "
                 f"divide over sampler.num_engines={cfg.sampler.num_engines}")
        _require(not cfg.algo.advantage.filter_zero_variance, "algo.advantage.filter_zero_variance",
                 "sync mode generates exactly one batch per version, so dropped groups could not be replaced")
    _require(cfg.dist.backend in ("auto", "gloo", "nccl"), "dist.backend", "must be auto, gloo or nccl")
    _require(cfg.algo.max_lag >= 0, "algo.max_lag", "must be >= 0")
    _require(cfg.algo.group_size >= 2, "algo.group_size", "group advantages need at least 2 samples per prompt")
    _require(0.0 < cfg.sampling.top_p <= 1.0, "sampling.top_p", "must be in (0, 1]")
    _require(cfg.sampling.temperature >= 0.0, "sampling.temperature", "must be >= 0")
    _require(cfg.sampling.max_new_tokens < cfg.sampler.max_seq_len, "sampling.max_new_tokens",
             f"({cfg.sampling.max_new_tokens}) must be smaller than sampler.max_seq_len ({cfg.sampler.max_seq_len})")
    _require(lc.pp == 1, "learner.pp", "pipeline parallelism is not supported yet (learner.tp and learner.dp are)")
    _require(not lc.use_distributed_optimizer, "learner.use_distributed_optimizer",
             "megatron's distributed optimizer is not supported on this version yet")
    if world_size is not None:
        need = world_size_for(cfg)
        _require(world_size == need, "sampler.num_engines",
                 f"the topology needs {need} processes (learner.tp*pp*dp = {need - cfg.sampler.num_engines} learner "
                 f"ranks + {cfg.sampler.num_engines} sampler ranks) but the launch has WORLD_SIZE={world_size}")
    try:
        validate_loss_config(cfg.algo.loss)
        validate_advantage_config(cfg.algo.advantage)
    except ValueError as exc:  # their messages start with "loss.<field>" / "advantage.<field>"
        raise ConfigError(f"algo.{exc}") from exc


def _check_positive(cfg: Config) -> None:
    """Every count and size in the schema must be positive; checked generically so new keys are covered."""
    positive = {
        "run.steps", "sampling.max_new_tokens", "sampler.num_engines", "sampler.max_running",
        "sampler.max_seq_len", "sampler.threads", "learner.tp", "learner.pp", "learner.dp",
        "learner.micro_batch_size", "learner.threads", "learner.lr", "algo.prompts_per_step", "algo.sync_epochs",
        "publish.bucket_mb", "publish.timeout_s", "queue.timeout_s", "dist.timeout_s", "task.max_operand",
    }
    for key in positive:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        _require(value > 0, key, f"must be > 0, got {value}")

