"""The GPU check: what a session lent one H200 (no network, Python 3.12, torch 2.11 cu130) runs, once.

    bash benchmarks/gpu_check.sh [--wheels DIR]        # on the GPU machine (installs the wheels, then this)
    bash benchmarks/gpu_check.sh --dry-run [--no-download]   # here, on CPU: everything that can be checked
    python benchmarks/gpu_check.py --print-wheels      # the wheel list and the pip download command

Checks, each in its own process with its own timeout; one that fails (or times out) is recorded in the
JSON with the tail of its log, and the rest still run (the dry run forks every check but env from a process that
imported what they share, and the two-rank checks fork their ranks from it, where a GPU run uses torchrun):

  env               torch / CUDA / GPU, and that every module megarl needs there imports
  learner_step      bf16 megatron learner step on CUDA (megarl.learner.megatron, 1 rank; dist backend
                    nccl; if that fails, again with "cpu:gloo,cuda:nccl", then gloo) on a Qwen2.5-0.5B-shaped model with random
                    weights: step time, trained tokens/s, peak GPU memory
  engine_vs_hf      the built-in engine (megarl.sampler.engine) vs HF `generate` on the same bf16 model,
                    prompts and batch: generated tokens/s
  logprob_parity    the engine's recorded behaviour log-probs vs the learner's log-probs of the same
                    tokens (both bf16), and vs an fp32 HF forward: max / mean |difference|
  moe_replay        mixture of experts: the built-in engine (bf16, recording routes) vs the megatron learner on
                    a random Mixtral-style model (8 experts, top-2): router agreement, tokens routed differently
                    and the lag-0 log-prob gap with algo.routing_replay off and r3 (docs/moe.md)
  lora              learner.lora (rank 32, every projection) on the megatron learner: trainable parameters, step
                    time, peak memory (vs learner_step's full fine-tuning); adapter-only publish bytes; the engine's
                    merge-and-stage time; lag-0 gap of the engine's log-probs under the adapter vs the learner's;
                    sampler.engine=sglang's merged publish on the learner: bytes, kept base, gather and merge time
  lora_families     learner.lora on Phi-3 (fused qkv_proj / gate_up_proj), gpt-oss (attention) and DeepSeek-V3
                    (multi-latent attention) at the families check's shapes: adapted modules, adapter bytes, step
                    time, the engine's merge-and-stage time and the lag-0 gap of its log-probs under the adapter
  distill           on-policy distillation: learner_step's bf16 step with a frozen HF teacher (the same
                    random weights) on the learner rank: teacher seconds per step against the step, peak
                    GPU memory, and the step-0 teacher KL (megatron vs transformers bf16 on one model)
  e2e_train         `megarl train configs/demo.yaml` for a few steps, learner and sampler on the same GPU.
                    dist.backend=gloo: NCCL refuses two ranks on one GPU, so the publish group (and the
                    1-rank learner group) use gloo, which moves CUDA tensors through host memory
  publish_bandwidth the weight publish path on the device: 2 processes on the GPU (publisher, receiver),
                    `WeightPublisher` -> `WeightReceiver` with CUDA tensors over the gloo publish group a
                    one-GPU run uses, vs one raw broadcast of the same bytes, vs a device-to-device copy
  stale_mask        e2e_train with algo.stale=mask_tokens (groups sent as they finish, max_lag 1): no group dropped
                    as stale, the share of tokens given no policy gradient instead (megarl/rollout/batch.py)
  eval_overlap      e2e_train with a held-out evaluation every 5 steps, then without: each evaluation's seconds and
                    the versions the training engine applied while it ran, the learner's first-to-last-step time
                    and median queue wait in both (docs/eval.md "Cost": evaluation steps between training steps)
  generic_path      the built-in engine's generic model (megarl/sampler/hf_model.py: transformers' own modules
                    and a per-slot KV cache, docs/models.md#the-generic-path) on a Granite of learner_step's
                    shape (a type megarl has no family for; bf16): generated tokens/s against the native engine
                    on the Qwen2 model of engine_vs_hf, and its behaviour log-probs against an fp32 HF forward
  gpt_oss_engine    gpt-oss on the built-in engine's native forward (sinks, sliding and full layers, fused biased
                    experts; docs/models.md) at the families check's gpt-oss shape, bf16: decode tokens/s of a batch
                    against the generic model (sampler.model_impl=hf) on the same weights, the behaviour log-probs
                    against an fp32 HF forward, and the share of recorded routes that are fp32 HF's top-k
  hybrid            the generic engine on hybrid models (docs/models.md, "Hybrid linear-attention models"): a
                    Qwen3.5-like text model (gated DeltaNet, 3 of 4 layers) and a Nemotron-H-like one (Mamba-2, MLP
                    and MoE blocks, attention on every 6th; bf16, random weights): per model decode tokens/s of a
                    batch, the lag-0 gap of its behaviour log-probs against the DeepSpeed learner's forward
                    (transformers bf16, unpacked rows) and an fp32 HF forward, and the fp32 gap of a prefill in
                    chunks of 8 positions
  gated_delta_net   megatron-core's own GatedDeltaNet as megarl builds it (megarl/learner/gated_delta_net.py) against
                    transformers' Qwen3.5 layer with the same weights, one layer of hybrid's shape at the learner's
                    dtype (FLA's kernels where installed, else megatron's torch path: `impl`): relative output gap,
                    forward + backward time of each
  hybrid_learner    the megatron learner on hybrid's Qwen3.5-like model (megarl/learner/hybrid.py: megatron-core's
                    GatedDeltaNet beside gated full attention, unpacked rows; bf16): the engine's behaviour log-probs
                    (generic model), the learner's and an fp32 HF forward's of the same tokens (logprob_parity), and
                    the median time of a learner step on learner_step's rows
  critic_step       the learner step of learner_step with the critic of algo.advantage.estimator=gae
                    (megarl.learner.critic: a replicated fp32 value model, V-trace targets): step time and the
                    critic's metrics, against learner_step's time
  context_parallel  learner.cp=2 (megarl.learner.context_parallel) over 2 processes on the one GPU (gloo: NCCL refuses
                    two ranks on one GPU) against cp=1 on learner_step's model and one row of cp_len tokens: step time
                    and peak GPU memory per rank of each, and the largest |log-prob difference| (both bf16); the
                    same for that model with a LoRA adapter (learner.lora.rank=lora_rank: the log-probs after the
                    steps too) and for moe_replay's Mixtral under r3 (random recorded routes, split like the tokens);
                    the dense model's loss curve over 20 steps on its row at both sizes (loss_curve_max_abs_diff)
  trackers          observe.trackers: what MetricsSink.log costs the learner's step (60 scalars a step) with each
                    tracker installed there (tensorboard; wandb offline and mlflow's file store when importable):
                    the median and worst call, and the time to close (what is queued written); the dry run
                    leaves wandb out (its service takes ~10 s to start)
  sampler_replace   e2e_train under fault.on_failure=replace with two built-in samplers: one SIGKILLed after 5
                    steps, the run trains on, its replacement joins (the version it joined at) and trains 5 more
                    steps; every step once, the longest step gap after the kill, samplers/* metrics
  sglang_replace    the same with sampler.engine=sglang (megarl's SGLang-compatible server): sampler 0's server
                    SIGKILLed; its sampler and server are replaced and join a new weight-update group
  pp_replace        the same with learner.pp=2 (two publish sources on the one device): sampler 0 (rank 2)
                    SIGKILLed; both stages' parts reach the replacement over the next epoch's groups
  sync_replace      the same with algo.mode=sync: while sampler 0 is replaced the survivor generates the share
                    of each version's batch it owed, so the steps go on
  tp_replace        the same with two built-in engines of two ranks each (sampler.tp=2, learner.tp=1; five
                    processes on the one device, the engines' TP groups over gloo): engine 0's follower rank (rank 2)
                    SIGKILLed; the engine is replaced whole, its TP group formed afresh, and rejoins
  samplers_add_remove  the demo under fault.on_failure=replace with two built-in samplers: after 5 steps `megarl
                    samplers add` from a second process (its join version, steps until samplers/alive is 3), then
                    `megarl samplers remove` of it (samplers/alive back at 2, 3 steps more, the command's exit 0)
  sglang_add_remove  the same with sampler.engine=sglang (megarl's SGLang-compatible server): the added sampler's
                    server joins the next epoch's weight-update group
  agent_stream      stream=true on the agent endpoint (docs/multiturn.md#openai-compatibility): one streamed turn
                    through the real `openai` client on the built-in engine beside a batch of other requests: when
                    its first token chunk arrived against the whole turn, how many chunks carried tokens, and that
                    they add up to the completion's tokens and log-probs

`--dry-run` (CPU): the wheel list's structure, its declared total against the 64 MiB limit (with the
working tree that travels with it), each wheel's requirements against what the GPU machine has; unless
`--no-download`, `pip download` of the list, checking the real sizes and requirements; the plan; then
every check's code on CPU with a tiny model for a few seconds (the e2e check as `megarl train --dry-run`).

The last line printed is one JSON object: {"gpu_check": {"mode", "checks": {name: {"ok", "seconds", ...}},
"ok": all passed, "seconds"}}; with $OUT set (the device tool) it is also written to $OUT/gpu_check.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULT = "GPU_CHECK_RESULT "
LIMIT_BYTES = 64 * 2**20  # what one device call carries: working tree + wheels
BUDGET_S = 450  # the checks' share of the 8 minutes on the GPU; a check that would start later is skipped

# What megarl needs that the GPU machine lacks (its packages: /work/.library/device/KINDS.md), as
# (name, version, wheel file, bytes): the sizes were measured with download_command() (2026-12-01).
# omegaconf 2.4 vendors antlr4 (no antlr4-python3-runtime); megatron-core needs torch, numpy, packaging
# and pyzmq nothing on CPython: all present there. megatron-core 0.16.1 is the version CI runs on 3.11.
WHEELS = [
    ("megatron-core", "0.16.1", "megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", 2612103),
    ("omegaconf", "2.4.0", "omegaconf-2.4.0-py3-none-any.whl", 254152),
    ("pyzmq", "27.3.0", "pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl", 855178),
]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
# Present on the GPU machine (KINDS.md, read 2026-11-17): what the wheels' requirements may name.
GPU_PRESENT = {"torch", "numpy", "packaging", "pyyaml", "transformers", "tokenizers", "safetensors", "tensorboard",
               "matplotlib", "triton", "pytest", "psutil", "pyarrow", "typing-extensions"}


def exit_child(main) -> None:
    """Run `main` in a forked child and end the child with its exit status, as its own interpreter would give it
    (sys.exit(None) is 0; an exception prints its traceback and is 1), never returning into the parent's code."""
    import traceback

    code = 1
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def download_command(dest: str) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + ["-d", dest] + [f"{name}=={version}" for name, version, _, _ in WHEELS]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ------------------------------------------------------------------------------------------ shapes
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                  tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, rope_theta=1000000.0,
            rms_norm_eps=1e-6)  # the same rope and norm settings as the full shape
# The MoE check's Mixtral-style models (8 experts, top-2 on the GPU; 4 experts on CPU).
MOE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=16,
           num_key_value_heads=4, max_position_embeddings=4096, num_local_experts=8, num_experts_per_tok=2,
           tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6)
TINY_MOE = dict(MOE, vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, num_local_experts=4)


class Size:
    """The work each check does: full on the GPU, a few seconds' worth on CPU (--dry-run)."""

    def __init__(self, tiny: bool):
        self.tiny = tiny
        self.model = TINY if tiny else QWEN25_05B
        self.train_rows, self.train_len, self.micro_batch, self.train_steps = (8, 32, 4, 1) if tiny else (32, 512, 8, 3)
        self.gen_batches, self.gen_tokens, self.gen_reps = ([4], 8, 1) if tiny else ([32, 128], 128, 2)
        self.parity_rows, self.parity_tokens = (4, 8) if tiny else (16, 64)
        self.e2e_steps = 1 if tiny else 20
        self.publish_reps = 1 if tiny else 2
        self.moe_model = TINY_MOE if tiny else MOE
        self.moe_rows, self.moe_tokens = (4, 8) if tiny else (32, 96)
        self.lora_rank = 4 if tiny else 32
        self.cp_len = 64 if tiny else 8192
        self.cp_curve_steps = 3 if tiny else 20  # check_context_parallel's loss curve (the dense model's steps)
        # check_long_prefill: the long prompt and its chunk; the chunked-vs-one-pass comparison's length and chunk.
        self.long_len, self.prefill_chunk = (128, 32) if tiny else (32768, 2048)
        self.long_eq_len, self.long_eq_chunk = (64, 16) if tiny else (4096, 1024)


def device_of(args) -> "torch.device":
    import torch

    return torch.device("cuda" if args.device == "cuda" else "cpu")


def build_model(path: Path, size: Size, device: str, config: dict | None = None) -> Path:
    """An HF Qwen2 directory with random weights (bf16 on the GPU, fp32 on CPU), built on `device`; `config` in place
    of size.model."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**(config or size.model)))
    if device == "cuda":
        model = model.to(torch.bfloat16)
    partial = path.with_name(path.name + f".partial{os.getpid()}")
    model.save_pretrained(partial)  # then renamed: a check killed mid-save leaves no half model behind
    partial.rename(path)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return path


def init_single_rank(backend: str, workdir: Path) -> None:
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    store = dist.FileStore(str(workdir / f"store-{os.getpid()}"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


def make_learner(model_dir: Path, size: Size, critic: bool = False, pack: bool = True, share: bool = True,
                 loss_cfg=None):
    from megarl.algo.config import CriticConfig, LossConfig
    from megarl.config.schema import LearnerConfig
    from megarl.learner.megatron import MegatronLearner

    return MegatronLearner(str(model_dir), LearnerConfig(micro_batch_size=size.micro_batch, lr=1e-6,
                                                         pack_sequences=pack, share_prefixes=share),
                           loss_cfg or LossConfig(), critic_cfg=CriticConfig(target="vtrace", lr=1e-5) if critic else None)


def make_deepspeed_learner(model_dir: Path, size: Size):
    """The DeepSpeed learner (ZeRO 1) on the check's one rank: transformers' own forward of the model."""
    from megarl.algo.config import LossConfig
    from megarl.config.schema import DeepSpeedConfig, LearnerConfig
    from megarl.learner.deepspeed import DeepSpeedLearner

    os.environ.setdefault("LOCAL_RANK", "0")  # (what DeepSpeed asks a launcher for)
    return DeepSpeedLearner(str(model_dir), LearnerConfig(backend="deepspeed", deepspeed=DeepSpeedConfig(zero_stage=1),
                                                          micro_batch_size=size.micro_batch, lr=1e-6), LossConfig())


def make_engine(model_dir: Path, device, max_running: int, max_seq_len: int, **engine_kw):
    from megarl.models.convert import load_pretrained
    from megarl.sampler.engine import BuiltinEngine

    cfg, weights = load_pretrained(str(model_dir))
    return BuiltinEngine(cfg, weights, max_running=max_running, max_seq_len=max_seq_len, device=device, **engine_kw)


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_generation(engine, requests) -> tuple[list, int]:
    """The engine's completions of `requests` (after a warm-up on two of them) and their generated tokens/s."""
    engine.generate(requests[:2])
    sync()
    start = time.perf_counter()
    completions = engine.generate(requests)
    sync()
    return completions, round(sum(len(c.token_ids) for c in completions) / (time.perf_counter() - start))


