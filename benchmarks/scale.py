"""Scale: megarl's learner, engine and publish at real model shapes on CPU; time and memory per role.

    python benchmarks/scale.py --quick          # the Qwen2.5-0.5B shape, 1 receiver: 6.5 min on 2 idle cores,
                                                # 10.5 min with other jobs on them (load 3-8)
    python benchmarks/scale.py                  # + 2 receivers, bf16 publish, the 1.5B shapes: 11 min idle
    python benchmarks/scale.py --dry-run        # the plan, the memory each part needs, what is left out

Shapes (random weights from the configs, built here, nothing downloaded; tied embeddings, vocab 151936):
  qwen2.5-0.5b    hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864: 494M parameters
  qwen2.5-1.5b    hidden 1536, 28 layers, 12 heads / 2 KV heads, MLP 8960: 1.54B parameters
  qwen2.5-1.5b-8L the 1.5B shape with 8 of its 28 layers (608M): the learner's 1.5B point. A whole 1.5B
                  fp32 learner with Adam holds >= 16 B/param = 24.7 GB, more than this machine has.

Parts, each in its own process (torchrun where it is distributed) under a timeout, run one after another
so that each has the machine's memory to itself:
  learner   one optimizer step on a 2 x 64-token batch (activations small; lr 1e-6): step time, resident
            memory (RSS) per rank over the RSS before the model was loaded (built, step peak) against the
            role's minimum (params + grads + Adam m, v = 16 B/param fp32, divided as TP / ZeRO divide it);
            megatron TP1 and TP2 (real torchrun, gloo) and the DeepSpeed learner at dp=1, ZeRO-1 (what fits:
            see LEFT_OUT for ZeRO-3 at dp=2). On the TP1 0.5B run also the delta publish: the bf16 words of
            two consecutive versions (after steps k and k+1), the changed fraction and the bytes megarl's
            delta encoding (`publish.delta_payload` per 16 MB bucket, delta_fraction.py) sends vs full bf16.
  engine    the built-in engine (1 torch thread): generated tokens/s at batch 1, 4, 16 (prefill included),
            its RSS broken into the weights it holds, a staging set (a second version staged for the
            in-flight swap) and the KV cache; and the swap stall in-process: a version staged on another
            thread while batch 16 decodes (what a receiver thread does), decode time lost until the swap
            (the engine's `swap_time_s` is the decode thread's own cost).
  publish   WeightPublisher -> WeightReceiver (checksums on, the default) vs one raw gloo broadcast of the
            same bytes, back to back per round, receivers idle (the version handed over = done); 1 and 2
            receivers. On 1 receiver also the swap stall of a decoding sampler (weight_publish.py's
            measurement, reused: a real engine decoding batch 8 while versions arrive into its
            `staging_buffers`, as a sampler's receiver writes them), and its RSS.

Prints a table, writes docs/img/scale_time.png and docs/img/scale_memory.png (--plots DIR), and ends with
one JSON line: params, publish_vs_raw, delta_bytes_frac, sampler_rss_over_weights,
learner_rss_over_weights and the rest of the measurements.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))  # the sibling benchmarks this one reuses

from deepspeed_publish import PeakRSS, rss  # noqa: E402
from weight_publish import Worker, random_weights  # noqa: E402

from megarl.protocols import GenerationRequest, SamplingParams  # noqa: E402

GB = 1e9
QWEN = dict(model_type="qwen2", vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
            rope_theta=1000000.0, max_position_embeddings=4096)
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960),
    "qwen2.5-1.5b-8L": dict(hidden_size=1536, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=2,
                            intermediate_size=8960),
    # For the test: every part's code path in seconds.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
}
ROWS, LENGTH, PROMPT = 2, 64, 16  # the learner's batch: 2 x 64 tokens, loss on the last 48 of each
LR = 1e-6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# What was left out, and why (printed with the plan and the results, and in docs/benchmarks.md).
LEFT_OUT = [
    "learner on the whole 1.5B shape: fp32 + Adam is >= 16 B/param = 24.7 GB on one rank (12.3 GB on each "
    "of 2 TP ranks, 24.7 GB together), more than the 24 GiB this machine has; measured on qwen2.5-1.5b-8L "
    "(8 of its 28 layers, 608M) instead",
    "DeepSpeed at dp=2: ZeRO-3 on 0.5B peaked at 11.7 GB per rank in one run while developing this (23.4 GB "
    "for the two ranks: its reduce bucket is 5e8 elements = 2 GB fp32, and the step gathers whole layers), "
    "too close to this machine's memory to run routinely next to other jobs; ZeRO-1/2 at dp=2 (not measured) "
    "keep the whole model on each rank (12-14 B/param by the theory, + the buckets). DeepSpeed is measured at dp=1, ZeRO-1 (one process), "
    "on 0.5B only: it peaks at ~29 B/param, 17.6 GB on the 1.5b-8L shape",
    "engine in fp32 on the 1.5B shape: weights + a staged version + the next one arriving = 3 x 6.2 GB; "
    "the 1.5B engine runs bf16 (3 x 3.1 GB)",
    "publish of the 1.5B shape in fp32: 2 staging sets on the receiver (2 x 6.2 GB) + its raw-broadcast "
    "buffer (6.2 GB) + the source's 6.2 GB = 24.7 GB; measured in bf16 (as publish.dtype=bfloat16 sends it), "
    "1 receiver only (2 receivers: 21.6 GB)",
    "swap stall of a receiving sampler on the 1.5B shape: engine + 2 staging sets + staged versions ~ 17 GB "
    "with the source; measured on 0.5B",
]


def hf_config(shape: str) -> dict:
    return {**QWEN, **SHAPES[shape]}


def num_params(shape: str) -> int:
    from megarl.sampler.model import ModelSpec

    return sum(math.prod(s) for s in ModelSpec.from_hf_config(hf_config(shape)).weight_shapes().values())


def cast(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors in `dtype`, each converted and its fp32 original dropped as it goes (peak: W + one tensor)."""
    for name in list(weights):
        weights[name] = weights[name].to(dtype)
    return weights


