"""DeepSpeed learner: ZeRO-3 weight publish, bucketed vs per parameter; memory per rank under ZeRO-1/2/3.

    python benchmarks/deepspeed_publish.py [--layers 12] [--bucket-mb 16] [--reps 2] [--out runs/ds_publish]

One real `torchrun` with 3 processes: ranks 0 and 1 are a DeepSpeedLearner at dp=2 (gloo, fp32, CPU)
on a random Qwen2 of ~100M parameters (vocab 32768, hidden 768, 12 layers: ~404 MB fp32), rank 2 is a
sampler receiving over a standalone gloo publish group (learner rank 0 -> sampler), as in a run.

* memory per rank, per ZeRO stage: resident memory (RSS) of each learner rank after the engine is
  built, its peak during one optimizer step (a 2 x 32-token batch, so activations are small) and
  after it (gradients are freed by then), over the RSS before the model was loaded; against the theory for fp32 with Adam (Ψ parameters,
  N = 2 ranks): params 4Ψ, grads 4Ψ, optimizer 12Ψ (DeepSpeed's fp32 master partition + m + v);
  ZeRO-1 divides the optimizer state by N, ZeRO-2 also the grads, ZeRO-3 also the params.
* publish at ZeRO-3, each timed on rank 0 until the sampler reported it has everything, and the
  peak extra RSS of each learner rank over the pattern:
  - per_param: the OpenRLHF / PipelineRL pattern: GatheredParameters([p]) then one broadcast per tensor;
  - bucketed: `publish_buckets()` (one GatheredParameters per publish bucket of `--bucket-mb`, packed
    into one flat buffer), each bucket broadcast while the next one is gathered (at most two in
    flight): what the learner's gathers give a publisher that consumes them as they come;
  - weight_publisher: megarl's WeightPublisher -> WeightReceiver as a run does (`publish_weights`):
    the learner's tensors stream against its `publish_spec()`, each bucket packed and sent as its
    tensors arrive, at most two buckets on the wire.
  - two_senders: the same with `publish.senders=2`: both learner ranks publish, each every other
    bucket over its own group (rank 1 -> sampler is a second group), the sampler merges the parts
    (StagedReceiver): two broadcasts on the wire at once instead of one.

Ends with one JSON line.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

STORE_TIMEOUT = timedelta(seconds=600)


class PeakRSS:
    """Samples this process's resident memory every 5 ms on a thread; `peak` in bytes."""

    def __init__(self):
        self.peak, self._stop = rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def theory(params: int, stage: int, n: int) -> dict[str, float]:
    """Bytes per rank of fp32 params, grads and Adam optimizer state (master + m + v) under a ZeRO stage."""
    p, g, o = 4 * params, 4 * params, 12 * params
    o /= n
    if stage >= 2:
        g /= n
    if stage >= 3:
        p /= n
    return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}