def median(values) -> float:
    """The middle value (the upper one of an even count), nan for none: the timed steps' median in every check."""
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def peak_gib() -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


# ------------------------------------------------------------------------------------------ checks (children)
# What env imports: every module megarl needs on the GPU machine.
ENV_MODULES = ("megatron.core", "omegaconf", "zmq", "transformers", "safetensors", "tokenizers", "tensorboard",
               "numpy", "megarl.learner.megatron", "megarl.sampler.engine", "megarl.roles.worker",
               "megarl.distributed.publish", "megarl.cli")


def check_env(args, size: Size) -> dict:
    import importlib

    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    versions = {}
    for module in ENV_MODULES:
        mod = importlib.import_module(module)
        versions[module] = getattr(mod, "__version__", "ok")
    out["imports"] = versions
    return out


def check_trackers(args, size: Size) -> dict:
    import importlib.util

    from megarl.config.load import load_config
    from megarl.observe.sinks import MetricsSink
    from megarl.observe.trackers import PACKAGES, open_trackers

    steps = 20 if size.tiny else 500
    out = {}
    for name in ("tensorboard", "wandb", "mlflow"):
        if size.tiny and name == "wandb":  # its service process takes ~10 s to start: not in the CPU dry run
            continue
        if importlib.util.find_spec(PACKAGES[name]) is None:
            out[name] = "not installed"
            continue
        run_dir = Path(tempfile.mkdtemp(prefix=f"megarl-trackers-{name}-"))
        cfg = load_config(None, [f"run.dir={run_dir}", f"observe.trackers=[{name}]", "observe.wandb_mode=offline"],
                          check_files=False)
        sink = MetricsSink(run_dir, open_trackers(cfg))
        calls = []
        for step in range(steps):
            metrics = {f"metric/{k}": float(step + k) for k in range(60)}
            start = time.perf_counter()
            sink.log(step, metrics)
            calls.append(time.perf_counter() - start)
        start = time.perf_counter()
        sink.close()
        out[name] = {"steps": steps, "log_median_ms": round(median(calls) * 1e3, 3),
                     "log_max_ms": round(max(calls) * 1e3, 3), "close_s": round(time.perf_counter() - start, 2)}
    return out


def check_learner_step(args, size: Size, critic: bool = False) -> dict:
    import torch.distributed as dist

    workdir = Path(args.workdir)
    init_single_rank(args.backend, workdir)
    model_dir = build_model(workdir / "model", size, args.device)
    t0 = time.perf_counter()
    learner = make_learner(model_dir, size, critic)
    build_s = time.perf_counter() - t0
    times, steps = timed_steps(learner, size, critic)
    metrics = steps[-1]
    step_s = median(times)
    rows, length = size.train_rows, size.train_len
    params = sum(p.numel() for p in learner.gpt.parameters())
    return {"backend": args.backend, "params": params, "dtype": str(next(learner.gpt.parameters()).dtype),
            "build_s": round(build_s, 2), "step_s": [round(t, 4) for t in times], "median_step_s": round(step_s, 4),
            "tokens_per_step": rows * length, "train_tok_s": round(rows * length / step_s),
            "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"),
            "skipped_nonfinite": metrics.get("skipped_nonfinite"), "version": learner.version,
            "peak_gpu_gib": peak_gib(), "world": dist.get_world_size(),
            **{k: v for k, v in metrics.items() if k.startswith("critic/")}}


def check_critic_step(args, size: Size) -> dict:
    """learner_step with the critic (advantage.estimator=gae, V-trace targets): its cost on the device."""
    return check_learner_step(args, size, critic=True)


def check_entropy_metric(args, size: Size) -> dict:
    """algo.loss.entropy_metric's cost on the device (on by default): learner_step's step without
    and with the policy's entropy reported (no gradient, in slices of positions, over the 0.5B shape's 151,936-token
    vocabulary): median step times, their ratio, the peak GPU memory of each, the reported entropy (random
    weights: near log(vocab) = 11.9 nats)."""
    import gc

    import torch

    from megarl.algo.config import LossConfig

    workdir = Path(args.workdir)
    init_single_rank(args.backend, workdir)
    model_dir = build_model(workdir / "model", size, args.device)
    out: dict = {}
    for name, on in (("off", False), ("on", True)):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        learner = make_learner(model_dir, size, loss_cfg=LossConfig(entropy_metric=on))
        times, steps = timed_steps(learner, size)
        out[f"median_step_s_{name}"] = round(median(times), 4)
        out[f"peak_gpu_gib_{name}"] = peak_gib()
        if on:
            out["entropy_mean"] = steps[-1].get("entropy/mean")
        del learner, steps
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out["on_over_off"] = round(out["median_step_s_on"] / out["median_step_s_off"], 3)
    return out


def timed_steps(learner, size: Size, critic: bool = False) -> tuple[list[float], list[dict]]:
    """size.train_steps timed learner steps after one warm-up, on a random batch: their times, and the metrics of
    every step (the warm-up's first). `critic`: the batch carries terminal rewards for the critic's targets."""
    import torch

    from megarl.algo.values import terminal_rewards
    from megarl.protocols import TrainBatch

    g = torch.Generator().manual_seed(0)
    rows, length, vocab = size.train_rows, size.train_len, size.model["vocab_size"]
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    mask = torch.zeros(rows, length)
    mask[:, length // 4:] = 1.0
    behaviour = (learner.logprobs(ids) + 0.05 * torch.randn(rows, length, generator=g)) * mask
    advantages = torch.randn(rows, 1, generator=g).expand(rows, length) * mask
    rewards = terminal_rewards((ids[:, length // 4] % 2).float(), mask) if critic else None
    times, steps = [], []
    for i in range(size.train_steps + 1):  # the first is a warm-up
        batch = TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=behaviour,
                           versions=torch.where(mask > 0, learner.version, -1), advantages=advantages,
                           learner_version=learner.version, rewards=rewards)
        sync()
        start = time.perf_counter()
        steps.append(learner.train_step(batch))
        sync()
        if i:
            times.append(time.perf_counter() - start)
    return times, steps


def check_packing(args, size: Size) -> dict:
    """learner.pack_sequences and learner.share_prefixes on the device: the same long-tailed batch (a few long rows,
    many short: an RL batch's lengths; groups of 8 rows with one prompt, each row following its group's first for a
    random stretch of its completion) stepped by an unpacked, a packed and a prefix-sharing learner, one after the
    other; step time, padding, shared share, peak memory and lag-0 gap of each (docs/learner.md, "Sequence packing":
    the dense [R, 1, W, W] mask is what may cost on a GPU)."""
    import random

    import torch

    from megarl.protocols import TrainBatch

    workdir = Path(args.workdir)
    init_single_rank(args.backend, workdir)
    model_dir = build_model(workdir / "model", size, args.device)
    rows, length, vocab = size.train_rows, size.train_len, size.model["vocab_size"]
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    prompt = length // 8
    ends = [min(length, prompt + 1 + int(rng.expovariate(4 / length))) for _ in range(rows)]
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    for r in range(rows):  # a group's rows: its first row's prompt, and its first completion tokens for a while
        lead = r - r % 8
        if r != lead:
            follow = prompt + rng.randint(0, length - prompt)
            ids[r, :follow] = ids[lead, :follow]
    mask = torch.zeros(rows, length)
    for r, end in enumerate(ends):
        mask[r, prompt:end] = 1.0
    advantages = torch.randn(rows, 1, generator=g).expand(rows, length) * mask
    out = {"rows": rows, "max_len": length, "real_tokens": int(sum(ends))}
    for name, pack, share in (("packed", True, False), ("unpacked", False, False), ("shared", True, True)):
        learner = make_learner(model_dir, size, pack=pack, share=share)
        behaviour = learner.logprobs(ids) * mask
        times = []
        for i in range(size.train_steps + 1):  # the first is a warm-up
            batch = TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=behaviour,
                               versions=torch.where(mask > 0, learner.version, -1), advantages=advantages,
                               learner_version=learner.version)
            sync()
            start = time.perf_counter()
            metrics = learner.train_step(batch)
            sync()
            if i:
                times.append(time.perf_counter() - start)
        out[name] = {"median_step_s": round(median(times), 4), "padding_frac":
                     round(metrics["padding_frac"], 3), "shared_frac": round(metrics["shared_frac"], 3),
                     "lag0_gap": metrics.get("lag0/logprob_gap_abs"), "peak_gpu_gib": peak_gib()}
        del learner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    out["speedup"] = round(out["unpacked"]["median_step_s"] / out["packed"]["median_step_s"], 3)
    out["shared_speedup"] = round(out["unpacked"]["median_step_s"] / out["shared"]["median_step_s"], 3)
    return out


def check_attention(args, size: Size) -> dict:
    """The megatron learner's core attention (docs/learner.md, "Attention through SDPA"): its SDPA forward +
    backward against megatron-core's own unfused DotProductAttention on the same layer, q/k/v and mask (causal and
    the packed rows' block-diagonal one) at the learner's dtype: median time and peak memory of each, and the
    largest difference of outputs and gradients."""
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megarl.learner import packing

    workdir = Path(args.workdir)
    init_single_rank(args.backend, workdir)
    learner = make_learner(build_model(workdir / "model", size, args.device), size)
    core = next(m for m in learner.gpt.modules() if isinstance(m, DotProductAttention))
    rows, width, dtype = size.train_rows, size.train_len, next(learner.gpt.parameters()).dtype
    device = next(learner.gpt.parameters()).device
    g = torch.Generator().manual_seed(0)
    heads = (core.num_attention_heads_per_partition, core.num_query_groups_per_partition,
             core.num_query_groups_per_partition)
    qkv = [torch.randn(width, rows, h, core.hidden_size_per_attention_head, generator=g).to(device, dtype)
           for h in heads]
    grad_out = torch.randn(width, rows, core.hidden_size_per_partition, generator=g).to(device, dtype)
    quarter = width // 4  # 4 rows per packed row
    four = {"input_ids": torch.randint(0, 8, (4 * rows, quarter), generator=g), "mask": torch.zeros(4 * rows, quarter)}
    packed = packing.pack(four, torch.full((4 * rows,), quarter), bins=[[4 * r + j for j in range(4)] for r in range(rows)])
    masks = {"causal": torch.ones(width, width, dtype=torch.bool, device=device).triu(1).view(1, 1, width, width),
             "packed": packing.attention_mask(packed, width).to(device)}
    out = {"rows": rows, "width": width, "dtype": str(dtype).removeprefix("torch.")}
    for mask_name, mask in masks.items():
        results = {}
        for name, forward in (("sdpa", core.forward), ("megatron", lambda *a: DotProductAttention.forward(core, *a))):
            times = []
            for i in range(size.train_steps + 3):
                inputs = [t.detach().requires_grad_() for t in qkv]
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                sync()
                start = time.perf_counter()
                context = forward(*inputs, mask)
                context.backward(grad_out)
                sync()
                times.append(time.perf_counter() - start)
            results[name] = (context.detach().float(), [t.grad.float() for t in inputs])
            out[f"{mask_name}_{name}"] = {"median_fwd_bwd_s": round(median(times[1:]), 5),
                                          "peak_gpu_gib": peak_gib()}
        (sdpa_out, sdpa_grads), (ref_out, ref_grads) = results["sdpa"], results["megatron"]
        out[f"{mask_name}_max_abs_diff"] = max([(sdpa_out - ref_out).abs().max().item()] +
                                               [(a - b).abs().max().item() for a, b in zip(sdpa_grads, ref_grads)])
        out[f"{mask_name}_speedup"] = round(out[f"{mask_name}_megatron"]["median_fwd_bwd_s"] /
                                            out[f"{mask_name}_sdpa"]["median_fwd_bwd_s"], 3)
    return out


def check_distill(args, size: Size) -> dict:
    """On-policy distillation's cost on the learner (docs/algorithms.md#on-policy-distillation): learner_step's
    bf16 megatron step with a frozen HF teacher on the same rank. The teacher is the student's own random
    weights, so the first step's teacher KL is the bf16 mismatch of megatron and transformers on one model
    (near 0: a misaligned teacher shows as a KL of nats)."""
    from megarl.algo.config import DistillConfig, LossConfig
    from megarl.config.schema import LearnerConfig
    from megarl.learner.megatron import MegatronLearner

    workdir = Path(args.workdir)
    init_single_rank(args.backend, workdir)
    model_dir = build_model(workdir / "model", size, args.device)
    learner = MegatronLearner(str(model_dir), LearnerConfig(micro_batch_size=size.micro_batch, lr=1e-6), LossConfig(),
                              distill=DistillConfig(teacher=str(model_dir)))
    times, steps = timed_steps(learner, size)  # the warm-up step trains version 0: the teacher's own weights
    step_s = median(times)
    teacher_s = median(m["distill/teacher_s"] for m in steps[1:])
    kl0 = steps[0]["distill/teacher_kl"]
    out = {"backend": args.backend, "median_step_s": round(step_s, 4), "median_teacher_s": round(teacher_s, 4),
           "teacher_share_of_step": round(teacher_s / step_s, 3), "teacher_kl_step0": kl0,
           "teacher_kl_last": steps[-1]["distill/teacher_kl"], "tokens_per_step": size.train_rows * size.train_len,
           "peak_gpu_gib": peak_gib()}
    if not abs(kl0) < 0.05:
        raise RuntimeError(f"the teacher is the student's own weights, yet their KL at step 0 is {kl0}: {out}")
    return out


def random_prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in torch.randint(4, 33, (batch,), generator=gen)]


def check_engine_vs_hf(args, size: Size) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.protocols import GenerationRequest, SamplingParams

    device = device_of(args)
    model_dir = build_model(Path(args.workdir) / "model", size, args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    hf.generation_config.eos_token_id = None  # every row generates exactly gen_tokens
    rows = {}
    new = size.gen_tokens
    for batch in size.gen_batches:
        prompts = random_prompts(batch, size.model["vocab_size"])
        engine = make_engine(model_dir, device, max_running=batch, max_seq_len=max(map(len, prompts)) + new)
        sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new)
        width = max(map(len, prompts))
        ids = torch.zeros((batch, width), dtype=torch.long)
        attn = torch.zeros_like(ids)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            attn[r, width - len(p):] = 1
        ids, attn = ids.to(device), attn.to(device)

        def run_engine() -> int:
            done = engine.generate([GenerationRequest(str(i), p, sampling) for i, p in enumerate(prompts)])
            return sum(len(c.token_ids) for c in done)

        def run_hf() -> int:
            with torch.inference_mode():
                out = hf.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_p=1.0,
                                  top_k=0, max_new_tokens=new, pad_token_id=0)
            return (out.shape[1] - width) * batch

        result = {}
        for name, fn in (("engine", run_engine), ("hf", run_hf)):
            fn()  # warm-up
            best = float("inf")
            for _ in range(size.gen_reps):
                sync()
                start = time.perf_counter()
                tokens = fn()
                sync()
                best = min(best, time.perf_counter() - start)
            result[f"{name}_tok_s"] = round(tokens / best)
        result["engine_over_hf"] = round(result["engine_tok_s"] / result["hf_tok_s"], 2)
        rows[f"batch{batch}"] = result
        engine.close()
        del engine
    return {"new_tokens": new, "dtype": str(dtype), **rows, "peak_gpu_gib": peak_gib()}