def rss_kinds() -> dict[str, int]:
    """This process's resident bytes by kind (anonymous memory; file pages, e.g. an mmapped checkpoint)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith("Rss"))
    return {k[3:].lower(): int(v.split()[0]) * 1024 for k, v in fields.items()}


def load() -> float:
    return round(os.getloadavg()[0], 2)


# ------------------------------------------------------------------------------------------ part: model dir
def build_model_dir(shape: str, path: Path) -> dict:
    """An HF Qwen2 directory (config.json + model.safetensors, fp32) with weight_publish's random weights."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    if (path / "model.safetensors").is_file():
        return {"dir": str(path), "built": False}
    partial = path.with_name(path.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    Qwen2Config(**{k: v for k, v in hf_config(shape).items() if k != "model_type"}).save_pretrained(partial)
    save_file(random_weights(hf_config(shape), seed=0), partial / "model.safetensors", metadata={"format": "pt"})
    partial.rename(path)
    return {"dir": str(path), "built": True}


# ------------------------------------------------------------------------------------------ part: learner
def train_batch(vocab: int, version: int):
    from megarl.protocols import TrainBatch

    g = torch.Generator().manual_seed(version)
    mask = (torch.arange(LENGTH) >= PROMPT).float().expand(ROWS, LENGTH)
    # Behaviour log-probs of a random-weight model's near-uniform output: ratios ~1, inside the clip, so
    # every token has a gradient (a far-off behaviour would clip them all and Adam would not move).
    return TrainBatch(input_ids=torch.randint(0, vocab, (ROWS, LENGTH), generator=g), loss_mask=mask,
                      behaviour_logprobs=-math.log(vocab) * mask, versions=torch.where(mask > 0, version, -1),
                      advantages=torch.tensor([[1.0], [-1.0]]) * mask, learner_version=version)


def bf16_publish_words(learner) -> torch.Tensor:
    """The bf16 words of what the learner publishes (its HF-named fp32 tensors, rounded)."""
    return torch.cat([t.reshape(-1).to(torch.bfloat16) for _, t in learner.publish_tensors()])


def delta_measure(learner, vocab: int) -> dict:
    """Consecutive versions k, k+1 (k >= 1: past Adam's first, full-size move): changed bf16 words and the
    bytes megarl's delta publish sends for them, as a fraction of a full bf16 publish."""
    from delta_fraction import megarl_delta_bytes

    old = bf16_publish_words(learner)
    learner.train_step(train_batch(vocab, learner.version))
    new = bf16_publish_words(learner)
    start = time.perf_counter()
    sent = megarl_delta_bytes(new, old)
    encode_s = time.perf_counter() - start
    return {"versions": [learner.version - 1, learner.version], "words": new.numel(),
            "changed_frac": round(float((new.view(torch.int16) != old.view(torch.int16)).float().mean()), 5),
            "delta_bytes_frac": round(sent / (2 * new.numel()), 5), "encode_s": round(encode_s, 2)}


def learner_worker(args) -> None:
    import torch.distributed as dist

    from megarl.algo.config import LossConfig
    from megarl.config.schema import DeepSpeedConfig, LearnerConfig

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = hf_config(args.shape)["vocab_size"]
    gc.collect()
    base = rss()
    start = time.perf_counter()
    with PeakRSS() as build_peak:
        if args.backend == "megatron":
            from megarl.learner.megatron import MegatronLearner

            cfg = LearnerConfig(tp=world, micro_batch_size=ROWS, lr=LR)
            learner = MegatronLearner(args.model_dir, cfg, LossConfig())
            local = sum(p.numel() for p in learner.gpt.parameters())
        else:
            from megarl.learner.deepspeed import DeepSpeedLearner

            cfg = LearnerConfig(backend="deepspeed", dp=world, micro_batch_size=ROWS, lr=LR,
                                deepspeed=DeepSpeedConfig(zero_stage=args.zero_stage))
            learner = DeepSpeedLearner(args.model_dir, cfg, LossConfig())
            local = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in learner.module.parameters())
            local //= world if args.zero_stage == 3 else 1  # ZeRO-3: each rank holds 1/N of the parameters
    build_s = time.perf_counter() - start
    gc.collect()
    built = rss() - base
    steps = []
    with PeakRSS() as step_peak:
        for _ in range(1 + args.steps):  # the first is a warm-up
            start = time.perf_counter()
            metrics = learner.train_step(train_batch(vocab, learner.version))
            steps.append(time.perf_counter() - start)
            if metrics["skipped_nonfinite"]:
                raise RuntimeError(f"rank {rank}: the step was skipped (non-finite loss or grad norm): {metrics}")
    gc.collect()
    result = {"rank": rank, "world": world, "base_rss": base, "build_s": round(build_s, 2),
              "build_peak": build_peak.peak - base, "built": built, "step_peak": step_peak.peak - base,
              "after_step": rss() - base, "after_step_kinds": rss_kinds(), "step_s": [round(s, 3) for s in steps],
              "local_params": local,
              "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "load": load()}
    if args.delta and world == 1:
        result["delta"] = delta_measure(learner, vocab)
    results = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        Path(args.result).write_text(json.dumps(results))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ part: engine
def engine_part(args) -> dict:
    """Tokens/s vs batch, RSS by what the engine holds, and the in-process swap stall (see the docstring)."""
    from megarl.sampler.engine import BuiltinEngine
    from megarl.sampler.model import KVCache
    from sampler_throughput import make_prompts, timed

    torch.set_num_threads(1)
    cfg, dtype = hf_config(args.shape), DTYPES[args.dtype]
    batches, new_tokens = args.batches, args.new_tokens
    max_seq_len = PROMPT + max(new_tokens, 64) + 1  # room for the stall's 64 decode steps
    gc.collect()
    base = rss()
    out = {"shape": args.shape, "dtype": args.dtype, "params": num_params(args.shape),
           "weight_bytes": num_params(args.shape) * dtype.itemsize, "max_running": max(batches),
           "max_seq_len": max_seq_len, "load": [load()]}
    engine = BuiltinEngine(cfg, cast(random_weights(cfg, seed=0), dtype), max_running=max(batches),
                           max_seq_len=max_seq_len)
    gc.collect()
    held = rss() - base
    before = rss()
    cache = KVCache(engine.spec, max(batches), max_seq_len, dtype)  # the engine's own, measured alone
    out["kv_cache"] = rss() - before
    del cache
    gc.collect()
    out["weights"] = held - out["kv_cache"]
    # The next version as a caller of stage_weights hands it over (one flat set here): the engine copies it
    # into a weight arena of its own (the replaced version's, once there is one) and lets go of the tensors.
    before = rss()
    flat, second = flat_weights(cfg, dtype, seed=1)
    out["staging_buffers"] = rss() - before
    engine.stage_weights(second, 1)
    del flat, second
    gc.collect()
    out["staging_set"] = rss() - before  # what the staged version holds once the caller let go of it
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens)

    def run(batch: int, seed: int):
        prompts = make_prompts(batch, cfg["vocab_size"], seed)

        def go() -> int:
            done = engine.generate([GenerationRequest(f"{seed}-{i}", p, sampling) for i, p in enumerate(prompts)])
            return sum(len(c.token_ids) for c in done)
        return go

    with PeakRSS() as peak:
        run(1, 99)()  # warm-up; its first step swaps version 1 in (version 0 is kept, retired, until the next stage)
        out["tok_s"], out["cpu_tok_s"] = {}, {}
        for batch in batches:
            rounds = [timed(run(batch, seed)) for seed in range(args.reps)]
            out["tok_s"][batch] = round(statistics.median(t / wall for t, wall, _ in rounds), 2)
            out["cpu_tok_s"][batch] = round(statistics.median(t / cpu for t, _, cpu in rounds), 2)
    out["peak"] = peak.peak - base  # weights + the retired version + KV + the decode's activations
    _, third = flat_weights(cfg, dtype, seed=2)
    with PeakRSS() as peak:
        out["stall"] = staging_stall(engine, third, max(batches))
    out["stall_peak"] = peak.peak - base  # + the version being staged
    out["load"].append(load())
    return out


