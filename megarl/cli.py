"""`megarl` command line: `megarl train CONFIG [key=value ...]`, `megarl placement CONFIG --nnodes N`.

`train` takes run.dir for the run's lifetime (megarl/run_lock.py: a second run into it is refused), checks
the whole configuration (keys, types, topology), the model directory (config.json, a supported architecture,
weights, a tokenizer that loads) and the task (dataset rows, reward function, sandbox) before any worker
starts, then launches one torchrun holding every role and waits for it.
`placement` prints which node runs which ranks and roles for a multi-node launch (docs/launch.md).
`export --checkpoint CKPT --out DIR` writes a learner checkpoint as an HF model directory (docs/checkpoint.md).
`eval CONFIG [key=value ...]` scores model.path (or `--checkpoint`) on eval.sets as a run evaluates (docs/eval.md).
`config [KEY] [--diff CONFIG [key=value ...]] [--markdown]` prints the config reference: every key's type, default
and comment from megarl/config/schema.py (megarl.config.reference renders it; docs/config.md is its Markdown).
`sft CONFIG [key=value ...]` fine-tunes model.path on sft.data (supervised, the learner backends and layouts of
`train`), after the same checks, and writes an HF model directory `train` takes as model.path (docs/sft.md).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

from megarl import run_lock
from megarl.config import fault_policy
from megarl.config.load import ConfigError, learner_ranks, load_config, world_size_for
from megarl.distributed.lifetime import STOP_SIGNALS

# A tokenizer is one of these file sets (fast tokenizer, byte-level BPE, sentencepiece).
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))


# torchrun with its store on 127.0.0.1 and a fresh run secret (megarl.distributed.local_launch); cmd[3:] are
# torchrun's own arguments.
LOCAL_TORCHRUN = [sys.executable, "-m", "megarl.distributed.local_launch"]
LOCAL_NOTE = "  (one node; its store on 127.0.0.1 only: python -m megarl.distributed.local_launch)"


def torchrun_command(config: str, overrides: list[str], nproc: int, max_restarts: int = 0,
                     shutdown_timeout_s: int = 30) -> list[str]:
    return [*LOCAL_TORCHRUN, f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            f"--shutdown-timeout={shutdown_timeout_s}", "-m", "megarl.roles.worker", config, *overrides]


def train(args: argparse.Namespace) -> int:
    try:
        cfg, nodes = checked_config(args)
    except ConfigError as exc:
        print(f"megarl: config error: {exc}", file=sys.stderr)
        return 2
    if args.nnodes > 1 and not args.dry_run:
        print("megarl: train launches one node; start multi-node runs with launch/torchrun_multi_node.sh or "
              "launch/slurm_multi_node.sbatch (docs/launch.md)", file=sys.stderr)
        return 2
    created = not Path(cfg.run.dir).exists()
    if not claim_run_dir(cfg, args.dry_run):
        return 2
    code = check_and_launch(args, cfg, nodes)
    if code == 2 and created:  # refused before launch: the directory made only to hold the lock goes again
        run_lock.release_unused(cfg.run.dir)
    return code


@contextmanager
def gated_torchrun(cmd: list[str], env: dict, dry_run: bool):
    """torchrun started gated before the CLI's checks, so its own start-up (Python, torch: ~2 s) overlaps them:
    it launches nothing until the run lets it go, and leaving the block without that (a refusal, Ctrl-C) kills it
    (megarl.distributed.supervisor.GatedStart). None under --dry-run, which starts nothing."""
    from megarl.distributed.supervisor import GatedStart

    gated = None if dry_run else GatedStart(cmd, env)
    try:
        yield gated
    finally:
        if gated is not None:
            gated.cancel()  # nothing once the run let it go


def check_and_launch(args: argparse.Namespace, cfg, nodes) -> int:
    """`megarl train` once run.dir is held: the model, task, eval and checkpoint checks, then torchrun (started
    gated before the checks: gated_torchrun)."""
    restarts = cfg.fault.max_restarts if cfg.fault.on_failure == "restart" else 0
    cmd = torchrun_command(args.config, args.overrides, world_size_for(cfg), restarts, cfg.fault.stop_timeout_s)
    env = torchrun_env(cfg)
    with gated_torchrun(cmd, env, args.dry_run) as gated:
        model_dir = checked_for_launch(cfg)
        if model_dir is None:
            return 2
        print(f"megarl: model {model_dir}; run dir {cfg.run.dir}")
        print(f"megarl: {fault_policy.describe(cfg)}")
        if args.nnodes > 1:
            print(f"megarl: processes per node: {len(nodes[0])} ({args.nnodes} nodes)")
            if args.dry_run:
                print_resolved_config(cfg)
        else:
            print_launch(cmd, cfg, args.dry_run)
        if args.dry_run:
            return 0
        return run_torchrun(cmd, env, cfg, gated)


def print_launch(cmd: list[str], cfg, dry_run: bool) -> None:
    """The torchrun command being launched; under --dry-run the resolved config (every key, defaults and overrides
    applied: what the workers will run) and the command that a run would launch."""
    if not dry_run:
        print("megarl: launching: torchrun " + shlex.join(cmd[3:]) + LOCAL_NOTE, flush=True)
        return
    print_resolved_config(cfg)
    print("megarl: dry run, would launch: torchrun " + shlex.join(cmd[3:]) + LOCAL_NOTE, flush=True)


def print_resolved_config(cfg) -> None:
    from omegaconf import OmegaConf

    print("megarl: dry run; the resolved config:\n" + OmegaConf.to_yaml(OmegaConf.structured(cfg)).rstrip())


def checked_for_launch(cfg) -> Path | None:
    """The model, task, eval and checkpoint checks of `megarl train`, run.dir prepared: the model directory,
    or None after printing why not."""
    model_dir = checked_model_dir(cfg)
    if model_dir is None or not teacher_fits(cfg, model_dir) or not critic_fits(cfg, model_dir):
        return None
    try:
        for line in check_task(cfg):
            print(f"megarl: {line}")
    except (OSError, ImportError, ValueError) as exc:
        print(f"megarl: task: {exc}", file=sys.stderr)
        return None
    if not print_eval_check(cfg, model_dir) or not print_tracker_check(cfg):
        return None
    from megarl.checkpoint.manifest import check_resumable, read_manifest
    from megarl.checkpoint.resume import check_export_target, find_checkpoint, prepare_run_dir
    from megarl.checkpoint.storage import CheckpointError

    try:  # the learner checks again (raw torchrun launches); here it costs no process start
        check_export_target(cfg)
        resume_from = find_checkpoint(cfg)
        if resume_from is not None:  # a layout the checkpoint cannot load is refused before any process starts
            check_resumable(resume_from, read_manifest(resume_from), cfg.learner)
        prepare_run_dir(cfg, resume_from, clear=False)  # with run.overwrite the learner clears, once launched
    except CheckpointError as exc:
        print(f"megarl: checkpoint: {exc}", file=sys.stderr)
        return None
    if resume_from is not None:
        print(f"megarl: resuming from {resume_from}")
    return model_dir


def torchrun_env(cfg) -> dict:
    """The environment of a local torchrun: this process's, the run.dir hold (megarl/run_lock.py), one thread."""
    env = {**os.environ, **run_lock.launcher_env(cfg.run.dir)}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def claim_run_dir(cfg, dry_run: bool) -> bool:
    """Hold cfg.run.dir for this process's lifetime (the whole torchrun), so a second run into it is refused
    before it checks or launches anything (megarl/run_lock.py); a dry run only checks that it is free.
    False after printing why not."""
    try:
        run_lock.check_free(cfg.run.dir) if dry_run else run_lock.hold(cfg.run.dir)
    except (run_lock.RunDirError, OSError) as exc:
        print(f"megarl: {exc}", file=sys.stderr)
        return False
    return True