def check_agent_stream(args, size: Size) -> dict:
    """One streamed agent turn (megarl/rollout/agent.py) of size.gen_tokens tokens, read with the real `openai` client,
    on the built-in engine beside size.gen_batches[0] - 1 other requests, the check stepping the engine as the
    sampler loop does: seconds to its first chunk with tokens and to its end, and the chunks that carried tokens. The
    model is learner_step's shape with the embedded chat tokenizer's vocabulary (the endpoint decodes every token)."""
    import openai

    from megarl.embedded.tiny_chat import build_chat_tokenizer
    from megarl.protocols import GenerationRequest, Prompt, SamplingParams
    from megarl.rollout.agent import AgentRunner
    from megarl.rollout.episode import EpisodeLimits

    tok = build_chat_tokenizer()
    model_dir = build_model(Path(args.workdir) / "model-chat", size, args.device, dict(size.model, vocab_size=len(tok)))
    max_seq_len = 64 + size.gen_tokens
    engine = make_engine(model_dir, device_of(args), max_running=size.gen_batches[0], max_seq_len=max_seq_len)
    sampling = SamplingParams(1.0, 1.0, 0, size.gen_tokens)
    seen: dict = {"chunks": []}

    def agent(base_url, prompt, answer, meta):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        start = time.perf_counter()
        for c in client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                                logprobs=True, stream=True):
            if c.choices and c.choices[0].logprobs:
                seen.setdefault("first_s", time.perf_counter() - start)
                seen["chunks"].append([t.logprob for t in c.choices[0].logprobs.content])
        seen["turn_s"] = time.perf_counter() - start
        return 0.0

    sys.modules[__name__].stream_agent = agent  # task.agent names a module attribute
    runner = AgentRunner(f"{__name__}:stream_agent", tok, engine.add_request, sampling,
                         EpisodeLimits(1, 0, max_seq_len, 1, 10.0), (), workers=1, timeout_s=120.0, model_name="m",
                         progress=engine.progress)
    for i in range(size.gen_batches[0] - 1):
        engine.add_request(GenerationRequest(f"other/{i}", random_prompts(1, len(tok), seed=i)[0], sampling))
    runner.start("s0-g0/0", Prompt("37*43", "1591"))
    ended, completion, deadline = [], None, time.monotonic() + 120
    while not ended:
        if time.monotonic() > deadline:
            raise RuntimeError("the streamed episode did not end within 120 s")
        for done in engine.step():
            if not done.request_id.startswith("other/"):
                completion = done
                runner.on_completion(done)
        ended += runner.poll()
        if engine.num_unfinished == 0:
            runner.ready.wait(0.01)
    runner.close()
    [episode] = ended
    streamed = [lp for chunk in seen["chunks"] for lp in chunk]
    out = {"stream_tokens": len(completion.token_ids), "chunks_with_tokens": len(seen["chunks"]),
           "first_chunk_s": round(seen["first_s"], 3), "turn_s": round(seen["turn_s"], 3),
           "first_chunk_frac": round(seen["first_s"] / seen["turn_s"], 3), "batch": size.gen_batches[0]}
    if streamed != completion.logprobs or episode.token_ids != completion.token_ids or len(seen["chunks"]) < 2:
        raise RuntimeError(f"the stream is not the turn's tokens as sampled, token by token: {out}; {episode.error}")
    return out