def staging_stall(engine, weights: dict, batch: int) -> dict:
    """Decode `batch` sequences; after 4 steps stage a new version on another thread (as a receiver thread
    calls stage_weights); the step after it is staged swaps it in. Lost decode time = the steps from the
    staging's start to the swap, over the median of the steps before it."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=engine.max_seq_len - PROMPT - 1)
    for i in range(batch):
        engine.add_request(GenerationRequest(f"stall-{i}", list(range(1, PROMPT + 1)), sampling))
    engine.step()  # admission (prefill)
    times, staged_at, swap_index, stage_s = [], None, None, [0.0]

    def stage():
        start = time.perf_counter()
        engine.stage_weights(weights, engine.version + 1)
        stage_s[0] = time.perf_counter() - start

    stager = threading.Thread(target=stage)
    swaps, swap_time = engine.stats()["swaps"], engine.stats()["swap_time_s"]
    while engine.num_unfinished and (swap_index is None or len(times) < swap_index + 4):
        if len(times) == 4:
            staged_at = len(times)
            stager.start()
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        if swap_index is None and engine.stats()["swaps"] > swaps:
            swap_index = len(times) - 1
    stager.join()
    if swap_index is None:
        return {"error": "the staged version was not swapped in before the sequences ended"}
    baseline = statistics.median(times[:staged_at])
    lost = sum(t - baseline for t in times[staged_at:swap_index + 1])
    return {"baseline_step_s": round(baseline, 4), "steps_until_swap": swap_index + 1 - staged_at,
            "stage_weights_s": round(stage_s[0], 3), "lost_s": round(lost, 3), "lost_steps": round(lost / baseline, 2),
            "swap_ms": round(1e3 * (engine.stats()["swap_time_s"] - swap_time), 3)}


# ------------------------------------------------------------------------------------------ part: publish
def flat_weights(cfg: dict, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Random HF-named weights as views of one flat buffer: the raw broadcast sends that buffer, the publish
    its views, so the source holds one copy of the bytes for both."""
    from megarl.sampler.model import ModelSpec

    shapes = ModelSpec.from_hf_config(cfg).weight_shapes()
    flat = torch.empty(sum(math.prod(s) for s in shapes.values()), dtype=dtype)
    gen, views, offset = torch.Generator().manual_seed(seed), {}, 0
    for name, shape in shapes.items():
        view = flat[offset:offset + math.prod(shape)].view(shape)
        offset += view.numel()
        views[name] = view.fill_(1.0) if name.endswith("norm.weight") else view.normal_(0.0, 0.02, generator=gen)
    return flat, views