def run_torchrun(cmd: list[str], env: dict, cfg, gated=None) -> int:
    """Run torchrun (megarl.distributed.supervisor; `gated`: the GatedStart of `cmd` to let go); a stop signal
    to this process stops the whole run and exits 128 + its number, saying how to resume; if the run fails,
    say which rank and role failed first."""
    from megarl.checkpoint.storage import CheckpointError, find_latest
    from megarl.distributed.lifetime import exit_status
    from megarl.distributed.supervisor import TorchrunRun

    run = TorchrunRun(cmd, env, cfg.fault.stop_timeout_s, gated)
    code = run.wait()
    if run.signalled is not None:
        try:
            latest = find_latest(cfg.checkpoint.dir) if Path(cfg.checkpoint.dir).is_dir() else None
        except CheckpointError:
            latest = None
        print(f"megarl: stopped by {signal.Signals(run.signalled).name}; every process of the run has exited. "
              f"Outputs are in {cfg.run.dir}"
              + (f"; continue from {latest} with the same command and run.resume=true" if latest else
                 " (no checkpoint was saved: fault.checkpoint_on_signal=true or checkpoint.every_steps save one)"),
              file=sys.stderr)
        return exit_status(run.signalled)
    if run.killed_by is not None:
        print(f"megarl: the run failed: torchrun (pid {run.proc.pid}) was killed by {signal.Signals(run.killed_by).name}"
              f" (from outside megarl); megarl stopped its workers. Outputs so far are in {cfg.run.dir}",
              file=sys.stderr)
        return exit_status(run.killed_by)
    if code != 0:
        print(f"megarl: the run failed: {failure_summary(''.join(run.tail), cfg)}", file=sys.stderr)
    return code