def check_long_prefill(args, size: Size) -> dict:
    """The built-in engine at a long prompt (docs/sampler.md#long-contexts): one request of size.long_len tokens
    prefilled in chunks of size.prefill_chunk positions (time, peak memory), and at size.long_eq_len the chunked
    prefill's first greedy tokens and log-probs against a one-pass prefill's."""
    import torch

    from megarl.models.convert import load_pretrained
    from megarl.protocols import GenerationRequest, SamplingParams
    from megarl.sampler.engine import BuiltinEngine

    device = device_of(args)
    cfg, weights = load_pretrained(str(build_model(Path(args.workdir) / "model", size, args.device)))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=4)

    def run(length: int, chunk: int):
        prompt = random_prompts(1, size.model["vocab_size"], seed=length)[0]
        prompt = (prompt * (length // len(prompt) + 1))[:length]
        engine = BuiltinEngine(cfg, weights, max_running=1, max_seq_len=length + 8, prefill_chunk=chunk, device=device)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        done = engine.generate([GenerationRequest("long", prompt, sampling)])[0]
        sync()
        seconds = time.perf_counter() - start
        engine.close()
        return done, seconds

    long_done, long_s = run(size.long_len, size.prefill_chunk)
    peak = peak_gib()
    chunked, _ = run(size.long_eq_len, size.long_eq_chunk)
    one_pass, _ = run(size.long_eq_len, size.long_eq_len)
    same = next((i for i, (a, b) in enumerate(zip(chunked.token_ids, one_pass.token_ids)) if a != b),
                len(chunked.token_ids))
    # Log-probs of the tokens both sampled from equal prefixes (the first one differing included).
    gap = max(abs(a - b) for a, b in zip(chunked.logprobs[:same + 1], one_pass.logprobs[:same + 1]))
    out = {"long_len": size.long_len, "prefill_chunk": size.prefill_chunk, "long_generate_s": round(long_s, 2),
           "long_tokens": len(long_done.token_ids), "peak_gpu_gib": peak, "eq_len": size.long_eq_len,
           "eq_chunk": size.long_eq_chunk, "max_logprob_gap": gap}
    # bf16 on the GPU: the chunks' matmuls sum in another order, so greedy ties may break apart; the gap is the
    # measurement, a different first token (computed from the same prefix) is the failure.
    if chunked.token_ids[0] != one_pass.token_ids[0] or not math.isfinite(gap):
        raise RuntimeError(f"chunked and one-pass prefill disagree: {out}; {chunked.token_ids} vs {one_pass.token_ids}")
    return out


def check_long_paged(args, size: Size) -> dict:
    """The built-in engine's paged KV layout (sampler.kv_layout=paged; docs/sampler.md#long-contexts): one request
    of size.long_len prompt tokens among seven short ones in 8 slots, its block pool sized for that mix (the
    contiguous layout holds 8 x max_seq_len positions), and the same mix on the contiguous layout beside it: each
    one's cache size, peak memory, prefill (the admitting step) and decode step time, and the greedy tokens of both
    (bf16 on the GPU: a tie may break apart late; a different first token is the failure)."""
    import torch

    from megarl.models.convert import load_pretrained
    from megarl.protocols import GenerationRequest, SamplingParams
    from megarl.sampler.engine import BuiltinEngine

    device = device_of(args)
    cfg, weights = load_pretrained(str(build_model(Path(args.workdir) / "model", size, args.device)))
    new, short_len, block = (4, 8, 16) if size.tiny else (64, 256, 32)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new)
    prompts = random_prompts(8, size.model["vocab_size"], seed=3)
    prompts = [(p * (n // len(p) + 1))[:n] for p, n in zip(prompts, [size.long_len] + [short_len] * 7)]
    requests = [GenerationRequest(f"r{i}", p, sampling) for i, p in enumerate(prompts)]
    blocks = sum(-(-(len(p) + new - 1) // block) for p in prompts)  # the mix's reservations
    out: dict = {"long_len": size.long_len, "block_size": block, "kv_blocks": blocks}
    done = {}
    for layout in ("paged", "contiguous"):
        engine = BuiltinEngine(cfg, weights, max_running=8, max_seq_len=size.long_len + new, device=device,
                               prefill_chunk=size.prefill_chunk, kv_layout=layout, kv_block_size=block, kv_blocks=blocks)
        cache_gib = (engine._cache.k.nbytes + engine._cache.v.nbytes) / 2**30
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        for r in requests:
            engine.add_request(r)
        sync()
        start = time.perf_counter()
        finished = engine.step()  # admits all eight (prefill) and decodes once
        sync()
        admitted = time.perf_counter()
        steps = 0
        while engine.num_unfinished:
            finished += engine.step()
            steps += 1
        sync()
        end = time.perf_counter()
        done[layout] = {c.request_id: c for c in finished}
        out[layout] = {"cache_gib": round(cache_gib, 3), "admit_s": round(admitted - start, 2),
                       "decode_ms_per_step": round(1e3 * (end - admitted) / max(steps, 1), 2),
                       "peak_gpu_gib": peak_gib()}
        engine.close()
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out["decode_paged_over_contiguous_time"] = round(out["paged"]["decode_ms_per_step"]
                                                     / max(out["contiguous"]["decode_ms_per_step"], 1e-9), 3)
    out["tokens_differ"] = [rid for rid, c in done["contiguous"].items() if c.token_ids != done["paged"][rid].token_ids]
    if any(c.token_ids[0] != done["paged"][rid].token_ids[0] or len(done["paged"][rid].token_ids) != new
           for rid, c in done["contiguous"].items()):
        raise RuntimeError(f"paged and contiguous layouts disagree on a first token: {out}")
    return out


def check_logprob_parity(args, size: Size) -> dict:
    init_single_rank(args.backend, Path(args.workdir))
    return logprob_parity(args, size, build_model(Path(args.workdir) / "model", size, args.device),
                          size.model["vocab_size"])


# The `families` check: per native family beyond Qwen2 (megarl.models.families; docs/models.md) a random-weight
# model of the family at a real shape (Qwen2.5-0.5B's dimensions, what sets the family apart switched on within
# reach of the check's rows: a window and a YaRN original context shorter than them) and logprob_parity's lag-0
# gaps (an MoE family's recorded routes against fp32 HF's routers too: route_agreement); one process for all (the
# imports and the process group are most of a dry run's time).
FAMILY_CHECKS = {
    "mistral": ("mistral", {"sliding_window": 32}),  # (the dry run: 4)
    "llama_yarn": ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                "original_max_position_embeddings": 32}}),  # (the dry run: 8)
    "phi3": ("phi3", {"pad_token_id": None, "eos_token_id": 2}),
    "smollm3": ("smollm3", {"pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2}),  # every 4th layer: no RoPE
    # norms after attention and the MLP, q/k norms over the whole projection
    "olmo2": ("olmo2", {"pad_token_id": None, "bos_token_id": None, "eos_token_id": 2}),
    # GLM-4.5 scaled to the shape: partial RoPE, q/k/v bias, a shared expert, 16 routed experts of a sigmoid router
    # with expert bias (top-4, scaled by 2.5), the first 3 layers dense (the dry run: 1); sampled on the built-in
    # engine's native forward (its routes against fp32 HF's)
    "glm4_moe": ("glm4_moe", {"pad_token_id": None, "bos_token_id": None, "eos_token_id": 2, "attention_bias": True,
                              "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 256,
                              "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1,
                              "first_k_dense_replace": 3, "num_nextn_predict_layers": 0,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                  "partial_rotary_factor": 0.5}}),
    # Gemma 3 text at Gemma-3-1B's layers (FAMILY_SHAPES): 5 local layers to 1 global, local RoPE base 1e4, global
    # 1e6 linearly scaled by 8 (as Gemma 3 4B's), a window within the rows (the dry run: 4, and 1 local to 1 global)
    "gemma3": ("gemma3_text", {"pad_token_id": None, "bos_token_id": 2, "eos_token_id": 1, "sliding_window": 32,
                               "rope_parameters": {
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                   "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}),
    # gpt-oss-20b scaled to the shape: attention sinks, sliding (window 128; the dry run: 4) and full layers
    # alternating, biases on every linear, 16 experts (top-4) a quarter of gpt-oss-20b's width (0.75B parameters in
    # all) with the clamped SwiGLU and a biased router, YaRN with truncate false (the dry run's original context: 8);
    # sampled by the engine's native forward (the `gpt_oss_engine` check: its speed and routes)
    "gpt_oss": ("gpt_oss", {"pad_token_id": None, "bos_token_id": None, "eos_token_id": 2, "head_dim": 64,
                            "num_local_experts": 16, "num_experts_per_tok": 4, "intermediate_size": 720,
                            "sliding_window": 128, "attention_bias": True,
                            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                "original_max_position_embeddings": 32}}),
    # DeepSeek-V3 scaled to the shape (its ratios to hidden 7168 and 128 heads): multi-latent attention with a q latent
    # of 192 and a kv latent of 128, per-head q/k of 64 + 32 RoPE dims and v of 64, interleaved YaRN (mscale on the
    # softmax scale), GLM-4.5's MoE with a group limit (4 groups, the best 2, top-4 of 16); sampled on the built-in
    # engine's native forward (a latent cache, the absorbed decode; its routes against fp32 HF's)
    "deepseek_v3": ("deepseek_v3", {"pad_token_id": None, "bos_token_id": None, "eos_token_id": 2,
                                    "num_key_value_heads": None, "q_lora_rank": 192, "kv_lora_rank": 128,
                                    "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
                                    "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                                    "moe_intermediate_size": 256, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
                                    "first_k_dense_replace": 3, "num_nextn_predict_layers": 0,
                                    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                        "original_max_position_embeddings": 32, "mscale": 1.0,
                                                        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}}),
}
# A family's own layer dimensions at the full size (the vocabulary stays the check's); the dry run keeps TINY's.
FAMILY_SHAPES = {"gemma3": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                                num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256)}
# Families whose DeepSpeed learner is checked too: its log-probs against HF's, and that it publishes the routers'
# expert bias (a buffer in transformers, which the engines' routers read).
DEEPSPEED_FAMILIES = {"deepseek_v3", "glm4_moe"}


def build_family_model(path: Path, name: str, size: Size, device: str) -> Path:
    """The HF directory of FAMILY_CHECKS[name] with random weights (bf16 on the GPU, fp32 on CPU)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (path / "config.json").exists():
        return path
    model_type, extra = FAMILY_CHECKS[name]
    shape = {k: v for k, v in size.model.items() if k != "rope_theta"}
    if not size.tiny:
        shape.update(FAMILY_SHAPES.get(name, {}))
    if "num_key_value_heads" in extra:  # (None: as many as the query heads, multi-latent attention's)
        shape, extra = {**shape, "num_key_value_heads": extra["num_key_value_heads"]}, {
            k: v for k, v in extra.items() if k != "num_key_value_heads"}
    if size.tiny:
        extra = {**extra, **({"sliding_window": 4} if "sliding_window" in extra else {}),
                 **({"sliding_window_pattern": 2, "head_dim": 16} if name == "gemma3" else {}),
                 **({"no_rope_layer_interval": 2} if name == "smollm3" else {}),  # (2 layers: the second)
                 **({"first_k_dense_replace": 1} if name in ("glm4_moe", "deepseek_v3") else {}),
                 **({"head_dim": 16, "intermediate_size": 32} if name == "gpt_oss" else {})}
        if "original_max_position_embeddings" in extra.get("rope_parameters", {}):
            extra["rope_parameters"] = {**extra["rope_parameters"], "original_max_position_embeddings": 8}
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**shape, **extra}))
    if device == "cuda":
        model = model.to(torch.bfloat16)
    partial = path.with_name(path.name + f".partial{os.getpid()}")
    model.save_pretrained(partial)
    partial.rename(path)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path


def check_families(args, size: Size) -> dict:
    init_single_rank(args.backend, Path(args.workdir))
    out = {}
    for name in FAMILY_CHECKS:
        model_dir = build_family_model(Path(args.workdir) / f"family_{name}", name, size, args.device)
        out[name] = logprob_parity(args, size, model_dir, size.model["vocab_size"],
                                   deepspeed=name in DEEPSPEED_FAMILIES)
        if name in DEEPSPEED_FAMILIES:  # (the sigmoid-routed families; DeepSeek-V3's latent cache in blocks)
            out[name]["paged_vs_contiguous"] = paged_agreement(args, size, model_dir, size.model["vocab_size"])
        shutil.rmtree(model_dir)  # (a 0.5B model's disk and page cache, not kept for the next family)
    return out


def paged_agreement(args, size: Size, model_dir: Path, vocab: int) -> dict:
    """The engine's greedy completions of the parity prompts on the paged KV layout (blocks of 16) against the
    contiguous one: how many agree token for token, the max |log-prob gap| over each pair's common prefix; a first
    token that differs (the same prefill operand, gathered from blocks) is the failure."""
    from megarl.protocols import GenerationRequest, SamplingParams

    prompts = random_prompts(size.parity_rows, vocab, seed=1)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=size.parity_tokens)
    runs = {}
    for layout in ("contiguous", "paged"):
        engine = make_engine(model_dir, device_of(args), max_running=len(prompts),
                             max_seq_len=max(map(len, prompts)) + size.parity_tokens, kv_layout=layout,
                             kv_block_size=16)
        runs[layout] = {c.request_id: c for c in engine.generate(
            [GenerationRequest(str(i), p, sampling) for i, p in enumerate(prompts)])}
        engine.close()
        del engine
    gap, same, first_differ = 0.0, 0, []
    for rid, c in runs["contiguous"].items():
        p = runs["paged"][rid]
        common = next((i for i, (a, b) in enumerate(zip(c.token_ids, p.token_ids)) if a != b), len(c.token_ids))
        gap = max([gap] + [abs(a - b) for a, b in zip(c.logprobs[:common + 1], p.logprobs[:common + 1])])
        same += c.token_ids == p.token_ids
        if c.token_ids[0] != p.token_ids[0]:
            first_differ.append(rid)
    out = {"rows": len(prompts), "rows_equal": same, "max_logprob_gap_common_prefix": round(gap, 4)}
    if first_differ or not math.isfinite(gap):
        raise RuntimeError(f"the paged layout's first tokens differ from the contiguous one's ({first_differ}): {out}")
    return out


def logprob_parity(args, size: Size, model_dir: Path, vocab: int, deepspeed: bool = False) -> dict:
    """The engine's behaviour log-probs, the megatron learner's and an fp32 HF forward's of the same tokens
    (deepspeed: the DeepSpeed learner's too)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.protocols import Completion, GenerationRequest, SamplingParams

    device = device_of(args)
    prompts = random_prompts(size.parity_rows, vocab, seed=1)
    engine_error = None
    try:
        engine = make_engine(model_dir, device, max_running=len(prompts),
                             max_seq_len=max(map(len, prompts)) + size.parity_tokens)
        sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=size.parity_tokens)
        done = sorted(engine.generate([GenerationRequest(str(i), p, sampling) for i, p in enumerate(prompts)]),
                      key=lambda c: int(c.request_id))
        engine.close()
        del engine
    except Exception:  # still compare the learner with HF, on random completions
        import traceback

        engine_error = traceback.format_exc()[-1500:]
        gen = torch.Generator().manual_seed(2)
        done = [Completion(str(i), p, torch.randint(0, vocab, (size.parity_tokens,), generator=gen).tolist(),
                           [float("nan")] * size.parity_tokens, [0] * size.parity_tokens, "length")
                for i, p in enumerate(prompts)]
    length = max(len(c.prompt_ids) + len(c.token_ids) for c in done)
    ids = torch.zeros((len(done), length), dtype=torch.long)
    mask = torch.zeros((len(done), length), dtype=torch.bool)
    behaviour = torch.zeros((len(done), length))
    for r, c in enumerate(done):
        seq = c.prompt_ids + c.token_ids
        ids[r, :len(seq)] = torch.tensor(seq)
        mask[r, len(c.prompt_ids):len(seq)] = True
        behaviour[r, len(c.prompt_ids):len(seq)] = torch.tensor(c.logprobs)
    learner = make_learner(model_dir, size)
    ours = learner.logprobs(ids)
    del learner
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        logits = hf(ids.to(device)).logits.float()
    ref = torch.nn.functional.pad(torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None].to(device))[..., 0],
                                  (1, 0)).cpu()

    def gap(a, b) -> dict:
        d = (a - b)[mask].abs()
        return {"max_abs": round(float(d.max()), 4), "mean_abs": round(float(d.mean()), 5)}

    out = {"tokens": int(mask.sum()), "backend": args.backend, "learner_vs_hf_fp32": gap(ours, ref)}
    if deepspeed:
        learner = make_deepspeed_learner(model_dir, size)
        out["deepspeed_learner_vs_hf_fp32"] = gap(learner.logprobs(ids), ref)
        biases = [n for n, _, _ in learner.publish_spec() if n.endswith("e_score_correction_bias")]
        del learner
        if not biases:
            raise RuntimeError(f"the DeepSpeed learner publishes no router expert bias: {out}")
    if engine_error:
        raise RuntimeError(f"the engine failed ({engine_error}); learner vs HF alone: {out}")
    out.update(engine_vs_learner=gap(behaviour, ours), engine_vs_hf_fp32=gap(behaviour, ref),
               mean_behaviour_logprob=round(float(behaviour[mask].mean()), 4))
    if done[0].routes is not None:  # (an MoE family on the engine's native forward: its recorded routes)
        out["route_agreement_vs_hf_fp32"] = route_agreement(hf, done[:8], device)
    if not all(torch.isfinite(t[mask]).all() for t in (behaviour, ours)):
        raise RuntimeError(f"non-finite log-probs: {out}")
    return out


def check_generic_path(args, size: Size) -> dict:
    """The generic engine (docs/models.md#the-generic-path) on the device: a Granite (embedding, residual, attention
    and logits multipliers) of the check's shape with random weights, bf16 on the GPU: tokens/s of a batch against the
    native engine on the Qwen2 of the same shape, and the max / mean |behaviour log-prob - fp32 HF forward|."""
    import torch
    from transformers import AutoModelForCausalLM, GraniteConfig, GraniteForCausalLM

    from megarl.protocols import GenerationRequest, SamplingParams
    from megarl.sampler import hf_model
    from megarl.sampler.engine import BuiltinEngine

    device = device_of(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    granite_dir = Path(args.workdir) / "granite"
    if not (granite_dir / "config.json").exists():
        torch.manual_seed(0)
        model = GraniteForCausalLM(GraniteConfig(**size.model, embedding_multiplier=4.0, residual_multiplier=0.5,
                                                 attention_multiplier=0.2, logits_scaling=2.0))
        model.to(dtype).save_pretrained(granite_dir)
        del model
    qwen_dir = build_model(Path(args.workdir) / "model", size, args.device)
    batch, new = size.gen_batches[-1], size.gen_tokens
    prompts = random_prompts(batch, size.model["vocab_size"], seed=3)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new)
    result, done = {}, None
    for name, model_dir in (("generic", granite_dir), ("native", qwen_dir)):
        engine = BuiltinEngine.from_pretrained(str(model_dir), max_running=batch, device=device,
                                               max_seq_len=max(map(len, prompts)) + new)
        result[f"{name}_impl"] = engine._impl.__name__
        completions, result[f"{name}_tok_s"] = timed_generation(
            engine, [GenerationRequest(str(i), p, sampling) for i, p in enumerate(prompts)])
        done = completions if name == "generic" else done
        del engine
    if result["generic_impl"] != hf_model.__name__:
        raise RuntimeError(f"the Granite ran on {result['generic_impl']}, not the generic model: {result}")
    result["generic_over_native"] = round(result["generic_tok_s"] / result["native_tok_s"], 3)
    hf = AutoModelForCausalLM.from_pretrained(str(granite_dir), dtype=torch.float32).to(device).eval()
    return {**result, "batch": batch, "new_tokens": new, "dtype": str(dtype),
            "engine_vs_hf_fp32": _gap_to_transformers(hf, done[:8], device, result), "peak_gpu_gib": peak_gib()}


def _gap_to_transformers(hf, completions, device, result: dict) -> dict:
    """Max and mean |engine behaviour log-prob - transformers' log-prob| over the completions' tokens (`result`
    names the check in the error raised on a non-finite log-prob)."""
    import torch

    gaps = []
    with torch.no_grad():
        for c in completions:
            seq = torch.tensor([c.prompt_ids + c.token_ids], device=device)
            lp = torch.log_softmax(hf(seq).logits[0].float(), -1)
            n = len(c.prompt_ids)
            ref = lp[n - 1:n - 1 + len(c.token_ids)].gather(-1, seq[0, n:, None])[:, 0].cpu()
            gaps.append((torch.tensor(c.logprobs) - ref).abs())
    gap = torch.cat(gaps)
    if not torch.isfinite(gap).all():
        raise RuntimeError(f"non-finite behaviour log-probs: {result}")
    return {"max_abs": round(float(gap.max()), 4), "mean_abs": round(float(gap.mean()), 5)}


def check_gpt_oss_engine(args, size: Size) -> dict:
    """gpt-oss on the built-in engine's native forward (docs/models.md, "gpt-oss end to end") at the families check's
    shape (FAMILY_CHECKS["gpt_oss"]), bf16 on the GPU: decode tokens/s of a batch against the generic model
    (sampler.model_impl=hf) on the same weights and prompts, the max / mean |behaviour log-prob - fp32 transformers|,
    and the share of (position, MoE layer) whose recorded experts are fp32 transformers' router's top-k (what R3
    replays; bf16 rounding may flip near-ties)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.protocols import GenerationRequest, SamplingParams
    from megarl.sampler import model as native
    from megarl.sampler.engine import BuiltinEngine

    device = device_of(args)
    model_dir = build_family_model(Path(args.workdir) / "gpt_oss_engine", "gpt_oss", size, args.device)
    batch, new = size.gen_batches[-1], size.gen_tokens
    prompts = random_prompts(batch, size.model["vocab_size"], seed=5)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new)
    result, done = {}, None
    for impl in ("native", "hf"):
        engine = BuiltinEngine.from_pretrained(str(model_dir), max_running=batch, device=device, model_impl=impl,
                                               max_seq_len=max(map(len, prompts)) + new)
        if impl == "native" and engine._impl is not native:
            raise RuntimeError(f"gpt-oss ran on {engine._impl.__name__}, not the native forward")
        completions, result[f"{impl}_tok_s"] = timed_generation(
            engine, [GenerationRequest(str(i), p, sampling) for i, p in enumerate(prompts)])
        done = completions if impl == "native" else done
        engine.close()
        del engine
    result["native_over_generic"] = round(result["native_tok_s"] / result["hf_tok_s"], 3)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    return {**result, "batch": batch, "new_tokens": new,
            "engine_vs_hf_fp32": _gap_to_transformers(hf, done[:8], device, result),
            "route_agreement_vs_hf_fp32": route_agreement(hf, done[:8], device), "peak_gpu_gib": peak_gib()}


def route_agreement(hf, completions, device) -> float:
    """The share of (position, MoE layer) whose experts the engine recorded are the fp32 transformers router's
    choice, as a set (what R3 replays; bf16 rounding may flip near-ties). A layer's router: gpt-oss's `mlp.router`,
    the others' `mlp.gate` (a GLM-4.5's or DeepSeek-V3's dense first layers have none)."""
    import torch

    chosen = []
    routers = [getattr(layer.mlp, "router", None) or getattr(layer.mlp, "gate", None) for layer in hf.model.layers]
    hooks = [r.register_forward_hook(lambda _m, _i, out: chosen.append(out[2].cpu())) for r in routers if r is not None]
    same = total = 0
    with torch.no_grad():
        for c in completions:
            chosen.clear()
            hf(torch.tensor([c.prompt_ids + c.token_ids], device=device))
            ref = torch.stack(chosen, dim=1)[:-1].sort(-1).values  # [positions, MoE layers, k]
            got = torch.from_numpy(c.routes.astype("int64")).sort(-1).values
            same += int((ref == got).all(-1).sum())
            total += ref.shape[0] * ref.shape[1]
    for h in hooks:
        h.remove()
    return round(same / total, 4)


# The hybrid check's Qwen3.5-like text model (gated DeltaNet on 3 of every 4 layers, full attention on the 4th).
QWEN35_LIKE = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
                   linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                   linear_num_value_heads=16, max_position_embeddings=4096, tie_word_embeddings=True)
TINY_QWEN35 = dict(QWEN35_LIKE, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4)


# The hybrid check's Nemotron-H-like model (Mamba-2 mixers, MLP and MoE blocks, full attention on every 6th block,
# each a layer of its own in layers_block_type; Nemotron-H's vocabulary, its Mamba-2 head and state sizes).
NEMOTRON_H_LIKE = dict(vocab_size=131072, hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=128, mamba_num_heads=32, mamba_head_dim=64, ssm_state_size=128,
                       n_groups=8, conv_kernel=4, chunk_size=128, n_routed_experts=16, num_experts_per_tok=2,
                       moe_intermediate_size=512, moe_shared_expert_intermediate_size=1024, n_group=1, topk_group=1,
                       max_position_embeddings=4096, layers_block_type=["linear_attention", "mlp", "linear_attention",
                                                                        "moe", "linear_attention", "full_attention"] * 4)
TINY_NEMOTRON_H = dict(NEMOTRON_H_LIKE, vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       head_dim=16, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=8,
                       n_routed_experts=4, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                       layers_block_type=["linear_attention", "moe", "full_attention", "mlp"])


def _hybrid_dir(args, size: Size, kind: str, dtype) -> tuple[Path, int]:
    """(HF directory, vocab size) of the hybrid check's `kind` model with random weights in `dtype`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(args.workdir) / f"{kind}_like_{str(dtype).removeprefix('torch.')}"
    if kind == "qwen3_5":
        shape = TINY_QWEN35 if size.tiny else QWEN35_LIKE
        every = 2 if size.tiny else 4  # (the dry run: one layer of each)
        extra = {"layer_types": ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                 for i in range(shape["num_hidden_layers"])]}
        model_type = "qwen3_5_text"
    else:
        shape, extra, model_type = TINY_NEMOTRON_H if size.tiny else NEMOTRON_H_LIKE, {}, "nemotron_h"
    if not (model_dir / "config.json").exists():
        torch.manual_seed(0)
        config = AutoConfig.for_model(model_type, **shape, **extra)
        AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(model_dir)
    return model_dir, shape["vocab_size"]


def check_hybrid(args, size: Size) -> dict:
    """The generic engine on hybrid models (docs/models.md#hybrid-linear-attention-models), random weights, bf16 on
    the GPU: a Qwen3.5-like text model (gated DeltaNet) and a Nemotron-H-like one (Mamba-2, MLP and MoE blocks). Per
    model: decode tokens/s of a batch (per-slot conv and recurrent state beside the KV cache), the max / mean
    |behaviour log-prob - the DeepSpeed learner's forward (transformers, the engine's dtype, unpacked rows)| at lag
    0 and the same against an fp32 forward, and the fp32 gap of a second engine that prefills in chunks of 8
    positions (the conv and recurrent state carried across chunks)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.protocols import GenerationRequest, SamplingParams
    from megarl.sampler import hf_model
    from megarl.sampler.engine import BuiltinEngine

    device = device_of(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch, new = size.gen_batches[-1], size.gen_tokens
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new)
    results = {}
    for kind in ("qwen3_5", "nemotron_h"):
        model_dir, vocab = _hybrid_dir(args, size, kind, dtype)
        prompts = random_prompts(batch, vocab, seed=4)
        requests = [GenerationRequest(str(i), p, sampling) for i, p in enumerate(prompts)]
        max_seq_len = max(map(len, prompts)) + new
        engine = BuiltinEngine.from_pretrained(str(model_dir), max_running=batch, device=device,
                                               max_seq_len=max_seq_len)
        if engine._impl is not hf_model:
            raise RuntimeError(f"the {kind} hybrid ran on {engine._impl.__name__}, not the generic model")
        engine.generate(requests[:2])  # warm-up
        sync()
        start = time.perf_counter()
        done = engine.generate(requests)
        sync()
        seconds = time.perf_counter() - start
        decode_s = engine.stats()["decode_time_s"]
        del engine
        chunked = BuiltinEngine.from_pretrained(str(model_dir), max_running=8, device=device, max_seq_len=max_seq_len,
                                                prefill_chunk=8).generate(requests[:8])
        result = {"tok_s": round(sum(len(c.token_ids) for c in done) / seconds), "batch": batch, "new_tokens": new,
                  "dtype": str(dtype), "decode_time_s": round(decode_s, 3)}
        for name, ref_dtype in (("learner_lag0", dtype), ("hf_fp32", torch.float32)):
            hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=ref_dtype).to(device).eval()
            result[f"gap_vs_{name}"] = _gap_to_transformers(hf, done[:8], device, result)
            if ref_dtype == torch.float32:
                result["chunked_prefill_gap_vs_hf_fp32"] = _gap_to_transformers(hf, chunked, device, result)
            del hf
        results[kind] = result
    return {**results, "peak_gpu_gib": peak_gib()}