class PublishWorker(Worker):
    """weight_publish.py's worker (its store, publish group, publisher / receiver builders and swap-stall
    measurement) on one shape in one dtype; the transfers measured are raw vs publish with checksums on,
    and receivers hold only the spec (meta tensors), their staging sets and the raw buffer (3x the weights),
    so the 0.5B fp32 cell fits with 2 receivers."""

    def __init__(self, args):
        super().__init__(Path(args.result).parent, sizes=[], reps=args.reps, bucket_mb=16.0)
        self.args, self.cfg, self.dtype = args, hf_config(args.shape), DTYPES[args.dtype]

    def run(self) -> None:
        args, me = self.args, {"rank": self.rank}
        gc.collect()
        me["base_rss"] = base = rss()
        if self.rank == 0:
            flat, weights = flat_weights(self.cfg, self.dtype, seed=0)
        else:
            weights = self._meta_spec()
            flat = torch.empty(sum(t.numel() for t in weights.values()), dtype=self.dtype)
        with PeakRSS() as peak:
            times = self.transfers(flat, weights)
        me["transfer_peak"] = peak.peak - base
        del flat
        if args.stall:
            if self.rank > 0:
                weights = cast(random_weights(self.cfg, seed=self.rank), self.dtype)
            gc.collect()
            me["stall_dict"] = rss() - base  # rank 0: its weights; a receiver: the engine's initial weights
            with PeakRSS() as peak:
                me["stall"] = self.stall(args.shape, self.cfg, weights)
            me["stall_peak"] = peak.peak - base
        me["load"] = load()
        self.store.set(f"scale/report/{self.rank}", json.dumps(me))
        if self.rank == 0:
            self.wait_receivers("scale/reported")
            reports = [me] + [json.loads(self.store.get(f"scale/report/{r}")) for r in range(1, self.world)]
            nbytes = sum(t.numel() for t in weights.values()) * self.dtype.itemsize
            Path(args.result).write_text(json.dumps({"bytes": nbytes, "seconds": times, "ranks": reports}))
        else:
            self.store.set(f"bench/scale/reported/{self.rank}", "1")

    def _meta_spec(self) -> dict[str, torch.Tensor]:
        from megarl.sampler.model import ModelSpec

        return {n: torch.empty(s, dtype=self.dtype, device="meta")
                for n, s in ModelSpec.from_hf_config(self.cfg).weight_shapes().items()}

    def transfers(self, flat: torch.Tensor, weights: dict) -> dict[str, list[float]]:
        """Seconds on rank 0 from a store barrier until every receiver reported the bytes received, per round
        of (raw broadcast of `flat`, publish of `weights`); the first 2 rounds are not kept (the first two
        publishes land in fresh staging sets)."""
        warmup, prefix, stop = 2, f"bench/scale/{self.args.shape}/", threading.Event()
        publisher = self._publisher(prefix, checksum=True) if self.rank == 0 else None
        receiver = None
        if self.rank > 0:
            def done(version, tensors, extra):  # on the receiver thread: its own store connection
                self.receiver_store.set(f"bench/publish/{version}/done/{self.rank}", "1")
            receiver = self._bandwidth_receiver(prefix, weights, done, stop)

        def raw(version: int) -> None:
            self.group.broadcast(flat, 0).wait()
            if self.rank > 0:
                self.store.set(f"bench/raw/{version}/done/{self.rank}", "1")

        def publish(version: int) -> None:
            if self.rank == 0:
                publisher.publish(version, weights.items())

        seconds: dict[str, list[float]] = {"raw": [], "publish": []}
        for version in range(1, warmup + self.reps + 1):
            for name, transfer in (("raw", raw), ("publish", publish)):
                self.barrier(f"{name}/{version}/start")
                start = time.monotonic()
                transfer(version)
                if self.rank == 0:
                    self.wait_receivers(f"{name}/{version}/done")
                    if version > warmup:
                        seconds[name].append(round(time.monotonic() - start, 4))
        self.barrier("transfers/end")
        stop.set()
        if receiver is not None:
            receiver.thread.join(60)
            if receiver.error:
                raise receiver.error
        return seconds


def publish_worker(args) -> None:
    torch.set_num_threads(1)
    PublishWorker(args).run()


# ------------------------------------------------------------------------------------------ driver
class Part:
    """One measurement: a command run under a timeout in its own process group (a timeout kills the whole
    group: torchrun and its workers), its memory need checked against MemAvailable first. `script`: the
    benchmark whose `--part kind` runs it (this one, or one that reuses this driver, e.g. lora_costs.py)."""

    def __init__(self, name: str, kind: str, shape: str, argv: list[str], nproc: int, need_gb: float,
                 timeout_s: float, script: Path = Path(__file__).resolve(), **info):
        self.name, self.kind, self.shape, self.argv, self.nproc = name, kind, shape, argv, nproc
        self.need_gb, self.timeout_s, self.script, self.info = need_gb, timeout_s, script, info

    def command(self, result: Path) -> list[str]:
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}"]
                    if self.nproc > 1 or self.kind in ("learner", "publish") else [sys.executable])
        return [*launcher, str(self.script), "--part", self.kind, "--shape", self.shape,
                "--result", str(result), *self.argv]


def mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024 / GB


def run_part(part: Part, out: Path) -> dict:
    """The part's result JSON, or {"error": ...} saying why there is none (skipped, timed out, failed)."""
    result = out / f"{part.name}.json"
    result.unlink(missing_ok=True)
    available = mem_available_gb()
    if part.need_gb > available - 1.0:
        return {"error": f"skipped: needs ~{part.need_gb:.1f} GB, {available:.1f} GB available"}
    # Every allocation over 64 KiB mmapped and unmapped when freed: RSS follows live tensors (as in
    # deepspeed_publish.py). One torch thread per process, as the other benchmarks.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    start, load_before = time.monotonic(), load()
    proc = subprocess.Popen(part.command(result), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=part.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return {"error": f"timed out after {part.timeout_s:.0f} s; stderr tail:\n{stderr[-3000:]}"}
    seconds = round(time.monotonic() - start, 1)
    if proc.returncode != 0 or not result.is_file():
        return {"error": f"exit {proc.returncode} after {seconds} s; stderr tail:\n{stderr[-6000:]}\n{stdout[-2000:]}"}
    return {"result": json.loads(result.read_text()), "seconds": seconds, "load": [load_before, load()]}


def plan(args) -> list[Part]:
    small = "tiny" if args.tiny else "qwen2.5-0.5b"
    steps = ["--steps", "1" if args.tiny else "2"]
    learner_shapes = [small] if args.quick or args.tiny else [small, "qwen2.5-1.5b-8L"]
    parts = []
    for shape in learner_shapes:
        p = num_params(shape)
        model = ["--model-dir", str(Path(args.out) / "models" / shape)]
        parts.append(Part(f"build_{shape}", "build", shape, model, 1, 4 * p * 2 / GB + 1, 600))
        parts += [
            Part(f"learner_megatron_tp1_{shape}", "learner", shape,
                 [*model, *steps, "--backend", "megatron", *(["--delta"] if shape == small else [])], 1,
                 20 * p / GB + 1, 1200, role="megatron TP1", ranks=1, minimum_bpp=16.0),
            Part(f"learner_megatron_tp2_{shape}", "learner", shape, [*model, *steps, "--backend", "megatron"], 2,
                 2 * 10.5 * p / GB + 2, 1200, role="megatron TP2", ranks=2, minimum_bpp=8.0),
        ]
        if shape == small:  # DeepSpeed at dp=1 peaks at ~29 B/param (see LEFT_OUT): 17.6 GB at 1.5b-8L
            parts.append(Part(f"learner_deepspeed_z1_{shape}", "learner", shape,
                              [*model, *steps, "--backend", "deepspeed", "--zero-stage", "1"], 1, 30 * p / GB + 1,
                              1500, role="DeepSpeed ZeRO-1 dp1", ranks=1, minimum_bpp=16.0))
    engine_cells = [(small, "fp32"), (small, "bf16")] + ([] if args.quick or args.tiny else [("qwen2.5-1.5b", "bf16")])
    for shape, dtype in engine_cells:
        w = num_params(shape) * DTYPES[dtype].itemsize
        parts.append(Part(f"engine_{dtype}_{shape}", "engine", shape,
                          ["--dtype", dtype, "--new-tokens", str(args.new_tokens), "--reps", "1" if args.tiny else "2",
                           "--batches", *map(str, args.batches)], 1, (3.5 * w) / GB + 1, 1200, dtype=dtype))
    publish_cells = [(small, "fp32", 1, True)]
    if not (args.quick or args.tiny):
        publish_cells += [(small, "fp32", 2, False), (small, "bf16", 1, False), (small, "bf16", 2, False),
                          ("qwen2.5-1.5b", "bf16", 1, False)]
    for shape, dtype, receivers, stall in publish_cells:
        w = num_params(shape) * DTYPES[dtype].itemsize
        need = (1 + (4.5 if stall else 3) * receivers) * w  # the transfers, then the stall, not both at once
        parts.append(Part(f"publish_{dtype}_r{receivers}_{shape}", "publish", shape,
                          ["--dtype", dtype, "--reps", "1" if args.tiny else str(args.publish_reps),
                           *(["--stall"] if stall else [])], 1 + receivers, need / GB + 1 + receivers, 900,
                          dtype=dtype, receivers=receivers))
    return parts


def summarise(parts: list[Part], results: dict[str, dict]) -> dict:
    """The rows of the table and the headline JSON from the parts' results."""
    rows, head = [], {"params": {}, "publish_vs_raw": {}, "delta_bytes_frac": None, "sampler_rss_over_weights": {},
                      "learner_rss_over_weights": {}, "learner_step_s": {}, "learner_bytes_per_param": {},
                      "engine_tok_s": {}, "swap_stall": {}, "publish_s": {}, "errors": {}}
    for part in parts:
        res = results.get(part.name)
        if part.kind == "build" or res is None:
            continue
        if "error" in res:
            head["errors"][part.name] = res["error"].splitlines()[0]
            rows.append([part.name, part.shape, "", "not measured: " + res["error"].splitlines()[0], "", "", ""])
            continue
        r, p = res["result"], num_params(part.shape)
        head["params"][part.shape] = p
        if part.kind == "learner":
            step = statistics.median(min(rank["step_s"][1:] or rank["step_s"]) for rank in r)
            peak = max(rank["step_peak"] for rank in r)
            weights = max(4 * rank["local_params"] for rank in r)
            key = f"{part.info['role']} {part.shape}"
            head["learner_step_s"][key] = round(step, 2)
            head["learner_rss_over_weights"][key] = round(peak / weights, 2)
            head["learner_bytes_per_param"][key] = {"measured": round(peak / p, 2), "minimum": part.info["minimum_bpp"],
                                                    "components": learner_components(r, p)}
            rows.append([part.info["role"], part.shape, f"{p / 1e6:.0f}M",
                         f"step {step:.2f} s (build {max(rank['build_s'] for rank in r):.0f} s)",
                         f"{peak / GB:.2f} GB/rank (built {max(rank['built'] for rank in r) / GB:.2f})",
                         f"{peak / p:.1f} B/param", f"{part.info['minimum_bpp']:.0f} B/param"])
            delta = r[0].get("delta")
            if delta:
                head["delta_bytes_frac"] = delta["delta_bytes_frac"]
                head["delta"] = delta
                rows.append(["delta publish (bf16)", part.shape, f"{p / 1e6:.0f}M",
                             f"v{delta['versions'][0]}->v{delta['versions'][1]}: {100 * delta['changed_frac']:.2f}% "
                             f"words changed; encode {delta['encode_s']:.2f} s",
                             f"{delta['delta_bytes_frac']:.3f} of the bf16 bytes", "", ""])
        elif part.kind == "engine":
            key = f"{part.shape} {r['dtype']}"
            w, stall = r["weight_bytes"], r["stall"]
            head["sampler_rss_over_weights"][f"engine {key}"] = round(r["peak"] / w, 2)
            head["engine_tok_s"][key] = r["tok_s"]
            head["swap_stall"][f"engine {key} (stage_weights on a thread)"] = stall
            tok = ", ".join(f"b{b}: {v:.1f}" for b, v in r["tok_s"].items())
            rows.append([f"engine {r['dtype']}", part.shape, f"{p / 1e6:.0f}M", f"tok/s {tok}",
                         f"decode peak {r['peak'] / GB:.2f} GB: weights {r['weights'] / GB:.2f}, staged set "
                         f"{r['staging_set'] / GB:.2f} (received as {r['staging_buffers'] / GB:.2f}), KV "
                         f"{r['kv_cache'] / GB:.3f}; staging another: {r['stall_peak'] / GB:.2f}",
                         f"{r['peak'] / p:.1f} B/param", f"{2 * DTYPES[r['dtype']].itemsize} B/param (w + staged)"])
            if "error" not in stall:
                rows.append([f"swap stall, engine {r['dtype']}", part.shape, f"{p / 1e6:.0f}M",
                             f"stage_weights {stall['stage_weights_s']:.2f} s on a thread; "
                             f"lost {stall['lost_s']:.2f} s "
                             f"= {stall['lost_steps']:.2f} decode steps (step {stall['baseline_step_s']:.3f} s); "
                             f"swap {stall['swap_ms']:.3f} ms", "", "", ""])
        elif part.kind == "publish":
            key = f"{part.shape} {part.info['dtype']} r{part.info['receivers']}"
            raw, pub = r["seconds"]["raw"], r["seconds"]["publish"]
            ratio = statistics.median(a / b for a, b in zip(raw, pub))
            head["publish_vs_raw"][key] = round(ratio, 3)
            head["publish_s"][key] = {"publish": statistics.median(pub), "raw": statistics.median(raw),
                                      "bytes": r["bytes"]}
            receiver_peak = max(rank["transfer_peak"] for rank in r["ranks"][1:])
            rows.append([f"publish {part.info['dtype']}, {part.info['receivers']} recv", part.shape,
                         f"{p / 1e6:.0f}M", f"{statistics.median(pub):.2f} s vs raw {statistics.median(raw):.2f} s "
                         f"({r['bytes'] / GB:.2f} GB): {ratio:.2f} of raw",
                         f"source {r['ranks'][0]['transfer_peak'] / GB:.2f} GB, receiver {receiver_peak / GB:.2f} GB",
                         f"recv {receiver_peak / p:.1f} B/param",
                         f"recv {2 * DTYPES[part.info['dtype']].itemsize} B/param (2 sets)"])
            stalled = r["ranks"][1].get("stall")
            if stalled is not None:
                rec = r["ranks"][1]
                s = r["ranks"][0]["stall"]["receivers"][0]
                net = rec["stall_peak"] - rec["stall_dict"]
                w = p * DTYPES[part.info["dtype"]].itemsize
                head["swap_stall"][f"receiving sampler {key}"] = s
                head["sampler_rss_over_weights"][f"receiving sampler {key}"] = round(net / w, 2)
                rows.append(["swap stall, receiving sampler", part.shape, f"{p / 1e6:.0f}M",
                             f"{s['stall_steps_per_update']:.2f} decode steps lost per update (step "
                             f"{s['baseline_step_ms'] / 1e3:.3f} s); receive CPU {s['receive_cpu_steps']:.2f} steps; "
                             f"swap {s['swap_ms']:.3f} ms",
                             f"sampler {rec['stall_peak'] / GB:.2f} GB peak ({net / GB:.2f} without the initial "
                             f"weight dict)", f"{net / p:.1f} B/param", ""])
    head["rows"] = rows
    return head


def learner_components(ranks: list[dict], params: int) -> dict:
    """The step peak of the rank that peaks highest, in bytes per parameter of the whole model, split into
    what the theory's 16 B/param (fp32 params 4, gradients 4, Adam m and v 8) names, each with its
    theoretical share (divided by the ranks that divide it): the parameters (4 B per local parameter, exact),
    the rest of what building the learner allocated (megatron: DDP's gradient buffer; DeepSpeed ZeRO-1: its
    fp32 master copy, the gradients come later), what the first step added for good (Adam's m and v;
    DeepSpeed: + its gradients) and the step's transients on top (activations, logits, optimizer temporaries)."""
    rank = max(ranks, key=lambda r: r["step_peak"])
    local, share = rank["local_params"], rank["local_params"] / params
    measured = {"params": 4 * local, "built_rest": rank["built"] - 4 * local,
                "optimizer_state": rank["after_step"] - rank["built"], "step_transients": rank["step_peak"] - rank["after_step"]}
    theory = {"params": 4 * share, "built_rest": 4 * share, "optimizer_state": 8 * share, "step_transients": 0.0}
    return {name: {"measured": round(measured[name] / params, 2), "theory": round(theory[name], 2)} for name in measured}


def print_table(rows: list[list[str]]) -> None:
    header = ["role", "shape", "params", "time", "memory (RSS over base)", "measured", "minimum"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths]] + rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(row, widths)))