def worker(args) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from megarl.algo.config import LossConfig
    from megarl.config.schema import DeepSpeedConfig, LearnerConfig
    from megarl.protocols import TrainBatch

    rank = int(os.environ["RANK"])
    store = dist.TCPStore("127.0.0.1", args.store_port, 3, rank == 0, STORE_TIMEOUT)
    model_dir = Path(args.out) / "model"
    config = Qwen2Config(vocab_size=32768, hidden_size=768, intermediate_size=2048, num_hidden_layers=args.layers,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=True)
    if rank == 0 and not (model_dir / "model.safetensors").is_file():
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(model_dir)
    store.set(f"model_ready/{rank}", "1")
    store.wait(["model_ready/0"])
    with torch.device("meta"):
        spec_model = AutoModelForCausalLM.from_config(config)
    spec = [(n, tuple(p.shape), torch.float32) for n, p in spec_model.named_parameters()]
    num_params = sum(p.numel() for p in spec_model.parameters())
    # Sender r's group: learner rank r (group rank 0) and the sampler (rank 2).
    groups = {sender: dist.ProcessGroupGloo(dist.PrefixStore(f"publish/sender{sender}/", store),
                                            0 if rank == sender else 1, 2, STORE_TIMEOUT)
              for sender in (0, 1) if rank in (sender, 2)}
    publish_group = groups.get(0)
    results = {"params": num_params, "bucket_mb": args.bucket_mb, "memory": {}, "publish": {}}

    if rank == 2:
        receive(store, groups, spec, args)
        return
    dist.init_process_group("gloo", store=dist.PrefixStore("learners/", store), rank=rank, world_size=2,
                            timeout=STORE_TIMEOUT)
    from megarl.learner.deepspeed import DeepSpeedLearner

    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 32)
    mask[:, 8:] = 1
    batch = TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=torch.full((2, 32), -10.0) * mask,
                       versions=torch.where(mask > 0, 0, -1), advantages=torch.tensor([[1.0], [-1.0]]) * mask,
                       learner_version=0)
    for stage in (1, 2, 3):
        gc.collect()
        base = rss()
        cfg = LearnerConfig(backend="deepspeed", dp=2, micro_batch_size=2, lr=1e-5,
                            deepspeed=DeepSpeedConfig(zero_stage=stage))
        learner = DeepSpeedLearner(str(model_dir), cfg, LossConfig(), publish_bucket_mb=args.bucket_mb)
        gc.collect()
        built = rss() - base
        with PeakRSS() as peak:
            metrics = learner.train_step(batch)
        assert metrics["skipped_nonfinite"] == 0.0
        gc.collect()
        results["memory"][stage] = {"built": built, "step_peak": peak.peak - base, "after_step": rss() - base,
                                    "theory": theory(num_params, stage, 2)}
        for rep in range(args.reps):
            for pattern in STAGE_PATTERNS.get(stage, ()):
                gc.collect()
                before = rss()
                start = time.perf_counter()
                with PeakRSS() as peak:
                    PATTERNS[pattern](learner, rank, store, groups, spec, args, rep, stage)
                if rank == 0:
                    store.wait([f"received/{stage}/{pattern}/{rep}"])
                seconds = time.perf_counter() - start
                dist.barrier()
                entry = results["publish"].setdefault(f"zero{stage}/{pattern}", {"seconds": [], "peak_extra": []})
                entry["seconds"].append(seconds)
                entry["peak_extra"].append(peak.peak - before)
        del learner
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        (Path(args.out) / "results.json").write_text(json.dumps(gathered))
    dist.destroy_process_group()


def per_param(learner, rank, store, groups, spec, args, rep, stage) -> None:
    """GatheredParameters([p]) + one broadcast per tensor from rank 0 (rank 1 joins every gather)."""
    import deepspeed

    for _, param in learner.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            if rank == 0:
                groups[0].broadcast(param.data.contiguous(), 0).wait()


def bucketed(learner, rank, store, groups, spec, args, rep, stage) -> None:
    """The learner's publish buckets as they come (`publish_buckets`: one GatheredParameters per bucket,
    packed flat), each broadcast asynchronously while the next one is gathered; at most two in flight."""
    in_flight = []
    for _, flat in learner.publish_buckets():
        if rank == 0:
            in_flight.append(groups[0].broadcast(flat, 0))
            if len(in_flight) > 2:
                in_flight.pop(0).wait()
    for work in in_flight:
        work.wait()


def publishing(pattern: str, senders: int):
    """megarl's publish path as a run takes it (megarl.roles.learner_main.publish_weights) with
    `senders` publishing learner ranks; the others iterate the (collective) stream and send nothing."""
    publishers = {}

    def run(learner, rank, store, groups, spec, args, rep, stage) -> None:
        from megarl.distributed.publish import WeightPublisher

        if rank < senders:
            if stage not in publishers:
                publishers[stage] = WeightPublisher(groups[rank], part_store(store, stage, pattern, rank),
                                                    args.bucket_mb, 600, False, sender=rank, senders=senders)
            publishers[stage].publish(rep + 1, learner.publish_tensors(), spec=learner.publish_spec())
        else:
            for _ in learner.publish_tensors():
                pass
    return run


def part_store(store, stage: int, pattern: str, sender: int):
    import torch.distributed as dist

    return dist.PrefixStore(f"weights/zero{stage}/{pattern}/sender{sender}/", store)


PATTERNS = {"per_param": per_param, "bucketed": bucketed, "weight_publisher": publishing("weight_publisher", 1),
            "two_senders": publishing("two_senders", 2)}
SENDERS = {"weight_publisher": 1, "two_senders": 2}
# At ZeRO-1 every rank holds the whole model, so the senders' sends are all there is to a publish; at
# ZeRO-3 they share the time with the gathers, which every rank joins.
STAGE_PATTERNS = {1: ("weight_publisher", "two_senders"), 3: tuple(PATTERNS)}