def check_gated_delta_net(args, size: Size) -> dict:
    """megatron-core's own GatedDeltaNet as megarl builds it (megarl.learner.gated_delta_net; docs/models.md, "The
    megatron learner's gated DeltaNet") against transformers' Qwen3.5 layer with the same weights (mapped by
    megarl.models.gated_delta_net), one layer of the hybrid check's shape at the learner's dtype: the largest
    |output difference| relative to the output's scale, and each one's median forward + backward time. On the GPU
    megatron runs flash-linear-attention's kernels where it is installed and the module's torch path otherwise
    (`impl`); on CPU the torch path under apply_gated_delta_net_shims."""
    import importlib.util

    import torch
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from megarl.learner.cpu_shims import apply_gated_delta_net_shims, l2norm
    from megarl.learner.gated_delta_net import build_layer
    from megarl.models import gated_delta_net as gdn

    init_single_rank(args.backend, Path(args.workdir))
    from megatron.core import parallel_state
    from megatron.core.ssm import gated_delta_net as mcore_gdn

    parallel_state.initialize_model_parallel(1, 1)
    apply_gated_delta_net_shims()  # (CPU only)
    impl = "fla" if importlib.util.find_spec("fla") is not None else "torch"
    if impl == "torch" and not mcore_gdn.HAVE_FLA:  # a GPU without flash-linear-attention: the module's torch path
        mcore_gdn.HAVE_FLA, mcore_gdn.l2norm = True, l2norm
        mcore_gdn.chunk_gated_delta_rule = mcore_gdn.torch_chunk_gated_delta_rule
    device = device_of(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = dict(TINY_QWEN35 if size.tiny else QWEN35_LIKE, num_hidden_layers=2,
                 layer_types=["linear_attention", "full_attention"], rms_norm_eps=1e-6)
    config = Qwen3_5TextConfig(**shape)
    torch.manual_seed(0)
    hf = Qwen3_5GatedDeltaNet(config, 0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.02 + (1.0 if p.dim() == 1 else 0.0))
    hf = hf.to(device, dtype)
    mcore = build_layer(config.to_dict(), dtype).to(device)
    mcore.load_state_dict(gdn.hf_to_mcore({k: v.detach() for k, v in hf.state_dict().items()}), strict=False)
    rows, width = (2, size.train_len) if size.tiny else (size.train_rows, size.train_len)
    x = torch.randn(rows, width, config.hidden_size, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    outs, result = {}, {"rows": rows, "width": width, "dtype": str(dtype).removeprefix("torch."), "impl": impl}
    for name, forward in (("transformers", lambda t: hf(t)),
                          ("megatron", lambda t: mcore(t.transpose(0, 1).contiguous(), None)[0].transpose(0, 1))):
        times = []
        for _ in range(2 if size.tiny else size.train_steps + 2):  # (the first: warm-up)
            inp = x.detach().requires_grad_()
            sync()
            start = time.perf_counter()
            out = forward(inp)
            out.float().square().mean().backward()
            sync()
            times.append(time.perf_counter() - start)
        outs[name] = out.detach().float()
        result[f"{name}_median_fwd_bwd_s"] = round(median(times[1:]), 5)
    scale = outs["transformers"].abs().max().item()
    result["max_abs_diff_rel"] = (outs["megatron"] - outs["transformers"]).abs().max().item() / scale
    parallel_state.destroy_model_parallel()
    return {**result, "peak_gpu_gib": peak_gib()}


def check_hybrid_learner(args, size: Size) -> dict:
    """The megatron learner on hybrid's Qwen3.5-like model (docs/models.md, "Hybrid linear-attention models"; random
    weights): logprob_parity against the generic engine and an fp32 HF forward, and its step time."""
    import torch

    init_single_rank(args.backend, Path(args.workdir))
    model_dir, vocab = _hybrid_dir(args, size, "qwen3_5", torch.float32)
    out = logprob_parity(args, size, model_dir, vocab)
    learner = make_learner(model_dir, size)
    steps = Size(size.tiny)
    steps.model = {**size.model, "vocab_size": vocab}  # (timed_steps' random ids: this vocabulary)
    times, _ = timed_steps(learner, steps)
    return {**out, "median_step_s": round(median(times), 4), "peak_gpu_gib": peak_gib()}


def check_moe_replay(args, size: Size) -> dict:
    """Router agreement and log-prob gap between the built-in engine (bf16 weights on the GPU, recording routes)
    and the megatron learner on a random Mixtral-style model, with routing replay off and r3
    (benchmarks/moe_replay.py's measure): the table of docs/moe.md at a size and in dtypes CPU cannot show."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from moe_replay import measure  # benchmarks/ (this script's directory) is on sys.path

    workdir = Path(args.workdir)
    init_single_rank(args.backend, workdir)
    model_dir = workdir / "moe_model"
    if not (model_dir / "config.json").exists():
        torch.manual_seed(0)
        with torch.device(args.device):
            model = MixtralForCausalLM(MixtralConfig(**size.moe_model))
        model.save_pretrained(model_dir)
        del model
    engine_dtype = "bfloat16" if args.device == "cuda" else "float32"
    return {**measure(model_dir, engine_dtype, size.moe_rows, size.moe_tokens, device=args.device),
            "peak_gpu_gib": peak_gib()}


def check_lora(args, size: Size) -> dict:
    """learner.lora at the check's model shape (docs/lora.md): the megatron learner with a rank-`lora_rank` adapter on
    every projection (trainable parameters, step time, peak GPU memory: compare learner_step's full fine-tuning), the
    adapter-only publish (bytes vs the full model's), the built-in engine's merge-and-stage of it (AdapterStager), and
    the lag-0 gap between the engine's behaviour log-probs under the adapter and the learner's; and what a version
    costs the learner under sampler.engine=sglang (MergedLoraSource: merged bytes, kept base, base gather, merge)."""
    from megarl.algo.config import LossConfig
    from megarl.config.schema import LearnerConfig, LoraConfig
    from megarl.learner.lora_publish import MergedLoraSource
    from megarl.learner.megatron import MegatronLearner

    workdir = Path(args.workdir)
    device = device_of(args)
    init_single_rank(args.backend, workdir)
    model_dir = build_model(workdir / "model", size, args.device)
    lora_cfg = LoraConfig(rank=size.lora_rank)
    learner = MegatronLearner(str(model_dir), LearnerConfig(micro_batch_size=size.micro_batch, lr=1e-3, lora=lora_cfg),
                              LossConfig())
    params = sum(p.numel() for p in learner.gpt.parameters())
    trainable = sum(p.numel() for p in learner.gpt.parameters() if p.requires_grad)
    times, _ = timed_steps(learner, size)
    learner_peak = peak_gib()
    start = time.perf_counter()
    adapter = dict(learner.publish_tensors())
    adapter_s = time.perf_counter() - start
    # sampler.engine=sglang: a version is the adapted weights merged on the learner (MergedLoraSource), over the
    # adapted base it gathers once and keeps on the host.
    start = time.perf_counter()
    source = MergedLoraSource(learner, lora_cfg, keep=True)
    base_s = time.perf_counter() - start
    start = time.perf_counter()
    merged_bytes = sum(t.numel() * t.element_size() for _, t in source.publish_tensors())
    sglang = {"merged_bytes_fp32": merged_bytes, "base_kept_bytes": source.base_bytes,
              "base_gather_s": round(base_s, 4), "merge_s": round(time.perf_counter() - start, 4)}
    del source
    out = {"rank": lora_cfg.rank, "targets": len(lora_cfg.target_modules), "params": params, "trainable": trainable,
           "median_step_s": round(median(times), 4), "learner_peak_gpu_gib": learner_peak,
           "adapter_bytes_fp32": sum(t.numel() for t in adapter.values()) * 4,
           "adapter_tensors_s": round(adapter_s, 4), "sglang": sglang}
    out.update(adapter_on_engine(learner, adapter, lora_cfg, model_dir, device, size))
    out["peak_gpu_gib"] = peak_gib()
    return out


def adapter_on_engine(learner, adapter: dict, lora_cfg, model_dir: Path, device, size: Size) -> dict:
    """The learner's published `adapter` staged on a built-in engine of the model's base (AdapterStager, the
    sampler's path under learner.lora): the merge-and-stage time, the full model's fp32 bytes, and the lag-0 gap
    between the engine's behaviour log-probs of what it samples and the learner's log-probs of those tokens."""
    import torch

    from megarl.models.convert import load_pretrained
    from megarl.protocols import GenerationRequest, SamplingParams
    from megarl.sampler.lora import AdapterStager

    hf_config, base = load_pretrained(str(model_dir))
    full_fp32_bytes = sum(t.numel() for t in base.values()) * 4
    prompts = random_prompts(size.parity_rows, size.model["vocab_size"], seed=1)
    engine = make_engine(model_dir, device, max_running=len(prompts), max_seq_len=max(map(len, prompts)) + size.parity_tokens)
    stager = AdapterStager(engine, base, hf_config, lora_cfg)
    del base
    sync()
    start = time.perf_counter()
    stager.stage(adapter, learner.version)
    sync()
    stage_s = time.perf_counter() - start
    engine.apply_staged()
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=size.parity_tokens)
    done = engine.generate([GenerationRequest(str(i), p, sampling) for i, p in enumerate(prompts)])
    width = max(len(c.prompt_ids) + len(c.token_ids) for c in done)
    seqs = torch.zeros((len(done), width), dtype=torch.long)
    gen_mask = torch.zeros((len(done), width), dtype=torch.bool)
    recorded = torch.zeros((len(done), width))
    for r, c in enumerate(done):
        seqs[r, :len(c.prompt_ids) + len(c.token_ids)] = torch.tensor(c.prompt_ids + c.token_ids)
        gen_mask[r, len(c.prompt_ids):len(c.prompt_ids) + len(c.token_ids)] = True
        recorded[r, len(c.prompt_ids):len(c.prompt_ids) + len(c.token_ids)] = torch.tensor(c.logprobs)
    gap = (recorded - learner.logprobs(seqs))[gen_mask].abs()
    out = {"full_bytes_fp32": full_fp32_bytes, "engine_merge_stage_s": round(stage_s, 4),
           "lag0_gap": {"max_abs": round(float(gap.max()), 4), "mean_abs": round(float(gap.mean()), 5)},
           "engine_dtype": str(engine._weights.dtype)}
    if not torch.isfinite(gap).all():
        raise RuntimeError(f"non-finite log-probs: {out}")
    return out


# The `lora_families` check: learner.lora on the families whose adapted modules are not the plain decoder's q/k/v/o,
# gate/up/down (docs/lora.md#which-modules-each-family-adapts), at the families check's shapes: Phi-3's fused
# qkv_proj / gate_up_proj, gpt-oss's attention (an MoE: attention only; biases, sinks) and DeepSeek-V3's multi-latent
# attention (on the engine's generic model).
LORA_FAMILIES = ("phi3", "gpt_oss", "deepseek_v3")


def check_lora_families(args, size: Size) -> dict:
    """Per LORA_FAMILIES family: the megatron learner with a rank-`lora_rank` adapter (every projection, attention
    only on an MoE), trained for its timed steps, then adapter_on_engine: adapter bytes, step time, merge-and-stage
    time and the lag-0 gap of the engine's behaviour log-probs under the adapter against the learner's."""
    from megarl.algo.config import LossConfig
    from megarl.config.schema import LearnerConfig, LoraConfig
    from megarl.learner.megatron import MegatronLearner
    from megarl.models.lora import ATTENTION_TARGETS
    from megarl.models.moe_config import is_moe

    init_single_rank(args.backend, Path(args.workdir))
    device = device_of(args)
    out = {}
    for name in LORA_FAMILIES:
        model_dir = build_family_model(Path(args.workdir) / f"lora_family_{name}", name, size, args.device)
        hf_config = json.loads((model_dir / "config.json").read_text())
        lora_cfg = LoraConfig(rank=size.lora_rank, **({"target_modules": list(ATTENTION_TARGETS)}
                                                      if is_moe(hf_config) else {}))
        learner = MegatronLearner(str(model_dir), LearnerConfig(micro_batch_size=size.micro_batch, lr=1e-3,
                                                                lora=lora_cfg), LossConfig())
        times, _ = timed_steps(learner, size)
        adapter = dict(learner.publish_tensors())
        out[name] = {"adapted_modules": sorted({n.split(".")[-3] for n in adapter}),
                     "adapter_bytes_fp32": sum(t.numel() for t in adapter.values()) * 4,
                     "median_step_s": round(median(times), 4),
                     **adapter_on_engine(learner, adapter, lora_cfg, model_dir, device, size)}
        del learner, adapter
        shutil.rmtree(model_dir)
    out["peak_gpu_gib"] = peak_gib()
    return out


def check_e2e_train(args, size: Size) -> dict:
    return run_demo(args, size, "e2e", [])[0]


def check_stale_mask(args, size: Size) -> dict:
    """The demo with algo.stale=mask_tokens, groups sent as they finish at max_lag 1 (where drop_group drops some):
    no group dropped as stale, the share of tokens masked instead, reward and tokens/s beside e2e_train's."""
    out, rows = run_demo(args, size, "stale_mask", ["algo.stale=mask_tokens", "algo.queue_order=finish", "algo.max_lag=1"])
    if rows:
        out["masked_token_frac"] = masked_token_frac(rows)
    return out


def check_eval_overlap(args, size: Size) -> dict:
    """The demo with a held-out evaluation every 5 steps, then without: each evaluation's seconds and the versions the
    training engine applied while it ran (publishes_during > 0: the learner's publishes went on), and the learner's
    time from its first to its last step and median queue wait in both runs (docs/eval.md "Cost")."""
    out = {}
    for name, overrides in (("eval_on", ["eval.every_steps=5"]), ("eval_off", ["eval.sets=[]"])):
        run, rows = run_demo(args, size, f"eval_overlap_{name}", overrides)
        out[name] = run
        if rows:
            waits = sorted(r["queue_wait_s"] for r in rows)
            run.update(first_to_last_step_s=round(rows[-1]["time"] - rows[0]["time"], 2),
                       median_queue_wait_s=round(waits[len(waits) // 2], 4))
        if rows and name == "eval_on":
            records = [json.loads(line) for line in
                       (Path(args.workdir) / f"eval_overlap_{name}" / "metrics.jsonl").read_text().splitlines()]
            run["evaluations"] = [{"version": r["eval_version"], "eval_s": round(r["eval_s"], 3),
                                   "publishes_during": r["eval/publishes_during"]}
                                  for r in records if r.get("kind") == "eval"]
    return out


def masked_token_frac(rows: list[dict]) -> float:
    """The share of a run's trained tokens the loss's lag bound (loss.max_token_lag) gave no policy gradient."""
    tokens = sum(r["mask/tokens"] for r in rows)
    return sum(r["mask/lag_frac"] * r["mask/tokens"] for r in rows) / max(1.0, tokens)


def run_demo(args, size: Size, name: str, overrides: list[str]) -> tuple[dict, list[dict]]:
    """`megarl train configs/demo.yaml` with `overrides` for size.e2e_steps steps (on CPU: --dry-run): what it did,
    and its metrics.jsonl step records (none on CPU)."""
    run_dir = Path(args.workdir) / name
    cmd = [sys.executable, "-m", "megarl.cli", "train", "configs/demo.yaml", f"run.dir={run_dir}",
           f"run.steps={size.e2e_steps}", "dist.backend=gloo", "run.overwrite=true", "observe.trackers=[]", *overrides]
    if size.tiny:
        cmd.append("--dry-run")  # on CPU: the config and topology checks, the model build; no worker starts
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout - 10)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-3000:]}{proc.stdout[-1500:]}")
    out = {"dist_backend": "gloo", "wall_s": round(wall, 1), "command": " ".join(cmd[1:])}
    if size.tiny:
        out["dry_run"] = proc.stdout.strip().splitlines()[-1:]
        return out, []
    rows = [r for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()) if "kind" not in r]  # eval records: docs/eval.md
    keep = ("reward_mean", "tokens_per_s", "lag_mean", "multi_version_frac", "loss")
    out.update(steps=len(rows), first={k: rows[0].get(k) for k in keep}, last={k: rows[-1].get(k) for k in keep},
               sampler={k: v for k, v in rows[-1].items()
                        if k.startswith("sampler") and k.endswith(("tokens_per_s", "busy_frac", "swap_time_s", "held_groups"))},
               # under algo.queue_order=deadline (the default) none is dropped as stale while the sampler keeps pace
               stale_groups_dropped=rows[-1].get("dropped/stale_groups_total"),
               timings={k: v for k, v in rows[-1].items() if "time" in k and not k.startswith("sampler")})
    if len(rows) != size.e2e_steps:
        raise RuntimeError(f"{len(rows)} of {size.e2e_steps} steps in metrics.jsonl: {out}")
    return out, rows


# The context-parallel check's learners: learner_step's model, the same with a LoRA adapter, a Mixtral under r3.
CP_VARIANTS = ("dense", "lora", "moe_r3")


def _cp_batch(size: Size, variant: str):
    """One row of size.cp_len random tokens, its completion trained (lag 0): the context-parallel check's batch (for
    the Mixtral, with random recorded routes: top-k distinct experts per token and layer)."""
    import torch

    from megarl.protocols import TrainBatch

    g = torch.Generator().manual_seed(0)
    length = size.cp_len
    model = size.moe_model if variant == "moe_r3" else size.model
    ids = torch.randint(1, model["vocab_size"], (1, length), generator=g)
    mask = torch.zeros(1, length)
    mask[:, length // 8:] = 1.0
    routes = None
    if variant == "moe_r3":
        shape = (1, length, model["num_hidden_layers"], model["num_local_experts"])
        routes = torch.rand(shape, generator=g).argsort(-1)[..., :model["num_experts_per_tok"]].to(torch.uint8)
    return TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=-5.0 * mask,
                      versions=torch.where(mask > 0, 0, -1), advantages=mask.clone(), learner_version=0, routes=routes)


def _cp_model(workdir: Path, size: Size, variant: str, device: str) -> Path:
    """The model directory of a variant, built on first use (the Mixtral with room for cp_len positions)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    if variant != "moe_r3":
        return build_model(workdir / "model", size, device)
    path = workdir / "cp_moe_model"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        with torch.device(device):
            model = MixtralForCausalLM(MixtralConfig(**{**size.moe_model, "max_position_embeddings": size.cp_len}))
        if device == "cuda":
            model = model.to(torch.bfloat16)
        partial = path.with_name(path.name + f".partial{os.getpid()}")
        model.save_pretrained(partial)
        partial.rename(path)
    return path


def _cp_learner(model_dir: Path, size: Size, variant: str, cp: int):
    from megarl.algo.config import LossConfig
    from megarl.config.schema import LearnerConfig, LoraConfig
    from megarl.learner.megatron import MegatronLearner

    lora = LoraConfig(rank=size.lora_rank if variant == "lora" else 0)
    return MegatronLearner(str(model_dir), LearnerConfig(cp=cp, micro_batch_size=1, lr=1e-6, lora=lora), LossConfig(),
                           routing_replay="r3" if variant == "moe_r3" else "off")


def _cp_measure(learner, size: Size, variant: str) -> tuple[dict, "torch.Tensor", "torch.Tensor"]:
    """(step time and peak memory of one step after a warm-up, and the loss of every step: the dense variant takes
    size.cp_curve_steps steps on its row, the others 2; the row's log-probs before the steps and after)."""
    import torch

    batch = _cp_batch(size, variant)
    logprobs = learner.logprobs(batch.input_ids, batch.routes)
    losses = [learner.train_step(batch)["loss"]]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    losses.append(learner.train_step(batch)["loss"])
    sync()
    out = {"step_s": round(time.perf_counter() - start, 4), "peak_gpu_gib": peak_gib(), "loss": losses[-1]}
    steps = size.cp_curve_steps if variant == "dense" else 2
    losses += [learner.train_step(batch)["loss"] for _ in range(steps - 2)]
    return {**out, "losses": losses}, logprobs, learner.logprobs(batch.input_ids, batch.routes)


def check_context_parallel(args, size: Size) -> dict:
    workdir = Path(args.workdir)  # (the ranks build the model: this process imports neither torch nor transformers)
    out_file = workdir / "cp.json"
    out_file.unlink(missing_ok=True)
    code, err = run_two_ranks("--cp-worker", args, size, max(args.timeout - 15, 30))
    if code != 0 or not out_file.exists():
        raise RuntimeError(f"ranks' exit {code}: {err[-2000:]}")
    return json.loads(out_file.read_text())


def run_two_ranks(flag: str, args, size: Size, timeout: float) -> tuple[int | list, str]:
    """The 2 ranks of a two-process check (`flag`: --cp-worker, --publish-worker): a torchrun launch, or on CPU (no
    CUDA context to inherit) forks of this process, which the dry run forked with torch and megatron imported (a
    torchrun launch imports them again in each rank: ~10 CPU-s). -> (exit status(es), stderr where captured)."""
    if args.device != "cpu":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
               flag, "--device", args.device, "--workdir", args.workdir] + (["--tiny"] if size.tiny else [])
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              timeout=timeout)
        return proc.returncode, proc.stderr
    codes = fork_ranks({"--cp-worker": cp_worker, "--publish-worker": publish_worker}[flag], args, size, 2, timeout)
    return (0 if codes == [0, 0] else codes), "(the ranks' output: this check's, in the log)"


def fork_ranks(worker, args, size: Size, nproc: int, timeout: float) -> list[int | str]:
    """`worker(args, size)` in `nproc` forks of this process with torchrun's environment: the store hosted here,
    as torchrun's agent hosts it (TORCHELASTIC_USE_AGENT_STORE), the run's secret shared. -> each rank's exit
    status ("timeout" for one killed after `timeout` seconds)."""
    import secrets
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from megarl.secret import ENV as SECRET_ENV

    port = free_port()
    os.environ.setdefault(SECRET_ENV, secrets.token_hex(32))
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(nproc):
        pid = os.fork()  # (before the store's thread starts here: the ranks' clients wait for it)
        if pid == 0:
            def rank_main(rank=rank):
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                                  LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                  TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1")
                torch.set_num_threads(1)
                worker(args, size)

            exit_child(rank_main)
        pids.append(pid)
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False)
    codes: dict[int, int | str] = {}
    deadline = time.monotonic() + timeout
    while len(codes) < nproc:
        for rank, pid in enumerate(pids):
            if rank not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
                elif time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    codes[rank] = "timeout"
        time.sleep(0.1)
    del store  # (served the ranks until they ended)
    return [codes[rank] for rank in range(nproc)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cp_worker(args, size: Size) -> None:
    """The 2 ranks of check_context_parallel: each variant's learner at learner.cp=2 over the default gloo group; then
    rank 0 alone, in a group of one, each at cp=1 on the same row (one process start and import for all)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if args.device == "cuda":
        torch.cuda.set_device(0)
    workdir = Path(args.workdir)
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:  # (the other rank reads what it built)
        for variant in CP_VARIANTS:
            _cp_model(workdir, size, variant, args.device)
    dist.barrier()
    models = {variant: _cp_model(workdir, size, variant, args.device) for variant in CP_VARIANTS}
    cp2 = {}
    for variant in CP_VARIANTS:
        learner = _cp_learner(models[variant], size, variant, 2)
        result, before, after = _cp_measure(learner, size, variant)
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, result)
        cp2[variant] = (ranks, before, after)
        del learner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    rank = dist.get_rank()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if rank != 0:
        return
    init_single_rank("gloo", workdir)
    out = {"tokens": size.cp_len}
    for variant in CP_VARIANTS:
        cp1, before, after = _cp_measure(_cp_learner(models[variant], size, variant, 1), size, variant)
        ranks, cp2_before, cp2_after = cp2[variant]
        diff, diff_after = (cp2_before - before).abs(), (cp2_after - after).abs()
        result = {"cp1": cp1, "cp2_ranks": ranks, "logprob_max_abs_diff": round(float(diff.max()), 5),
                  "logprob_mean_abs_diff": round(float(diff.mean()), 6),
                  "logprob_max_abs_diff_after_steps": round(float(diff_after.max()), 5),
                  "loss_curve_max_abs_diff": max(abs(a - b) for a, b in zip(ranks[0]["losses"], cp1["losses"],
                                                                             strict=True))}
        out.update(result if variant == "dense" else {variant: result})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    (workdir / "cp.json").write_text(json.dumps(out))


def check_sampler_replace(args, size: Size) -> dict:
    """fault.on_failure=replace on the demo with two built-in samplers: one is SIGKILLed after 5 steps; the learner
    trains on, the replacement joins (samplers/alive back at 2) and trains 5 steps more, then a SIGTERM stops the
    run at a step boundary: every step once, the replacement's join version and the step stall it cost."""
    return _replace_check(args, size, "sampler_replace", [], lambda: _first_sampler_pid(1))


def check_pp_replace(args, size: Size) -> dict:
    """sampler_replace with learner.pp=2 (two learner ranks on the one device, each stage publishing its layers):
    sampler 0 (rank 2) is SIGKILLed; learner rank 0 forms the next membership epoch, stage 1's source builds its
    part's group of it, and the replacement receives both stages' parts before it generates."""
    return _replace_check(args, size, "pp_replace", ["learner.pp=2"], lambda: _first_sampler_pid(2))


def check_sync_replace(args, size: Size) -> dict:
    """sampler_replace with algo.mode=sync: sampler 0 is SIGKILLed mid-run; the survivor is asked for the share of
    each version's batch it owed (membership.SyncShares) until the replacement joins, so no step waits for it."""
    return _replace_check(args, size, "sync_replace", ["algo.mode=sync"], lambda: _first_sampler_pid(1))


def check_tp_replace(args, size: Size) -> dict:
    """sampler_replace with engines of two ranks (sampler.tp=2): engine 0's follower (rank 2) is SIGKILLed; its lead's
    keeper kills the lead, both ranks start replacement 1 (a fresh TP group), and the engine rejoins as one sampler."""
    return _replace_check(args, size, "tp_replace", ["sampler.tp=2"], lambda: _first_sampler_pid(2))


def _first_sampler_pid(rank: int) -> int:
    """The pid of sampler rank `rank`'s first incarnation (fault.on_failure=replace: its keeper's child)."""
    return next(int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _env_of(d).get("RANK") == str(rank)
                and _env_of(d).get("MEGARL_SAMPLER_INCARNATION") == "0")


def check_sglang_replace(args, size: Size) -> dict:
    """sampler_replace with sampler.engine=sglang: sampler 0's SGLang-compatible server is SIGKILLed; its sampler
    fails on it and its keeper starts a new sampler and server, which joins the next epoch's weight-update group."""
    def server() -> int:
        sampler = str(_first_sampler_pid(1))
        return next(int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _parent_of(d) == sampler
                    and b"megarl.sampler.sglang_server" in _cmdline_of(d))

    return _replace_check(args, size, "sglang_replace", ["sampler.engine=sglang"], server)


def check_samplers_add_remove(args, size: Size) -> dict:
    """`megarl samplers add` joins a running 2-sampler demo (fault.on_failure=replace) and sends groups; `megarl
    samplers remove` of it stops it and the publishes go on to the others (docs/faults.md)."""
    return _add_remove_check(args, size, "samplers_add_remove", [])


def check_sglang_add_remove(args, size: Size) -> dict:
    """samplers_add_remove with sampler.engine=sglang (megarl's SGLang-compatible server): the added sampler starts
    its own server, which joins the next epoch's weight-update group."""
    return _add_remove_check(args, size, "sglang_add_remove", ["sampler.engine=sglang"])


def _add_remove_check(args, size: Size, name: str, extra: list[str]) -> dict:
    overrides = ["fault.on_failure=replace", "sampler.num_engines=2", "eval.sets=[]", *extra]
    if size.tiny:
        return run_demo(args, size, name, overrides)[0]
    run_dir = Path(args.workdir) / name
    cmd = [sys.executable, "-m", "megarl.cli", "train", "configs/demo.yaml", f"run.dir={run_dir}", "run.steps=100000",
           "dist.backend=gloo", "run.overwrite=true", "observe.trackers=[]", *overrides]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samplers = [sys.executable, "-m", "megarl.cli", "samplers"]
    added = None
    deadline = time.monotonic() + args.timeout - 40
    metrics = run_dir / "metrics.jsonl"

    def rows() -> list[dict]:
        return [r for r in map(json.loads, metrics.read_text().splitlines()) if "kind" not in r] if metrics.exists() else []

    def until(done, what: str) -> None:
        while not done():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{what}: not reached (exit {proc.poll()}): {proc.communicate()[1][-3000:]}")
            time.sleep(0.5)

    def alive_then(count: float, steps: int) -> bool:
        hit = [r["step"] for r in rows() if r.get("samplers/alive") == count]
        return bool(hit) and rows()[-1]["step"] >= hit[0] + steps

    try:
        until(lambda: len(rows()) >= 5, "5 steps")
        added_at = time.monotonic()
        added = subprocess.Popen([*samplers, "add", str(run_dir)], cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        until(lambda: alive_then(3.0, 5), "the added sampler's join and 5 steps after it")
        joined_s = round(time.monotonic() - added_at, 1)
        removed = subprocess.run([*samplers, "remove", str(run_dir), "--sampler", "2"], cwd=REPO, capture_output=True,
                                 text=True, timeout=max(30.0, deadline - time.monotonic()))
        added_out = added.communicate(timeout=60)[0]
        until(lambda: alive_then(2.0, 3), "3 steps after the removal")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        for p in (proc, added):
            if p is not None and p.poll() is None:
                p.kill()
    done = rows()
    joined = [line for line in out.splitlines() if "added joins the publish set" in line]
    result = {"exit": proc.returncode, "steps": len(done), "join": joined, "add_to_join_s": joined_s,
              "remove": removed.stdout.strip()[-300:], "add_exit": added.returncode,
              "samplers": {k: v for k, v in done[-1].items() if k.startswith("samplers/")}}
    if proc.returncode != 128 + signal.SIGTERM or [r["step"] for r in done] != list(range(len(done))) or not joined \
            or removed.returncode != 0 or added.returncode != 0:
        raise RuntimeError(f"the run did not go on as it should: {result}; {err[-2000:]}{added_out[-1500:]}")
    return result


def _parent_of(proc_dir: Path) -> str:
    try:
        return (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return ""


def _cmdline_of(proc_dir: Path) -> list[bytes]:
    try:
        return (proc_dir / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _replace_check(args, size: Size, name: str, extra: list[str], victim) -> dict:
    """The demo under fault.on_failure=replace with two samplers (and `extra`): after 5 steps the process `victim()`
    names is SIGKILLed; the replacement must join and train 5 steps more, then a SIGTERM stops the run."""
    overrides = ["fault.on_failure=replace", "sampler.num_engines=2", "eval.sets=[]", *extra]
    if size.tiny:
        return run_demo(args, size, name, overrides)[0]
    run_dir = Path(args.workdir) / name
    cmd = [sys.executable, "-m", "megarl.cli", "train", "configs/demo.yaml", f"run.dir={run_dir}", "run.steps=100000",
           "dist.backend=gloo", "run.overwrite=true", "observe.trackers=[]", *overrides]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + args.timeout - 40
    metrics = run_dir / "metrics.jsonl"

    def rows() -> list[dict]:
        return [r for r in map(json.loads, metrics.read_text().splitlines()) if "kind" not in r] if metrics.exists() else []

    def until(done, what: str) -> None:
        while not done():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{what}: not reached (exit {proc.poll()}): {proc.communicate()[1][-3000:]}")
            time.sleep(0.5)

    try:
        until(lambda: len(rows()) >= 5, "5 steps")
        killed_at = time.time()
        os.kill(victim(), signal.SIGKILL)

        def rejoined() -> bool:
            back = [r["step"] for r in rows() if r.get("samplers/replaced") == 1.0 and r.get("samplers/alive") == 2.0]
            return bool(back) and rows()[-1]["step"] >= back[0] + 5

        until(rejoined, "the replacement's join and 5 steps after it")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = rows()
    gaps = [b["time"] - a["time"] for a, b in zip(done, done[1:]) if b["time"] > killed_at]
    joined = [line for line in out.splitlines() if "joins the publish set" in line]
    result = {"exit": proc.returncode, "steps": len(done), "join": joined, "max_step_gap_after_kill_s": round(max(gaps), 2),
              "samplers": {k: v for k, v in done[-1].items() if k.startswith("samplers/")}}
    if proc.returncode != 128 + signal.SIGTERM or [r["step"] for r in done] != list(range(len(done))) or not joined:
        raise RuntimeError(f"the run did not go on as it should: {result}; {err[-2000:]}")
    return result


def _env_of(proc_dir: Path) -> dict[str, str]:
    try:
        return dict(e.split("=", 1) for e in (proc_dir / "environ").read_bytes().decode(errors="replace").split("\0")
                    if "=" in e)
    except OSError:
        return {}


def check_publish_bandwidth(args, size: Size) -> dict:
    out_file = Path(args.workdir) / "publish.json"
    out_file.unlink(missing_ok=True)
    for stale in Path(args.workdir).glob("publish-error-*.txt"):
        stale.unlink()
    code, err = run_two_ranks("--publish-worker", args, size, args.timeout - 10)
    if code != 0 or not out_file.exists():
        errors = {f.name: f.read_text()[-1500:] for f in sorted(Path(args.workdir).glob("publish-error-*.txt"))}
        raise RuntimeError(f"ranks' exit {code}; workers: {errors}; torchrun: {err[-1000:]}")
    return json.loads(out_file.read_text())


def publish_worker(args, size: Size) -> None:
    """One of the 2 processes of check_publish_bandwidth: rank 0 publishes, rank 1 (an engine's receiver, its
    buffers on the device) receives. Two sources: `host_fp32` is what the megatron learner hands the publisher
    today (`publish_tensors`: fp32 copies on the CPU), `device_bf16` the learner's bf16 weights where they
    live. Each has its own gloo publish group and a raw broadcast of one flat buffer of the same bytes."""
    rank = int(os.environ["RANK"])
    try:
        _publish_worker(args, size, rank)
    except BaseException:
        import traceback

        (Path(args.workdir) / f"publish-error-{rank}.txt").write_text(traceback.format_exc())
        raise


def _publish_worker(args, size: Size, rank: int) -> None:
    import threading
    from datetime import timedelta

    import torch

    from megarl.distributed.publish import WeightPublisher, WeightReceiver
    from megarl.distributed.ranks import Topology
    from megarl.distributed.topology import connect_store, publish_group
    from megarl.sampler.model import ModelSpec

    world = int(os.environ["WORLD_SIZE"])
    device = device_of(args)
    if device.type == "cuda":
        torch.cuda.set_device(0)  # both processes on the one GPU
    topo = Topology(rank=rank, world_size=world, num_learners=1, num_samplers=world - 1)
    store, receiver_store = connect_store(topo, 120), connect_store(topo, 120)
    wait = timedelta(seconds=120)
    shapes = ModelSpec.from_hf_config({"model_type": "qwen2", **size.model}).weight_shapes()
    # (on CPU, in the dry run, "device" is the CPU: the same code, the bf16 path included)
    modes = {"host_fp32": (torch.device("cpu"), torch.float32), "device_bf16": (device, torch.bfloat16)}

    def barrier(tag: str) -> None:
        store.set(f"gc/{tag}/{rank}", "1")
        store.wait([f"gc/{tag}/{r}" for r in range(world)], wait)

    result: dict = {"backend": "gloo", "bucket_mb": 64, "checksum": True, "receiver_device": str(device)}
    for mode, (src_device, dtype) in modes.items():
        group = publish_group(topo, store.prefixed(f"gc/{mode}"), "gloo", 120)
        recv_dtype = torch.float32 if mode == "host_fp32" else dtype
        gen = torch.Generator().manual_seed(rank)
        weights = {name: (torch.randn(shape, generator=gen) * 0.02).to(dtype).to(src_device if rank == 0 else device)
                   for name, shape in shapes.items()}
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        applied, stop = [0], threading.Event()
        if rank == 0:
            publisher = WeightPublisher(group, store.prefixed(f"gc/{mode}/pub"), bucket_mb=64,
                                        timeout_s=120, checksum=True)
        else:
            def on_version(version, tensors, extra, mode=mode):
                sync()
                applied[0] = version
                receiver_store.set(f"gc/{mode}/recv/{version}", "1")

            receiver = WeightReceiver(group, receiver_store.prefixed(f"gc/{mode}/pub"),
                                      {n: (t.shape, recv_dtype) for n, t in weights.items()}, device,
                                      on_version=on_version, current_version=lambda: applied[0],
                                      should_stop=stop.is_set, timeout_s=120).start()
        flat = torch.zeros(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype,
                           device=src_device if rank == 0 else device)
        times: dict[str, list[float]] = {"raw_broadcast": [], "publish": []}
        for rep in range(-1, size.publish_reps):  # one warm-up round
            barrier(f"{mode}/raw{rep}")
            sync()
            start = time.perf_counter()
            group.broadcast(flat, 0).wait()
            sync()
            barrier(f"{mode}/raw{rep}/done")
            if rep >= 0:
                times["raw_broadcast"].append(time.perf_counter() - start)
            version = rep + 2
            barrier(f"{mode}/pub{rep}")
            start = time.perf_counter()
            if rank == 0:
                publisher.publish(version, weights.items())
                store.wait([f"gc/{mode}/recv/{version}"], wait)
                if rep >= 0:
                    times["publish"].append(time.perf_counter() - start)
            barrier(f"{mode}/pub{rep}/done")
        if rank > 0:
            stop.set()
            receiver.thread.join(60)
            if receiver.error:
                raise receiver.error
        best = {k: min(v) for k, v in times.items() if v}
        result[mode] = {"bytes": nbytes, "times_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
                        "gb_per_s": {k: round(nbytes / v / 1e9, 2) for k, v in best.items()},
                        "publish_over_raw": round(best["raw_broadcast"] / best["publish"], 2) if "publish" in best else None}
        del weights, flat
        barrier(f"{mode}/end")
    if rank == 0:
        flat = torch.empty(2**20 if size.tiny else 256 * 2**20, dtype=torch.bfloat16, device=device)  # 512 MiB (dry run: 2)
        copy = torch.empty_like(flat)
        copy.copy_(flat)
        sync()
        start = time.perf_counter()
        copy.copy_(flat)
        sync()
        result["copy_gb_per_s"] = round(flat.numel() * 2 / (time.perf_counter() - start) / 1e9, 1)
        (Path(args.workdir) / "publish.json").write_text(json.dumps(result))
    barrier("end")


CHECKS = {"env": (check_env, 60), "learner_step": (check_learner_step, 150), "engine_vs_hf": (check_engine_vs_hf, 120),
          "logprob_parity": (check_logprob_parity, 120), "moe_replay": (check_moe_replay, 120),
          "distill": (check_distill, 120),
          "e2e_train": (check_e2e_train, 200),
          "publish_bandwidth": (check_publish_bandwidth, 120),
          # last: the newest, so a budget that runs short skips them rather than an older check
          "lora": (check_lora, 120), "critic_step": (check_critic_step, 120), "packing": (check_packing, 120),
          "attention": (check_attention, 120), "stale_mask": (check_stale_mask, 120),
          "entropy_metric": (check_entropy_metric, 120), "generic_path": (check_generic_path, 120),
          "trackers": (check_trackers, 120), "families": (check_families, 180), "hybrid": (check_hybrid, 240),
          "gated_delta_net": (check_gated_delta_net, 150), "hybrid_learner": (check_hybrid_learner, 180),
          "context_parallel": (check_context_parallel, 300), "sampler_replace": (check_sampler_replace, 180),
          "sglang_replace": (check_sglang_replace, 180), "long_prefill": (check_long_prefill, 120),
          "agent_stream": (check_agent_stream, 120), "long_paged": (check_long_paged, 150),
          "samplers_add_remove": (check_samplers_add_remove, 240), "sglang_add_remove": (check_sglang_add_remove, 240),
          "gpt_oss_engine": (check_gpt_oss_engine, 150), "pp_replace": (check_pp_replace, 180),
          "sync_replace": (check_sync_replace, 180),
          "lora_families": (check_lora_families, 180), "tp_replace": (check_tp_replace, 180),
          "eval_overlap": (check_eval_overlap, 240)}
LEARNER_FALLBACKS = ["cpu:gloo,cuda:nccl", "gloo"]
# Each check's limit on CPU bounds a hang, it is no speed test: a check there is mostly process starts and imports,
# which a loaded 2-core machine slows several-fold (context_parallel's two torchrun ranks took over 75 s at load 20).
DRY_TIMEOUT = 180


# ------------------------------------------------------------------------------------------ parent
def child_command(name: str, device: str, tiny: bool, workdir: Path, timeout: float, backend: str) -> list[str]:
    return [sys.executable, __file__, "--child", name, "--device", device, "--workdir", str(workdir),
            "--timeout", str(int(timeout)), "--backend", backend] + (["--tiny"] if tiny else [])


def run_check(name: str, device: str, tiny: bool, workdir: Path, timeout: float, backend: str, log: Path,
              fork: bool = False) -> dict:
    """One check in a process of its own process group, bounded by `timeout`: a fresh interpreter, or with `fork`
    a fork of this one (the dry run: the imports warm_imports() did are not paid again)."""
    cmd = child_command(name, device, tiny, workdir, timeout, backend)
    start = time.perf_counter()
    rc, stdout, stderr = (run_forked if fork else run_process)(cmd, timeout)
    with open(log, "a") as f:  # one file for every check (the device tool brings back at most 8 files)
        f.write(f"\n===== {name} (backend {backend}, exit {rc}{', forked' if fork else ''})\n$ {' '.join(cmd)}"
                f"\n--- stdout\n{stdout[-100_000:]}\n--- stderr\n{stderr[-200_000:]}\n")
    seconds = round(time.perf_counter() - start, 1)
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT)]
    if rc == 0 and lines:
        return {"ok": True, "seconds": seconds, **json.loads(lines[-1][len(RESULT):])}
    error = "timed out after %ds" % timeout if rc == "timeout" else f"exit status {rc}"
    failed = {"ok": False, "seconds": seconds, "error": error, "log_tail": (stderr or stdout)[-3000:]}
    return {**failed, "backend_tried": backend} if name in ("learner_step", "logprob_parity") else failed


def child_env() -> dict[str, str]:
    """What a check's environment adds to this one's: megarl importable (the processes a check starts import it)."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1"}


def run_process(cmd: list[str], timeout: float) -> tuple[int | str, str, str]:
    env = {**os.environ, **child_env()}
    # Its own process group: on a timeout every process it started (torchrun and its workers, which hold
    # the GPU and ports) is killed with it, so the next check starts clean.
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        stdout, stderr = proc.communicate()
        rc = "timeout"
    kill_group(proc.pid)  # anything it left behind
    return rc, stdout, stderr


def run_forked(cmd: list[str], timeout: float) -> tuple[int | str, str, str]:
    """run_process's `cmd` (this script's --child arguments) in a fork of this process: its own process group and
    output, the same exit status (1 and the traceback on an exception). Only where no CUDA context exists: the
    dry run."""
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # files, not pipes: nothing to drain while waiting
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the parent's loop
        def forked_main():
            os.setpgid(0, 0)
            os.environ.update(child_env())
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            child_main(build_parser().parse_args(cmd[2:]))

        exit_child(forked_main)
    try:
        os.setpgid(pid, pid)  # (here too: a timeout before the child's own call still finds its group)
    except OSError:  # the child has set it, or is gone
        pass
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc: int | str = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            kill_group(pid)
            os.waitpid(pid, 0)
            rc = "timeout"
            break
        time.sleep(0.1)
    kill_group(pid)  # anything it left behind
    texts = []
    for f in (out, err):
        f.seek(0)
        texts.append(f.read().decode(errors="replace"))
        f.close()
    return rc, *texts


def warm_imports() -> None:
    """The dry run's parent imports what every check imports (env's modules, megatron's model and optimizer, the
    Qwen2 model of transformers), so that each forked check starts with them; one that fails is left to env to
    name."""
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in ENV_MODULES + ("megatron.core.models.gpt", "megatron.core.optimizer",
                                     "megatron.core.distributed", "transformers.models.qwen2.modeling_qwen2"):
            try:
                importlib.import_module(module)
            except Exception:
                pass


def kill_group(pgid: int) -> None:
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(2)


def wheel_report(wheel_dir: Path | None, download: bool) -> dict:
    """The wheel list's structure and total (declared, and downloaded when asked), with the working tree."""
    problems = []
    names = [norm(n) for n, *_ in WHEELS]
    if len(set(names)) != len(names):
        problems.append("a package is listed twice")
    for name, version, filename, size in WHEELS:
        if not filename.startswith(f"{name.replace('-', '_')}-{version}-") or not filename.endswith(".whl"):
            problems.append(f"{filename}: not {name} {version}")
        if not (re.search(r"-(cp312|py3|abi3)-", filename) and re.search(r"(none-any|manylinux[\w.]*x86_64)\.whl$", filename)):
            problems.append(f"{filename}: not a CPython 3.12 x86-64 wheel")
        if size <= 0:
            problems.append(f"{filename}: no size")
    tree = tree_bytes()
    declared = sum(size for *_, size in WHEELS)
    report = {"wheels": {f"{n}=={v}": size for n, v, _, size in WHEELS}, "declared_bytes": declared,
              "tree_bytes": tree, "limit_bytes": LIMIT_BYTES}
    if declared + tree > LIMIT_BYTES:
        problems.append(f"wheels {declared} + working tree {tree} bytes > {LIMIT_BYTES}")
    if download:
        dest = wheel_dir or Path(tempfile.mkdtemp(prefix="megarl-gpu-wheels-"))
        dest.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(download_command(str(dest)), capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            problems.append(f"pip download failed: {proc.stderr[-1500:]}")
        else:
            actual = {}
            for name, version, filename, size in WHEELS:
                path = dest / filename
                if not path.exists():
                    problems.append(f"pip download gave no {filename}: {sorted(p.name for p in dest.glob('*.whl'))}")
                    continue
                actual[filename] = path.stat().st_size
                if actual[filename] != size:
                    problems.append(f"{filename}: {actual[filename]} bytes, the list says {size}")
                for req in requirements(path):
                    if req not in GPU_PRESENT and req not in names:
                        problems.append(f"{filename} requires {req}, which neither the GPU machine nor the list has")
            report["downloaded_bytes"] = sum(actual.values())
            report["wheel_dir"] = str(dest)
    else:
        report["download"] = "skipped (--no-download): sizes are the list's, not re-measured"
    report["problems"] = problems
    return report


def requirements(wheel: Path) -> list[str]:
    """The names a wheel's METADATA requires unconditionally (extras, other Pythons and PyPy left out)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        spec, _, marker = line[len("Requires-Dist:"):].partition(";")
        if "extra" in marker or "pypy" in marker or "python_version <" in marker.replace('"', ""):
            continue
        out.append(norm(re.match(r"\s*([A-Za-z0-9._-]+)", spec).group(1)))
    return out


def tree_bytes() -> int:
    """Bytes of what the device tool carries: tracked and untracked-not-ignored files."""
    try:
        files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                               capture_output=True, check=True, timeout=60).stdout.split(b"\0")
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum((REPO / f.decode()).stat().st_size for f in files if f and (REPO / f.decode()).is_file())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on CPU: wheel list, plan, each check's code on a tiny model")
    parser.add_argument("--no-download", action="store_true", help="dry run: check the declared sizes only")
    parser.add_argument("--wheels", type=Path, default=None, help="where the wheels are (dry run: downloaded to)")
    parser.add_argument("--print-wheels", action="store_true")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), help="run only these checks")
    parser.add_argument("--workdir", default=None)
    # internal: one check in a child process
    parser.add_argument("--child", choices=list(CHECKS))
    parser.add_argument("--publish-worker", action="store_true")
    parser.add_argument("--cp-worker", action="store_true")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--backend", default="nccl")
    return parser


def child_main(args) -> None:
    """One check (--child), or one worker of a check's torchrun."""
    sys.path.insert(0, str(REPO))
    size = Size(args.tiny)
    if args.publish_worker:
        publish_worker(args, size)
        return
    if args.cp_worker:
        cp_worker(args, size)
        return
    result = CHECKS[args.child][0](args, size)
    print(RESULT + json.dumps(result), flush=True)


def main() -> None:
    args = build_parser().parse_args()
    if args.child or args.publish_worker or args.cp_worker:
        child_main(args)
        return

    if args.print_wheels:
        for name, version, filename, size in WHEELS:
            print(f"{name}=={version}  {filename}  {size / 2**20:.2f} MiB")
        print(f"total {sum(s for *_, s in WHEELS) / 2**20:.2f} MiB; fetch them (here, with network) with:")
        print(" ".join(download_command(str(args.wheels or ".whl/gpu_check"))))
        return

    started = time.perf_counter()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="megarl-gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else workdir
    out_dir.mkdir(parents=True, exist_ok=True)
    log_file = out_dir / "gpu_check.log"  # every check's output
    log_file.write_text("")
    names = args.only or list(CHECKS)
    summary: dict = {"mode": "dry-run" if args.dry_run else "gpu", "checks": {}}
    if args.dry_run:
        summary["wheels"] = wheel_report(args.wheels, download=not args.no_download)
        for problem in summary["wheels"]["problems"]:
            print(f"gpu_check: wheels: {problem}", file=sys.stderr)
        w = summary["wheels"]
        print(f"gpu_check: wheels {w['declared_bytes'] / 2**20:.2f} MiB declared"
              + (f", {w['downloaded_bytes'] / 2**20:.2f} MiB downloaded" if "downloaded_bytes" in w else "")
              + f" + working tree {w['tree_bytes'] / 2**20:.2f} MiB of {LIMIT_BYTES / 2**20:.0f} MiB", flush=True)
    print("gpu_check plan: " + ", ".join(f"{n} ({DRY_TIMEOUT if args.dry_run else CHECKS[n][1]} s)" for n in names)
          + f"; total budget {BUDGET_S} s; workdir {workdir}", flush=True)
    backend = "gloo" if args.dry_run else "nccl"
    device = "cpu" if args.dry_run else "cuda"
    warmed = False
    for name in names:
        timeout = DRY_TIMEOUT if args.dry_run else CHECKS[name][1]
        left = BUDGET_S - (time.perf_counter() - started)
        if not args.dry_run and left < 30:
            summary["checks"][name] = {"ok": False, "error": f"skipped: {left:.0f} s of the {BUDGET_S} s budget left"}
            continue
        # learner_step starts with nccl in both modes: on CPU it fails at once, so the dry run exercises the
        # fallbacks below too
        check_backend = "nccl" if name == "learner_step" else backend
        if name in ("logprob_parity", "critic_step") and summary["checks"].get("learner_step", {}).get("ok"):
            check_backend = summary["checks"]["learner_step"]["backend"]
        # BUDGET_S is the GPU loan's: a dry run gives every check its own DRY_TIMEOUT, however long the others took
        limit = timeout if args.dry_run else min(timeout, max(left, 30))
        # The dry run starts env in a fresh interpreter (its imports are what it checks; the GPU's way of starting a
        # check), then every other check in a fork of this process once it has imported what they share.
        fork = args.dry_run and name != "env"
        if fork and not warmed:
            warm_imports()
            warmed = True
        result = run_check(name, device, args.dry_run, workdir, limit, check_backend, log_file, fork)
        if name == "learner_step":
            # nccl failed on one rank: record why, then try the mixed backend (CUDA collectives on nccl, CPU
            # tensors on gloo), then plain gloo (what the one-GPU e2e run uses), while the budget allows
            failures = {}
            for fallback in LEARNER_FALLBACKS:
                if result["ok"] or (not args.dry_run and BUDGET_S - (time.perf_counter() - started) < 60):
                    break
                failures[result["backend_tried"]] = {"error": result["error"], "log_tail": result["log_tail"][-1200:]}
                result = run_check(name, device, args.dry_run, workdir, timeout, fallback, log_file, fork)
            if failures:
                result["failed_backends"] = failures
        summary["checks"][name] = result
        print(f"gpu_check: {name}: {'ok' if result['ok'] else 'FAILED ' + result['error']} ({result['seconds']} s)",
              flush=True)
    summary["ok"] = all(c["ok"] for c in summary["checks"].values()) and not summary.get("wheels", {}).get("problems")
    summary["seconds"] = round(time.perf_counter() - started, 1)
    line = json.dumps({"gpu_check": summary})
    (out_dir / "gpu_check.json").write_text(line + "\n")
    print(line)
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