def plot(parts: list[Part], results: dict[str, dict], directory: Path) -> list[Path]:
    """scale_time.png: seconds vs parameters, one panel per role; scale_memory.png: GB per process vs parameters,
    one panel per role (dashed: that role's minimum), and bytes per parameter on the first shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    time_panels = {"learner: one optimizer step (2 x 64 tokens)": {}, "engine: one decode step": {},
                   "publish: one version, until every receiver has it": {}}
    memory_panels = {"learner: per rank": {}, "sampler (engine) process": {}, "publish: per process": {}}
    learner_t, engine_t, publish_t = time_panels.values()
    learner_m, sampler_m, publish_m = memory_panels.values()
    bpp: dict[str, tuple[float, float]] = {}

    def add(panel: dict, label: str, x: int, y: float, minimum: float | None = None) -> None:
        line = panel.setdefault(label, {"x": [], "y": [], "min": []})
        line["x"].append(x / 1e9)
        line["y"].append(y)
        line["min"].append(minimum)

    for part in parts:
        res = results.get(part.name, {})
        if part.kind == "build" or "result" not in res:
            continue
        r, p = res["result"], num_params(part.shape)
        first = part.shape == parts[0].shape
        if part.kind == "learner":
            role = part.info["role"]
            peak = max(k["step_peak"] for k in r)
            add(learner_t, role, p, statistics.median(min(k["step_s"][1:] or k["step_s"]) for k in r))
            add(learner_m, f"{role}, step peak", p, peak / GB, part.info["minimum_bpp"] * p / GB)
            if first:
                bpp["learner\n" + role.replace(" ", "\n", 1)] = (peak / p, part.info["minimum_bpp"])
        elif part.kind == "engine":
            d, w = r["dtype"], r["weight_bytes"]
            for b, tok_s in r["tok_s"].items():
                add(engine_t, f"{d}, batch {b}", p, int(b) / tok_s)
            add(sampler_m, f"engine {d}: decode peak", p, r["peak"] / GB, 2 * w / GB)
            add(sampler_m, f"engine {d}: while staging the next version", p, r["stall_peak"] / GB)
            if first:
                bpp[f"engine\n{d}"] = (r["peak"] / p, 2 * DTYPES[d].itemsize)
        elif part.kind == "publish":
            d, receivers = part.info["dtype"], part.info["receivers"]
            w = p * DTYPES[d].itemsize
            add(publish_t, f"WeightPublisher, {d}, {receivers} recv", p, statistics.median(r["seconds"]["publish"]))
            add(publish_t, f"raw broadcast, {d}, {receivers} recv", p, statistics.median(r["seconds"]["raw"]))
            add(publish_m, f"receiver, {d}, {receivers} recv (2 staging sets + raw buffer)", p,
                max(k["transfer_peak"] for k in r["ranks"][1:]) / GB, 3 * w / GB)
            add(publish_m, f"source, {d}, {receivers} recv", p, r["ranks"][0]["transfer_peak"] / GB, w / GB)
            stall = r["ranks"][1].get("stall_peak")
            if stall is not None:
                net = stall - r["ranks"][1]["stall_dict"]
                add(sampler_m, f"receiving sampler {d} (engine + receiver)", p, net / GB, 2 * w / GB)
                if first:
                    bpp[f"receiving\nsampler {d}"] = (net / p, 2 * DTYPES[d].itemsize)
    directory.mkdir(parents=True, exist_ok=True)

    def draw(ax, panel: dict, title: str, ylabel: str) -> None:
        for i, (label, line) in enumerate(panel.items()):  # markers differ too: equal values stay visible
            style = {"marker": "os^Dvp"[i % 6], "markersize": 9 - i % 6, "color": f"C{i}"}
            ax.plot(line["x"], line["y"], label=label, **style)
            if any(m is not None for m in line["min"]):
                ax.plot(line["x"], line["min"], ls="--", marker="x", color=f"C{i}", alpha=0.7)
        ax.set(title=title, xlabel="parameters (billions)", ylabel=ylabel)
        ax.set_xlim(0, 1.7)
        top = max([y for line in panel.values() for y in line["y"] + line["min"] if y is not None], default=1)
        ax.set_ylim(0, 1.1 * top)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)  # below: hides no point

    written = []
    fig, axes = plt.subplots(1, 3, figsize=(16, 6.5))
    for ax, (title, panel) in zip(axes, time_panels.items()):
        draw(ax, panel, title, "seconds")
    fig.suptitle("Time vs model size per role (CPU, 2 cores shared, 1 torch thread per process)")
    fig.tight_layout()
    written.append(directory / "scale_time.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(2, 2, figsize=(14, 12))
    axes = axes.flatten()
    for ax, (title, panel) in zip(axes, memory_panels.items()):
        draw(ax, panel, title + " (dashed: minimum)", "GB (peak RSS over the RSS before the model)")
    bx, names = axes[3], list(bpp)
    bx.bar([i - 0.2 for i in range(len(names))], [bpp[n][0] for n in names], width=0.4, label="measured (peak)")
    bx.bar([i + 0.2 for i in range(len(names))], [bpp[n][1] for n in names], width=0.4, label="minimum")
    bx.set_xticks(range(len(names)), names, fontsize=8)
    bx.set(ylabel="bytes per parameter (of the whole model)", title=f"bytes per parameter, {parts[0].shape}")
    bx.grid(True, axis="y", alpha=0.3)
    bx.legend(fontsize=8)
    fig.suptitle("Memory vs model size per role. Minimum: learner fp32 params + grads + Adam = 16 B/param\n"
                 "(/ TP ranks); sampler: weights + one staged version; publish receiver: 2 staging sets + the raw "
                 "buffer")
    fig.tight_layout()
    written.append(directory / "scale_memory.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 0.5B shape only, 1 receiver")
    parser.add_argument("--tiny", action="store_true", help="every part on a tiny shape (the test)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and what is left out; run nothing")
    parser.add_argument("--only", nargs="+", default=None, help="run only the parts whose name has one of these")
    parser.add_argument("--out", default="runs/scale")
    parser.add_argument("--plots", default=str(REPO / "docs" / "img"), help="where the PNGs go ('' = none)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--publish-reps", type=int, default=3)
    parser.add_argument("--from-results", help="print and plot a previous run's results.json; run nothing")
    # a part's own arguments (the driver passes them)
    parser.add_argument("--part", choices=["build", "learner", "engine", "publish"], help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=sorted(SHAPES), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=["megatron", "deepspeed"], help=argparse.SUPPRESS)
    parser.add_argument("--zero-stage", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--delta", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--stall", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=900, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        from megarl.distributed.lifetime import run_then_exit

        if args.part in ("build", "engine"):
            part = (lambda: build_model_dir(args.shape, Path(args.model_dir))) if args.part == "build" else \
                (lambda: engine_part(args))
            run_then_exit(lambda: Path(args.result).write_text(json.dumps(part())))
        run_then_exit(lambda: (learner_worker if args.part == "learner" else publish_worker)(args))

    parts = plan(args)
    if args.only:
        parts = [p for p in parts if any(o in p.name for o in args.only) or p.kind == "build"]
    print(f"torch {torch.__version__}; {os.cpu_count()} cores; MemAvailable {mem_available_gb():.1f} GB; "
          f"load {os.getloadavg()}")
    if args.dry_run:
        for part in parts:
            print(f"  {part.name:42s} {part.nproc} process(es), needs ~{part.need_gb:5.1f} GB, "
                  f"timeout {part.timeout_s:.0f} s")
    print("left out:" + "".join(f"\n  - {line}" for line in LEFT_OUT))
    if args.dry_run:
        print(json.dumps({"plan": [p.name for p in parts], "params": {p.shape: num_params(p.shape) for p in parts}}))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started, results = time.monotonic(), {}
    if args.from_results:
        results = json.loads(Path(args.from_results).read_text())
        parts = [p for p in parts if p.name in results]
    for part in parts:
        if part.name in results:  # skipped: its model directory could not be built
            continue
        print(f"[{time.monotonic() - started:6.0f} s] {part.name} (load {load()}, "
              f"MemAvailable {mem_available_gb():.1f} GB) ...", flush=True)
        results[part.name] = res = run_part(part, out)
        if "error" in res:
            print(f"    NOT MEASURED: {res['error']}", flush=True)
            if part.kind == "build":  # the learner parts of that shape need the directory
                for later in parts:
                    if later.kind == "learner" and later.shape == part.shape:
                        results[later.name] = {"error": f"skipped: {part.name} failed"}
        else:
            print(f"    {res['seconds']} s, load {res['load']}", flush=True)
    (out / "results.json").write_text(json.dumps(results))
    head = summarise(parts, results)
    print()
    print_table(head.pop("rows"))
    print("\nleft out:" + "".join(f"\n  - {line}" for line in LEFT_OUT))
    if args.plots:
        for path in plot(parts, results, Path(args.plots)):
            print(f"wrote {path}")
    head["seconds"] = round(time.monotonic() - started)
    head["load_end"] = list(os.getloadavg())
    print(json.dumps(head))


if __name__ == "__main__":
    main()