def failure_summary(torchrun_stderr: str, cfg) -> str:
    """One line naming the failed rank that caused the stop, its role and how it ended, from torchrun's
    failure report (and, for a hung sampler, the learner's heartbeat error above it).

    torchrun's "Root Cause" is the failure it observed first, and that is often an effect: when a rank is
    killed from outside (kill -9, the OOM killer), its peers' collectives and sockets break and they exit
    with an error within milliseconds, sometimes before torchrun's monitor sees the kill. So a rank
    that died of a signal is named in preference, except the signals torchrun itself sends to stop the
    rest: SIGTERM (or the 128 + 15 a megarl worker exits with on it), and the SIGKILL it escalates to
    for a process that ignored the SIGTERM (a hung one: "Unable to shutdown process PID"). A learner
    that stopped the run because a sampler's heartbeat went quiet names that sampler as the cause.
    """
    from megarl.distributed.ranks import Topology

    report = torchrun_stderr[torchrun_stderr.rfind("Failures:"):]
    failures = [(int(rank), int(code), int(pid)) for rank, code, pid in
                re.findall(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)", report, re.S)]
    if not failures:
        return "torchrun exited with an error (see its output above)"
    escalated = {int(pid) for pid in re.findall(r"Unable to shutdown process (\d+) via", torchrun_stderr)}
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", report, re.S)
    killed = [(rank, code) for rank, code, pid in failures
              if code < 0 and -code != signal.SIGTERM and pid not in escalated]
    rank, code = killed[0] if killed else (int(root.group(1)), int(root.group(2))) if root else failures[0][:2]
    stops = {-signal.SIGTERM, *(128 + s for s in STOP_SIGNALS)}  # how a rank ends when told to stop
    errors = [(r, c) for r, c, _ in failures if c > 0 and c not in stops]
    if not killed and code in stops and errors:  # it was stopped; the rank with an error is the cause
        rank, code = errors[0]
    learners, world = learner_ranks(cfg.learner), world_size_for(cfg)
    topo = Topology(rank=rank, world_size=world, num_learners=learners, num_samplers=world - learners)
    if code < 0:
        how = f"was killed by signal {-code} ({signal.Signals(-code).name})"
    elif code - 128 in set(STOP_SIGNALS):
        how = f"stopped on {signal.Signals(code - 128).name} (exit code {code})"
    else:
        how = f"exited with code {code} (its traceback is above)"
    after = (f"torchrun stopped every process after {cfg.fault.max_restarts} restarts (fault.max_restarts)"
             if cfg.fault.on_failure == "restart" else "torchrun stopped every other process")
    hung = re.findall(r"sampler rank (\d+) \(sampler (\d+)\) (?:stopped beating: no heartbeat for|has not started its "
                      r"loop: no heartbeat for|has sent no heartbeat for) (\d+)s", torchrun_stderr)
    if topo.role == "learner" and code > 0 and hung:
        sampler_rank, sampler, silent_s = hung[-1]
        return (f"sampler {sampler} (rank {sampler_rank}) hung: alive but silent, no heartbeat for {silent_s}s, "
                f"so {topo.role} {topo.role_rank} (rank {rank}) stopped the run (its "
                f"error is above); {after}. Outputs so far are in {cfg.run.dir}")
    return f"{topo.role} {topo.role_rank} (rank {rank}) {how}; {after}. Outputs so far are in {cfg.run.dir}"


def checked_model_dir(cfg) -> Path | None:
    """cfg.model.path resolved (an embedded model built on first use) and checked; None after printing why not."""
    from megarl.embedded.registry import resolve_model_path

    try:
        model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        check_model_dir(model_dir, cfg)
    except (FileNotFoundError, ValueError) as exc:
        print(f"megarl: model.path: {exc}", file=sys.stderr)
        return None
    return model_dir


def teacher_fits(cfg, model_dir) -> bool:
    """algo.distill.teacher (when set) resolved, built if embedded, and checked against the student
    (megarl.learner.teacher.check_teacher); False after printing why not, naming both paths."""
    if not cfg.algo.distill.teacher:
        return True
    from megarl.learner.teacher import check_teacher
    from megarl.embedded.registry import resolve_model_path

    try:
        teacher_dir = resolve_model_path(cfg.algo.distill.teacher, cfg.model.cache_dir)
        check_teacher(teacher_dir, model_dir, cfg.sampler.max_seq_len)
    except FileNotFoundError as exc:
        print(f"megarl: algo.distill.teacher: {exc}", file=sys.stderr)
        return False
    except ValueError as exc:
        print(f"megarl: {exc}", file=sys.stderr)
        return False
    print(f"megarl: distillation teacher {teacher_dir} (runs on the learner ranks)")
    return True


def critic_fits(cfg, model_dir) -> bool:
    """advantage.estimator=gae: the critic's model (algo.critic.model, default the policy's) checked against the
    policy (megarl.learner.critic.check_critic); False after printing why not, naming the key."""
    if cfg.algo.advantage.estimator != "gae":
        return True
    from megarl.learner.critic import check_critic

    try:
        check_critic(cfg.algo.critic.model or model_dir, model_dir)
    except ValueError as exc:
        print(f"megarl: {exc}", file=sys.stderr)
        return False
    return True


def check_model_dir(model_dir, cfg=None) -> None:
    """ValueError naming the file and what is missing or unsupported, for what the workers would load
    (and, given the run config, split over its learner.tp/pp and sampler.tp: megarl/models/layout.py).
    A config megarl's own mappings refuse runs on the generic path under learner.backend=deepspeed
    (check_generic_model); every other backend refuses it, naming docs/models.md and that path."""
    from pathlib import Path

    from megarl.models.families import MODEL_TYPES, generic_path_hint
    from megarl.models.layout import check_layout
    from megarl.models.lora_targets import check as check_lora, check_peft
    from megarl.models.support import check_supported, has_weights

    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    try:
        hf_config = json.loads(config.read_text())
    except ValueError as exc:
        raise ValueError(f"{config} is not valid JSON: {exc}") from exc
    generic = False
    try:
        check_supported(hf_config)
    except ValueError as exc:
        if cfg is None or cfg.learner.backend != "deepspeed":
            # (a model type outside the families is refused naming docs/models.md and the generic path already)
            hint = "" if "docs/models.md" in str(exc) else (
                f" (megarl maps the model families of docs/models.md: model_type {', '.join(MODEL_TYPES)}; "
                f"{generic_path_hint()})")
            raise ValueError(f"{config}: {exc}{hint}") from exc
        generic = True
    from megarl.models.families import is_native

    # (a model only the megatron learner maps, megarl.models.families.LEARNER_FAMILIES: the built-in engine runs it on
    # the generic path, and so does the DeepSpeed learner)
    learner_only = not generic and not is_native(hf_config) and cfg is not None
    generic = generic or (learner_only and cfg.learner.backend == "deepspeed")
    if generic or learner_only:
        try:
            check_generic_model(hf_config, cfg)
        except ValueError as exc:
            raise ValueError(f"{config}: {exc}") from exc
    if not generic and cfg is not None:
        try:
            check_layout(hf_config, cfg.learner.tp, cfg.learner.pp, cfg.sampler.tp, cfg.learner.ep,
                         cfg.algo.routing_replay, cfg.learner.cp)
            check_route_recording(hf_config, cfg)
            check_vllm_model(hf_config, cfg)
            check_sglang_model(hf_config, cfg)
            check_mxfp4_model(hf_config, cfg)
        except ValueError as exc:
            raise ValueError(f"{config}: {exc}") from exc
        try:  # target modules the model has, ranks its dimensions allow
            if cfg.learner.backend == "deepspeed":
                check_peft(hf_config, cfg.learner.lora)
            else:
                check_lora(hf_config, cfg.learner.lora)
        except ValueError as exc:
            raise ValueError(f"{config}: {exc}") from exc
    if cfg is not None and cfg.sampler.engine == "builtin":
        try:
            check_kv_cache(hf_config, cfg.sampler.max_running, cfg.sampler.max_seq_len, _memory_bytes())
        except ValueError as exc:
            raise ValueError(f"{config}: {exc}") from exc
    if not has_weights(model_dir):
        raise ValueError(f"model directory {str(model_dir)!r} has no weights (model.safetensors or "
                         f"model.safetensors.index.json)")
    present = [files for files in TOKENIZER_FILES if all((model_dir / name).is_file() for name in files)]
    if not present:
        raise ValueError(f"model directory {str(model_dir)!r} has no tokenizer files (one of: "
                         f"{'; '.join(' + '.join(files) for files in TOKENIZER_FILES)})")
    from megarl.check_memo import memo_path

    memo = None if cfg is None else memo_path(cfg.model.cache_dir)
    check_tokenizer(model_dir, present[0], hf_config.get("vocab_size"), memo)


def check_route_recording(hf_config: dict, cfg) -> None:
    """R3 on the built-in engine needs the routes its native forward records; a config it samples on its generic
    model (one its native forward refuses; any family under sampler.model_impl=hf) records none. ValueError naming
    the key."""
    if cfg.algo.routing_replay != "r3" or cfg.sampler.engine != "builtin":
        return
    from megarl.sampler import model as native

    try:
        if cfg.sampler.model_impl == "hf":
            raise ValueError("sampler.model_impl=hf")
        native.ModelSpec.from_hf_config(hf_config)
    except ValueError as exc:
        raise ValueError(f"algo.routing_replay=r3: the built-in engine samples model_type "
                         f"{hf_config.get('model_type')!r} on its generic model ({exc}), which records no routes "
                         f"(algo.routing_replay=off; docs/models.md)") from None


# (kv_lora_rank, qk_rope_head_dim): the one MLA size vLLM 0.32's CPU attention kernel serves (DeepSeek's own)
VLLM_CPU_MLA_LATENT = (512, 64)


def check_vllm_model(hf_config: dict, cfg) -> None:
    """sampler.engine=vllm on a config vLLM 0.32 (CPU, megarl.sampler.vllm_env) would serve as another model or fail
    on at its first request: refused before launch, naming the key (docs/vllm.md, its limits).
    gpt-oss: vLLM clamps its SwiGLU at the released 7.0 whatever `swiglu_limit` says.
    DeepSeek-V3: the CPU MLA kernel takes only a latent of 512 + 64 RoPE dims, and vLLM loads the router's
    `e_score_correction_bias` only under `topk_method: noaux_tc`."""
    if cfg.sampler.engine != "vllm":
        return
    model_type = hf_config.get("model_type")
    if model_type == "gpt_oss":
        limit = hf_config.get("swiglu_limit", 7.0)
        if limit != 7.0:
            raise ValueError(f"sampler.engine=vllm: vLLM 0.32 clamps gpt-oss's SwiGLU at 7.0 and ignores swiglu_limit="
                             f"{limit} in config.json, so it would sample from another model than the learner trains; "
                             f"use sampler.engine=builtin, which serves gpt-oss natively")
    if model_type == "deepseek_v3":
        latent = (hf_config.get("kv_lora_rank"), hf_config.get("qk_rope_head_dim"))
        if latent != VLLM_CPU_MLA_LATENT:
            raise ValueError(f"sampler.engine=vllm: vLLM 0.32's CPU MLA kernel takes only kv_lora_rank="
                             f"{VLLM_CPU_MLA_LATENT[0]} with qk_rope_head_dim={VLLM_CPU_MLA_LATENT[1]}, and config.json "
                             f"has kv_lora_rank={latent[0]}, qk_rope_head_dim={latent[1]} (the server would fail at "
                             f"its first request); use sampler.engine=builtin")
        if hf_config.get("topk_method") != "noaux_tc":
            raise ValueError(f"sampler.engine=vllm: vLLM 0.32 loads DeepSeek-V3's router bias "
                             f"(e_score_correction_bias) only under topk_method: noaux_tc, and config.json has "
                             f"topk_method={hf_config.get('topk_method')!r}; set it (released checkpoints do) or use "
                             f"sampler.engine=builtin")


def check_mxfp4_model(hf_config: dict, cfg) -> None:
    """An MXFP4 checkpoint (gpt-oss's on the hub) is dequantized by megarl's own loader (megarl.models.mxfp4), which
    the megatron learner and the built-in engine read it through; the DeepSpeed learner (transformers' loader, which
    keeps MXFP4 where its kernels run) and the vLLM and SGLang servers (which load the directory themselves, then take
    megarl's float publishes) are refused, naming the key."""
    from megarl.models.mxfp4 import is_mxfp4

    if not is_mxfp4(hf_config):
        return
    for key, value, allowed in (("learner.backend", cfg.learner.backend, "megatron"),
                                ("sampler.engine", cfg.sampler.engine, "builtin")):
        if value != allowed:
            raise ValueError(f"{key}={value}: an MXFP4 checkpoint (quantization_config mxfp4) is dequantized by megarl's "
                             f"own loader, which the megatron learner and the built-in engine read it through; use "
                             f"{key}={allowed}, or a dequantized checkpoint")


def check_sglang_model(hf_config: dict, cfg) -> None:
    """sampler.engine=sglang on a real SGLang server (sampler.sglang.server=sglang) with a config SGLang would load
    wrongly or not build: refused before launch, as the sampler would refuse it when it starts its server
    (megarl.sampler.sglang_engine.check_sglang_serves, imported only then: the CLI stays light)."""
    if cfg.sampler.engine == "sglang" and cfg.sampler.sglang.server == "sglang":
        from megarl.sampler.sglang_engine import check_sglang_serves

        check_sglang_serves(hf_config)


def check_generic_model(hf_config: dict, cfg) -> None:
    """The generic path (docs/models.md#the-generic-path, learner.backend=deepspeed): a model type transformers
    loads as a causal LM, and none of what that path does not do (LoRA, R3 route replay, a tensor-parallel or
    native built-in engine); ValueError naming the key."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = hf_config.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"model_type {model_type!r} is not a causal LM transformers can load (AutoModelForCausalLM), "
                         f"so neither megarl's families (docs/models.md) nor its generic path take it")
    where = f"model_type {model_type!r} runs on the generic path (docs/models.md#the-generic-path)"
    if cfg.learner.lora.rank > 0:
        raise ValueError(f"learner.lora.rank={cfg.learner.lora.rank}: {where}, which trains every weight; LoRA "
                         f"needs a family of docs/models.md (learner.lora.rank=0)")
    if cfg.algo.routing_replay == "r3":
        raise ValueError(f"algo.routing_replay=r3: {where}, which records no routes; R3 needs a mixture-of-experts "
                         f"family of docs/models.md (algo.routing_replay=off)")
    if cfg.sampler.engine == "builtin":
        if cfg.sampler.model_impl == "native":
            raise ValueError(f"sampler.model_impl=native: {where}; the built-in engine runs it with "
                             f"sampler.model_impl=auto or hf")
        from megarl.sampler.hf_model import ModelSpec

        ModelSpec.from_hf_config(hf_config).shard(cfg.sampler.tp)  # what the engine cannot run, named


def check_kv_cache(hf_config: dict, max_running: int, max_seq_len: int, memory: int) -> None:
    """The built-in engine allocates its whole KV cache at start (megarl.sampler.model.KVCache: K and V for
    sampler.max_running requests of sampler.max_seq_len positions, float32 on CPU); one that could not fit in
    `memory` bytes even alone is refused here, naming the keys, rather than failing after the launch."""
    heads = hf_config.get("num_attention_heads") or 1
    head_dim = hf_config.get("head_dim") or (hf_config.get("hidden_size") or 0) // heads
    kv_heads = hf_config.get("num_key_value_heads") or heads
    need = 2 * 4 * (hf_config.get("num_hidden_layers") or 0) * kv_heads * head_dim * max_running * max_seq_len
    if need > memory:
        raise ValueError(f"sampler.max_seq_len={max_seq_len}: the built-in engine's KV cache for "
                         f"sampler.max_running={max_running} requests of that length would take {need / 2**30:,.1f} "
                         f"GiB, more than this machine's {memory / 2**30:,.1f} GiB of memory; lower "
                         f"sampler.max_seq_len or sampler.max_running")


def _memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_tokenizer(model_dir: Path, files: tuple[str, ...], vocab_size: int | None = None,
                    memo: Path | None = None) -> None:
    """Load the tokenizer as every worker will (transformers' AutoTokenizer, about a second) and round-trip it
    against the model: a corrupt tokenizer file, ids the embedding has no row for, or a tokenizer that maps
    every token to one id are named here rather than in a sampler's traceback after the launch (or a run that
    trains silently at reward 0). With `memo` (a file), a pass is remembered under the bytes of every file the
    loader may read, the transformers version and this check's code (megarl.check_memo), so the next run of the
    same model skips transformers' ~2 CPU-s import while its ranks start."""
    key = None
    if memo is not None:
        from importlib.metadata import version

        from megarl.check_memo import content_key, recall, tokenizer_inputs

        key = content_key(tokenizer_inputs(model_dir), version("transformers"), str(vocab_size),
                          Path(__file__).read_text())
        if recall(memo, key) is True:
            return
    from transformers import AutoTokenizer

    names = " + ".join(str(model_dir / name) for name in files)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 - whatever a broken file raises (KeyError, JSON, Rust parse errors)
        raise ValueError(f"{names}: the tokenizer does not load (transformers AutoTokenizer, as the workers load it): "
                         f"{type(exc).__name__}: {str(exc)[:300]}") from exc
    if (why := tokenizer_mismatch(tokenizer, vocab_size)) is not None:
        raise ValueError(f"{names}: {why}")
    if key is not None:
        from megarl.check_memo import remember

        remember(memo, key)


def tokenizer_mismatch(tokenizer, vocab_size: int | None) -> str | None:
    """Why a loaded tokenizer cannot serve a model whose embedding has `vocab_size` rows (None: not checked),
    or None. Every id the tokenizer can produce must have a row; and its tokens, decoded one by one and encoded
    again, must give more than one id (a tokenizer that maps everything to one id loads, samples and trains,
    on text that is all the same token)."""
    vocab = tokenizer.get_vocab()
    highest = max(vocab.values(), default=-1)
    if vocab_size is not None and highest >= vocab_size:
        token = next(t for t, i in vocab.items() if i == highest)
        return (f"the tokenizer has ids up to {highest} ({token!r}) but config.json's vocab_size={vocab_size}: the "
                f"model has no embedding row for them (a tokenizer from another model?)")
    special = set(tokenizer.all_special_tokens)
    ordinary = [token for token in vocab if token not in special]
    ids = sorted({vocab[token] for token in ordinary})[:256]  # (256 round trips: milliseconds)
    encoded = {i for token_id in ids for i in tokenizer.encode(tokenizer.decode([token_id]), add_special_tokens=False)}
    if len(ordinary) >= 2 and len(encoded) < 2:
        return (f"the tokenizer is degenerate: its {len(ordinary)} tokens, decoded and encoded again, all become "
                f"{sorted(encoded)}; every text would be one repeated token")
    return None


def check_task(cfg) -> list[str]:
    """Build the task once as every sampler will (dataset rows read, sandbox probed, a user reward function
    called on a few real prompts); raises what a sampler would raise, returns lines worth printing at start."""
    from megarl.rollout.rewards import check_reward
    from megarl.rollout.sandbox import SandboxError, hide_from_sandboxes, probe
    from megarl.rollout.env_adapters import task_for
    from megarl.rollout.worker_task import WorkerTask

    tc, lines = cfg.task, []
    hide_from_sandboxes(cfg.run.dir, tc.path, cfg.checkpoint.dir)  # as the samplers will
    task = task_for(tc)
    if isinstance(task, WorkerTask):  # its worker loaded the environment: the tasks are known, the check done
        task.worker.close()
        lines.append(f"{task.scheme} environment {task.env_id}: {len(task.prompts)} prompts")
    dataset = getattr(task, "task", task)  # a task scored by task.reward_fn wraps the prompt source
    if hasattr(dataset, "bad_rows"):
        lines.append(f"dataset {tc.path}: {len(dataset.prompts)} prompts"
                     + (f", {dataset.bad_rows} bad rows skipped (first: {dataset.first_bad_row})"
                        if dataset.bad_rows else ""))
    if tc.reward_sandbox or tc.reward_fn == "python_output" or tc.name == "python_output":
        try:
            layers = probe()
        except SandboxError as exc:
            raise ValueError(f"sandboxed rewards cannot run: {exc}") from exc
        if tc.sandbox.require_namespaces and "namespaces" not in layers:
            raise ValueError("task.sandbox.require_namespaces: this kernel refuses unprivileged user namespaces, so "
                             "sandboxed code could write outside its directory; set it to false to accept that (non-root only: "
                             "docs/security.md, \"Sandbox modes\", says what the fallback leaves open)")
        lines.append(f"reward sandbox: {', '.join(layers)}")
    if ":" in tc.reward_fn:  # a user function: imported and called on real prompts, in its own process
        lines.append(check_reward(task, tc.reward_fn))
    return lines


def print_eval_check(cfg, model_dir) -> bool:
    """eval.sets read and checked (megarl.eval.sets.check_sets), said on stdout; False after printing why not."""
    from megarl.eval.sets import check_sets

    try:
        for line in check_sets(cfg, model_dir):
            print(f"megarl: {line}")
    except (OSError, ImportError, ValueError) as exc:
        print(f"megarl: eval.sets: {exc}", file=sys.stderr)
        return False
    return True


def print_tracker_check(cfg) -> bool:
    """observe.trackers checked (megarl.observe.trackers.check_trackers: packages, settings), said on stdout; False
    after printing why a tracker cannot start."""
    from megarl.observe.trackers import check_trackers

    try:
        for line in check_trackers(cfg):
            print(f"megarl: {line}")
    except ValueError as exc:
        print(f"megarl: {exc}", file=sys.stderr)
        return False
    return True


def evaluate(args: argparse.Namespace) -> int:
    """`megarl eval CONFIG [key=value ...]`: score model.path (or --checkpoint) on eval.sets, write JSON."""
    try:
        cfg = load_config(args.config, args.overrides)
        if not cfg.eval.sets:
            raise ConfigError("eval.sets: names no set to score (e.g. eval.sets='[{name: heldout}]')")
    except ConfigError as exc:
        print(f"megarl: config error: {exc}", file=sys.stderr)
        return 2
    from megarl.checkpoint.storage import CheckpointError
    from megarl.eval.standalone import evaluate_checkpoint, evaluate_model, write_result
    from megarl.observe.console import Console

    model_dir = None if args.checkpoint else checked_model_dir(cfg)
    if (model_dir is None and not args.checkpoint) or (model_dir and not print_eval_check(cfg, model_dir)):
        return 2
    try:
        result = evaluate_checkpoint(cfg, args.checkpoint) if args.checkpoint else evaluate_model(cfg, model_dir)
    except CheckpointError as exc:
        print(f"megarl: checkpoint: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a checkpoint's sets are read after its export: a bad row names FILE:LINE here
        print(f"megarl: eval.sets: {exc}", file=sys.stderr)
        return 2
    what = (f"of checkpoint {result['model']} (version {result['version']})" if args.checkpoint else
            f"of the model at {result['model']} (model.path)")
    Console(0, True, cfg.run.dir).evaluated(result["version"], result["version"], result["metrics"], what)
    print(f"megarl: wrote {write_result(result, args.out)}")
    return 0


def sft(args: argparse.Namespace) -> int:
    """Check the config (keys, types, learner layout, sft.*), the model directory and the data (every line read
    and rendered as the ranks will) and the outputs, then run one torchrun of learner ranks (megarl.sft.run)."""
    try:
        cfg, _ = checked_config(args)
    except ConfigError as exc:
        print(f"megarl: config error: {exc}", file=sys.stderr)
        return 2
    if not claim_run_dir(cfg, args.dry_run):
        return 2
    from megarl.sft.run import CHECKED_ENV

    nproc = cfg.learner.tp * cfg.learner.pp * cfg.learner.dp
    cmd = [*LOCAL_TORCHRUN, f"--nproc-per-node={nproc}", "--max-restarts=0", f"--shutdown-timeout={cfg.fault.stop_timeout_s}", "-m", "megarl.sft.run",
           args.config, *args.overrides]
    env = {**torchrun_env(cfg), CHECKED_ENV: "1"}
    with gated_torchrun(cmd, env, args.dry_run) as gated:
        model_dir = checked_sft_inputs(cfg)
        if model_dir is None:
            return 2
        print(f"megarl: model {model_dir}; run dir {cfg.run.dir}; model out {cfg.sft.output_dir}")
        print_launch(cmd, cfg, args.dry_run)
        if args.dry_run:
            return 0
        return run_sft(cmd, env, cfg, gated)


def checked_sft_inputs(cfg) -> Path | None:
    """`megarl sft`'s model, data and output checks (the data's summary printed): the model directory, or None
    after printing why not."""
    model_dir = checked_model_dir(cfg)
    if model_dir is None or not print_tracker_check(cfg):
        return None
    from megarl.sft.data import SFTDataError
    from megarl.sft.run import SFTOutputError, check_outputs, load_data

    try:
        data = load_data(cfg, model_dir)
    except (SFTDataError, ValueError, OSError) as exc:  # BadRecord is a ValueError
        print(f"megarl: sft data: {exc}", file=sys.stderr)
        return None
    try:
        check_outputs(cfg, model_dir)
    except SFTOutputError as exc:
        print(f"megarl: sft: {exc}", file=sys.stderr)
        return None
    for line in data.lines():
        print(f"megarl: sft: {line}")
    return model_dir


def run_sft(cmd: list[str], env: dict, cfg, gated) -> int:
    """Run the sft torchrun (let `gated` go), saying how it ended when not well."""
    from megarl.distributed.lifetime import exit_status
    from megarl.distributed.supervisor import TorchrunRun

    run = TorchrunRun(cmd, env, cfg.fault.stop_timeout_s, gated)
    code = run.wait()
    stopped = run.signalled if run.signalled is not None else run.killed_by
    if stopped is not None:
        print(f"megarl: sft stopped by {signal.Signals(stopped).name}; every process has exited. The model was not "
              f"written (sft.output_dir is written when training ends); metrics so far in {cfg.run.dir}", file=sys.stderr)
        return exit_status(stopped)
    if code != 0:
        print(f"megarl: sft failed: {failure_summary(''.join(run.tail), cfg)}", file=sys.stderr)
    return code


def placement_lines(nodes) -> list[str]:
    """Node by node, the ranks torchrun starts there and the role each one takes."""
    first = nodes[0][0]
    lines = [f"{first.world_size} processes = {first.num_learners} learner ranks (learner.tp*pp*cp*dp) + "
             f"{first.num_samplers} sampler ranks (sampler.num_engines*tp), {len(nodes[0])} on each of {len(nodes)} nodes"]
    for node, ranks in enumerate(nodes):
        roles = [f"rank {t.rank} = {t.role} {t.role_rank}"
                 + (f" (engine {t.engine_index} TP rank {t.engine_tp_rank})"
                    if t.role == "sampler" and t.sampler_tp > 1 else "")
                 + (" (publishes weights, binds the queue at queue.host, writes run.dir)" if t.rank == 0 else "")
                 for t in ranks]
        lines.append(f"node {node} (torchrun group rank {node}): " + "; ".join(roles))
    return lines


def show_placement(args: argparse.Namespace) -> int:
    try:
        cfg, nodes = checked_config(args)
    except ConfigError as exc:
        print(f"megarl: config error: {exc}", file=sys.stderr)
        return 2
    if args.max_restarts:  # torchrun --max-restarts for fault.on_failure (launch scripts)
        print(cfg.fault.max_restarts if cfg.fault.on_failure == "restart" else 0)
        return 0
    print("\n".join(placement_lines(nodes)), file=sys.stderr if args.nproc else sys.stdout)
    if args.nproc:
        print(len(nodes[0]))
    return 0


def export(args: argparse.Namespace) -> int:
    from megarl.checkpoint.export import export_hf
    from megarl.checkpoint.storage import CheckpointError, resolve

    try:
        checkpoint = resolve(args.checkpoint)
        out = export_hf(checkpoint, args.out, max_shard_bytes=int(args.max_shard_gb * 2**30))
    except CheckpointError as exc:
        print(f"megarl: export: {exc}", file=sys.stderr)
        return 2
    print(f"megarl: exported {checkpoint} to {out}")
    return 0


def show_config(args: argparse.Namespace) -> int:
    """`megarl config`: the reference of every key, one key or section (KEY), a config's changes (--diff), or
    docs/config.md (--markdown); a wrong KEY exits 2 naming the closest keys."""
    from megarl.config import reference

    if args.diff is not None:
        if args.key is not None:
            args.overrides = [args.key, *args.overrides]  # `--diff CONFIG key=value` puts the first override in KEY
        if any("=" not in word for word in args.overrides):
            print("megarl config: --diff takes CONFIG and key=value overrides only", file=sys.stderr)
            return 2
        try:
            cfg = load_config(args.diff, args.overrides, check_files=False)
        except ConfigError as exc:
            print(f"megarl: config error: {exc}", file=sys.stderr)
            return 2
        from megarl.config.load import to_dict

        # the defaults loaded the same way, so both sides have their ${run.dir} interpolations resolved
        defaults = to_dict(load_config(None, [], check_files=False))
        print(reference.render_diff(reference.diff(to_dict(cfg), defaults),
                                    " ".join([args.diff, *args.overrides])), end="")
        return 0
    if args.overrides:
        print(f"megarl config: unexpected {' '.join(args.overrides)} (overrides go with --diff CONFIG)", file=sys.stderr)
        return 2
    if args.markdown:
        print(reference.render_markdown(), end="")
        return 0
    if args.key is None:
        print(reference.render_text(), end="")
        return 0
    try:
        print(reference.render_text(reference.lookup(args.key)), end="")
    except reference.UnknownKey as exc:
        print(f"megarl config: {exc}", file=sys.stderr)
        return 2
    return 0


def samplers(args: argparse.Namespace) -> int:
    from megarl.roles.sampler_control import add_sampler, remove_sampler

    if args.action == "add":
        return add_sampler(args.run_dir, args.overrides)
    return remove_sampler(args.run_dir, args.sampler, args.timeout_s)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl", description="Asynchronous Pipeline RL post-training")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train with a YAML config and key=value overrides")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. run.steps=20 sampler.num_engines=2")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config, print it resolved and the torchrun command; launch nothing")
    p.add_argument("--nnodes", type=int, default=1,
                   help="with --dry-run: also check that the world spreads over this many nodes (launch scripts)")
    p.set_defaults(func=train)
    p = sub.add_parser("placement", help="print which node runs which ranks and roles (multi-node launches)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value, as for train")
    p.add_argument("--nnodes", type=int, default=1, help="nodes of the launch (torchrun --nnodes)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes per node (default: the config's world size / nnodes)")
    p.add_argument("--nproc", action="store_true",
                   help="print the processes per node on stdout and the placement on stderr (for launch scripts)")
    p.add_argument("--max-restarts", action="store_true",
                   help="print only torchrun's --max-restarts for the config's fault.on_failure (for launch scripts)")
    p.set_defaults(func=show_placement)
    p = sub.add_parser("export", help="write a checkpoint as an HF-format model directory (transformers loads it)")
    p.add_argument("--checkpoint", required=True, help="a checkpoint (step_N dir) or a checkpoint.dir (its latest)")
    p.add_argument("--out", required=True, help="the HF directory to create (absent or empty)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file (default 5)")
    p.set_defaults(func=export)
    p = sub.add_parser("eval", help="score a model (model.path) or a checkpoint on eval.sets, as a run evaluates, "
                                    "and write the result as JSON")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. model.path=hf/ eval.samples=8")
    p.add_argument("--checkpoint", default="", help="a checkpoint (step_N dir) or a checkpoint.dir (its latest)")
    p.add_argument("--out", default="eval.json", help="the JSON result to write (default eval.json)")
    p.set_defaults(func=evaluate)
    p = sub.add_parser("sft", help="supervised fine-tuning on a JSONL of prompt/completion or chat records "
                                   "(writes an HF model directory for `megarl train model.path=...`)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. sft.data=train.jsonl sft.epochs=3")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config, model, data and outputs and print the torchrun command (give it before CONFIG)")
    p.set_defaults(func=sft)
    p = sub.add_parser("config", help="the config reference: every key's type, default and comment (KEY: one key or "
                                      "section; --diff CONFIG: what a config changes)")
    p.add_argument("key", nargs="?", default=None, help="a key (learner.lr) or a section (learner); default: all")
    p.add_argument("overrides", nargs="*", help="with --diff: key=value overrides applied to CONFIG")
    p.add_argument("--diff", metavar="CONFIG", default=None,
                   help="print the keys CONFIG (and key=value overrides) sets away from their defaults")
    p.add_argument("--markdown", action="store_true", help="print every key as Markdown (docs/config.md)")
    p.set_defaults(func=show_config)
    p = sub.add_parser("samplers", help="change the samplers of a running job (fault.on_failure=replace)")
    actions = p.add_subparsers(dest="action", required=True)
    q = actions.add_parser("add", help="start one more sampler (built-in engine, vLLM or SGLang-compatible server) in this "
                                       "terminal (foreground; it runs until the run ends or it is removed): it joins "
                                       "the next publish and sends groups")
    q.add_argument("run_dir", metavar="RUN_DIR", help="the running job's run.dir")
    q.add_argument("overrides", nargs="*", help="key=value over the run's saved config, e.g. sampler.max_running=8")
    q.set_defaults(func=samplers)
    q = actions.add_parser("remove", help="drain one sampler: it leaves the publish set, its running rollouts are "
                                          "dropped (counted lost), it is stopped and not replaced; the run goes on")
    q.add_argument("run_dir", metavar="RUN_DIR", help="the running job's run.dir")
    q.add_argument("--sampler", type=int, required=True, help="the sampler's index (0 .. sampler count - 1)")
    q.add_argument("--timeout-s", type=float, default=300.0,
                   help="how long to wait for the learner's answer (default 300)")
    q.set_defaults(func=samplers)
    return parser