def receive(store, groups, spec, args) -> None:
    """The sampler: receives every pattern's version in the order the learner sends them."""
    from megarl.distributed.publish import StagedReceiver, plan_buckets

    got = threading.Event()
    expected = {n: (torch.Size(s), d) for n, s, d in spec}
    buckets = plan_buckets(spec, int(args.bucket_mb * 2**20))
    for stage, patterns in STAGE_PATTERNS.items():
        receivers = {pattern: StagedReceiver([(groups[r], part_store(store, stage, pattern, r)) for r in range(n)],
                                             expected, torch.device("cpu"), on_version=lambda v, t, e: got.set(),
                                             current_version=lambda: 10**9, should_stop=lambda: False, timeout_s=600)
                     for pattern, n in SENDERS.items() if pattern in patterns}
        for rep in range(args.reps):
            for pattern in patterns:
                if pattern == "per_param":
                    for _, shape, dtype in spec:
                        groups[0].broadcast(torch.empty(shape, dtype=dtype), 0).wait()
                elif pattern == "bucketed":
                    for work in [groups[0].broadcast(torch.empty(b.numel, dtype=b.dtype), 0) for b in buckets]:
                        work.wait()
                else:
                    if rep == 0:
                        receivers[pattern].start()
                    if not got.wait(600):
                        raise TimeoutError(f"the zero{stage} {pattern} publish of rep {rep} did not arrive within 600 s")
                    got.clear()
                store.set(f"received/{stage}/{pattern}/{rep}", "1")


def report(results: list[dict]) -> dict:
    mb = 2**20
    first = results[0]
    print(f"model: {first['params'] / 1e6:.1f}M parameters ({4 * first['params'] / mb:.0f} MB fp32), dp=2, "
          f"publish buckets of {first['bucket_mb']} MB\n")
    print("memory per learner rank (MB over the RSS before the model was loaded)")
    print(f"{'stage':>5} {'rank':>4} {'built':>8} {'step peak':>10} {'after step':>11} {'theory':>8}"
          f"  (params / grads / optimizer)")
    summary = {"params": first["params"], "memory": {}, "publish": {}}
    for stage in ("1", "2", "3"):
        for rank, res in enumerate(results):
            m = res["memory"][stage]
            t = m["theory"]
            print(f"{stage:>5} {rank:>4} {m['built'] / mb:8.0f} {m['step_peak'] / mb:10.0f} "
                  f"{m['after_step'] / mb:11.0f} {t['total'] / mb:8.0f}"
                  f"  ({t['params'] / mb:.0f} / {t['grads'] / mb:.0f} / {t['optimizer'] / mb:.0f})")
        summary["memory"][f"zero{stage}"] = {
            "built_mb": [round(r["memory"][stage]["built"] / mb) for r in results],
            "step_peak_mb": [round(r["memory"][stage]["step_peak"] / mb) for r in results],
            "after_step_mb": [round(r["memory"][stage]["after_step"] / mb) for r in results],
            "theory_mb": round(first["memory"][stage]["theory"]["total"] / mb)}
    print("\npublish (rank 0 until the sampler has it; peak extra RSS per learner rank)")
    print(f"{'pattern':>23} {'seconds':>8} {'rank0 MB':>9} {'rank1 MB':>9}")
    for pattern in first["publish"]:
        seconds = min(first["publish"][pattern]["seconds"])
        peaks = [max(r["publish"][pattern]["peak_extra"]) / mb for r in results]
        print(f"{pattern:>23} {seconds:8.2f} {peaks[0]:9.0f} {peaks[1]:9.0f}")
        summary["publish"][pattern] = {"seconds": round(seconds, 3), "peak_extra_mb": [round(p) for p in peaks]}
    publish = summary["publish"]
    for stage in (1, 3):  # time of one sender / time of two
        summary[f"zero{stage}_two_senders_speedup"] = round(
            publish[f"zero{stage}/weight_publisher"]["seconds"] / publish[f"zero{stage}/two_senders"]["seconds"], 3)
        print(f"ZeRO-{stage}: two senders vs one (time of one / time of two): "
              f"{summary[f'zero{stage}_two_senders_speedup']:.2f}x")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--bucket-mb", type=float, default=16.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", default="runs/ds_publish")
    parser.add_argument("--store-port", type=int, default=0)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        from megarl.distributed.lifetime import exit_process

        exit_process(0)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = Path(__file__).resolve().parent.parent
    # Every allocation over 64 KiB mmapped (and unmapped when freed): RSS then follows live tensors instead
    # of keeping glibc's freed heap, so the peaks below are what each pattern itself holds.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo), MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", __file__,
           "--worker", "--store-port", str(port), "--layers", str(args.layers), "--bucket-mb", str(args.bucket_mb),
           "--reps", str(args.reps), "--out", args.out]
    proc = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        sys.exit(f"benchmark torchrun failed:\n{proc.stderr[-6000:]}")
    summary = report(json.loads((Path(args.out) / "results.json").read_text()))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