def checked_config(args: argparse.Namespace, check_files: bool = True):
    """(config, placement) of a `train`, `sft`, `eval` or `placement` command line parsed by build_parser: the
    checks that need nothing but the config file (keys, types, cross-field rules, the topology; sft.*, and
    with `check_files` that the data files named by task.path, sft.data, sft.eval_data exist), ConfigError
    naming the key. Run first by each of those commands, and on every command the docs show
    (tests/test_doc_commands.py)."""
    from megarl.config.load import validate_sft

    cfg = load_config(args.config, args.overrides, check_files)
    if args.command == "sft":
        validate_sft(cfg, check_files=check_files)
        return cfg, None
    if args.command == "eval":  # one process scores the model: no placement to check
        return cfg, None
    from megarl.distributed.ranks import placement
    from megarl.learner import with_decay_steps

    try:  # learner.lr_decay_steps=0 spans the run (the learner resolves it the same way)
        with_decay_steps(cfg.learner, cfg.run.steps * cfg.algo.sync_epochs)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return cfg, placement(cfg, args.nnodes, getattr(args, "nproc_per_node", None))


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line; key=value overrides are taken anywhere, also after an option (`megarl eval CONFIG
    --checkpoint DIR eval.samples=8`), in the order given. argparse alone gives a positional list only the words
    before the first option."""
    args, extra = parser.parse_known_args(argv)
    overrides = [word for word in extra if "=" in word and not word.startswith("-")]
    if len(overrides) != len(extra) or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_command_line(parser, argv)
    try:
        sys.exit(args.func(args))
    except KeyboardInterrupt:  # Ctrl-C before the run started (checks, model build): nothing to stop yet
        print("megarl: interrupted before the run started", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)


if __name__ == "__main__":
    main()
