"""LoRA costs: learner memory, step time and publish bytes + time, LoRA vs full fine-tuning vs full + delta publish.

    python benchmarks/lora_costs.py             # scale.py's Qwen2.5-0.5B shape, rank 32 on every projection
    python benchmarks/lora_costs.py --tiny      # scale.py's tiny shape, rank 4: every code path in seconds (the test)

One torchrun launch of 2 processes (scale.py's driver: timeout, process group, memory check), three arms one after
another in it, each with the same megatron learner (fp32, TP1; on the CPU: it takes the GPU when there is one,
never tried), the same
2 x 64-token batches (scale.py's `train_batch`, lr 1e-6) and the real publish path: rank 0 trains and publishes
every version through `WeightPublisher` (checksums on, 16 MB buckets, `learner.publish_spec` streaming, as the
learner role does) to rank 1's `WeightReceiver` over a gloo publish group (weight_publish.py's `Worker`):

  lora        learner.lora rank R on every projection; each version is the adapter (fp32 wire). Rank 1 is a
              sampler: a BuiltinEngine on the frozen base whose receiver merges each version into the base
              and stages it (`AdapterStager.stage`, as the sampler role does): its merge-and-stage time.
  full        full fine-tuning; each version is every weight (publish.dtype=float32).
  full_delta  full fine-tuning with publish.dtype=bfloat16 publish.delta=true: the first version is the whole
              model in bf16, every later one the changed bf16 words (fp32 deltas would change nearly every word).

Per arm, on the learner process: resident memory (RSS) over the RSS before the arm (built; the build's peak, while
the checkpoint is loaded beside the model; the peak over the steps and publishes), median step time, median publish
time (publish start until the receiver has the version; the publisher's own time too) with the first step and the
first publish left out as warm-ups, and bytes per publish (the first one and the later ones). Each arm frees its
learner before the next (allocations over 64 KiB are unmapped when freed, as in scale.py, so RSS follows live
tensors). On rank 1 (LoRA): the median merge-and-stage. Ends with one JSON line; the measured table is in
docs/lora.md.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling benchmarks this one reuses

from deepspeed_publish import PeakRSS, rss  # noqa: E402
from scale import GB, LR, ROWS, Part, build_model_dir, hf_config, load, mem_available_gb, num_params, \
    run_part, train_batch  # noqa: E402
from weight_publish import Worker  # noqa: E402

# In this order: the first arm also carries the process's one-time allocations (megatron's lazy state, ~0.1 GB
# on the tiny shape), which the full arms' gigabytes hide and LoRA's would not.
ARMS = {"full": {"lora": False, "wire": torch.float32, "delta": False},
        "full_delta": {"lora": False, "wire": torch.bfloat16, "delta": True},
        "lora": {"lora": True, "wire": torch.float32, "delta": False}}
BUCKET_MB = 16.0


class ArmsWorker(Worker):
    """Rank 0: the learner and its publisher; rank 1: the receiver (and, for LoRA, the engine it stages into)."""

    def __init__(self, args):
        super().__init__(Path(args.result).parent, sizes=[], reps=0, bucket_mb=BUCKET_MB)
        self.args, self.cfg = args, hf_config(args.shape)

    def run(self) -> None:
        import torch.distributed as dist

        if self.rank == 0:  # the learner ranks (one) are the default group, as init_learner_group makes them
            dist.init_process_group("gloo", store=dist.PrefixStore("learners/", self.store.raw), rank=0, world_size=1)
        results = {}
        for arm in self.args.arms:
            gc.collect()
            results[arm] = self.learner_arm(arm) if self.rank == 0 else self.receiver_arm(arm)
            gc.collect()
        self.store.set(f"lora_costs/report/{self.rank}", json.dumps(results))
        if self.rank == 0:
            receiver = json.loads(self.store.get("lora_costs/report/1"))
            Path(self.args.result).write_text(json.dumps({"learner": results, "receiver": receiver}))
            dist.destroy_process_group()

    def learner_arm(self, arm: str) -> dict:
        from megarl.algo.config import LossConfig
        from megarl.config.schema import LearnerConfig, LoraConfig
        from megarl.distributed.publish import WeightPublisher
        from megarl.learner.megatron import MegatronLearner

        spec, vocab = ARMS[arm], self.cfg["vocab_size"]
        lora = LoraConfig(rank=self.args.rank if spec["lora"] else 0)
        base = rss()
        with PeakRSS() as build_peak:  # loading the checkpoint holds it beside the model for a while
            start = time.perf_counter()
            learner = MegatronLearner(self.args.model_dir, LearnerConfig(micro_batch_size=ROWS, lr=LR, lora=lora),
                                      LossConfig())
            build_s = time.perf_counter() - start
        gc.collect()
        built = rss() - base
        with PeakRSS() as peak:
            publisher = WeightPublisher(self.group, self.store.prefixed(f"bench/lora_costs/{arm}"), bucket_mb=BUCKET_MB,
                                        timeout_s=self.args.timeout, checksum=True, wire_dtype=spec["wire"],
                                        delta=spec["delta"])
            steps, publishes = [], []
            for _ in range(1 + self.args.steps):
                start = time.perf_counter()
                metrics = learner.train_step(train_batch(vocab, learner.version))
                steps.append(time.perf_counter() - start)
                if metrics["skipped_nonfinite"]:
                    raise RuntimeError(f"{arm}: the step was skipped (non-finite loss or grad norm): {metrics}")
                self.barrier(f"{arm}/{learner.version}/start")
                start = time.perf_counter()
                sent = publisher.publish(learner.version, learner.publish_tensors(), spec=learner.publish_spec())
                self.wait_receivers(f"{arm}/{learner.version}/done")
                publishes.append({"bytes": sent["bytes"], "full_bytes": sent["full_bytes"],
                                  "send_s": round(sent["seconds"], 4), "s": round(time.perf_counter() - start, 4)})
            self.barrier(f"{arm}/end")
        trainable = sum(p.numel() for p in learner.gpt.parameters() if p.requires_grad)
        params = sum(p.numel() for p in learner.gpt.parameters())
        after = rss() - base
        del learner, publisher
        return {"params": params, "trainable": trainable, "build_s": round(build_s, 2), "built": built,
                "build_peak": build_peak.peak - base, "after_steps": after, "peak": peak.peak - base,
                "step_s": [round(s, 3) for s in steps],
                "publishes": publishes, "loss": metrics["loss"], "load": load()}

    def receiver_arm(self, arm: str) -> dict:
        from megarl.config.schema import LoraConfig
        from megarl.models.convert import load_pretrained
        from megarl.sampler.engine import BuiltinEngine
        from megarl.sampler.lora import AdapterStager
        from megarl.sampler.model import ModelSpec

        stop, stage_s, stager = threading.Event(), [], None
        if ARMS[arm]["lora"]:
            hf, weights = load_pretrained(self.args.model_dir)
            engine = BuiltinEngine(hf, weights, max_running=1, max_seq_len=8)
            stager = AdapterStager(engine, weights, hf, LoraConfig(rank=self.args.rank))
            del weights
            expected = stager.weight_spec()
        else:
            shapes = ModelSpec.from_hf_config(self.cfg).weight_shapes()
            expected = {n: (torch.Size(s), torch.float32) for n, s in shapes.items()}

        def on_version(version, tensors, extra):  # on the receiver thread, as a sampler's receiver
            # Received = done for the publish time (as in scale.py); LoRA's merge-and-stage is timed on its own.
            self.receiver_store.set(f"bench/{arm}/{version}/done/{self.rank}", "1")
            if stager is not None:
                start = time.perf_counter()
                stager.stage(tensors, version)
                stager.engine.apply_staged()  # no decode loop here: the step boundary's swap, so the next can stage
                stage_s.append(time.perf_counter() - start)

        metas = {n: torch.empty(shape, dtype=dtype, device="meta") for n, (shape, dtype) in expected.items()}
        receiver = self._bandwidth_receiver(f"bench/lora_costs/{arm}/", metas, on_version, stop)
        for version in range(1, 2 + self.args.steps):
            self.barrier(f"{arm}/{version}/start")
        self.barrier(f"{arm}/end")
        stop.set()
        receiver.thread.join(60)
        if receiver.error:
            raise receiver.error
        return {"merge_stage_s": [round(s, 4) for s in stage_s]}


def arms_worker(args) -> None:
    ArmsWorker(args).run()


# ------------------------------------------------------------------------------------------ driver
def summarise(result: dict, shape: str, rank: int) -> dict:
    """One row per arm: learner memory in GB and bytes per parameter of the model, median step and publish
    (warm-ups left out), bytes of the first and of a later publish; LoRA's merge-and-stage on the receiver."""
    params, arms = num_params(shape), {}
    for arm, r in result["learner"].items():
        later = r["publishes"][1:] or r["publishes"]
        arms[arm] = {"trainable": r["trainable"], "built_gb": round(r["built"] / GB, 3),
                     "build_peak_gb": round(r["build_peak"] / GB, 3), "peak_gb": round(r["peak"] / GB, 3),
                     "peak_bytes_per_param": round(r["peak"] / params, 2),
                     "step_s": round(statistics.median(r["step_s"][1:] or r["step_s"]), 3),
                     "publish_bytes": statistics.median(p["bytes"] for p in later),
                     "first_publish_bytes": r["publishes"][0]["bytes"],
                     "publish_s": round(statistics.median(p["s"] for p in later), 4),
                     "publisher_s": round(statistics.median(p["send_s"] for p in later), 4),
                     "optimizer_state_gb": round((r["after_steps"] - r["built"]) / GB, 3),
                     "first_publish_s": r["publishes"][0]["s"],
                     "wire": "bf16" if ARMS[arm]["wire"] == torch.bfloat16 else "fp32"}
        stage = result["receiver"][arm]["merge_stage_s"]
        if stage:
            arms[arm]["engine_merge_stage_s"] = round(statistics.median(stage[1:] or stage), 4)
    return {"shape": shape, "params": params, "lora_rank": rank, "learner_dtype": "fp32",
            "device": "cuda" if torch.cuda.is_available() else "cpu", "arms": arms}


def print_table(head: dict) -> None:
    header = ["arm", "trainable", "learner step peak (built; build peak)", "B/param", "step", "publish bytes (first)",
              "publish time (first)",
              "merge+stage"]
    rows = [[arm, f"{a['trainable'] / 1e6:.1f}M",
             f"{a['peak_gb']:.2f} GB ({a['built_gb']:.2f}; {a['build_peak_gb']:.2f})",
             f"{a['peak_bytes_per_param']:.1f}", f"{a['step_s']:.2f} s",
             f"{a['publish_bytes'] / 1e6:.2f} MB ({a['first_publish_bytes'] / 1e6:.2f}), {a['wire']}",
             f"{a['publish_s']:.3f} s ({a['first_publish_s']:.3f})",
             f"{a['engine_merge_stage_s']:.3f} s" if "engine_merge_stage_s" in a else ""]
            for arm, a in head["arms"].items()]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths]] + rows:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="scale.py's tiny shape, rank 4 (the test)")
    parser.add_argument("--out", default="runs/lora_costs")
    parser.add_argument("--steps", type=int, default=None, help="timed steps after the warm-up (default 3; tiny 1)")
    parser.add_argument("--rank", type=int, default=None, help="LoRA rank (default 32; tiny 4)")
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=list(ARMS))
    parser.add_argument("--timeout", type=float, default=1500)
    # the part's own arguments (the driver passes them)
    parser.add_argument("--part", choices=["arms"], help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        from megarl.distributed.lifetime import run_then_exit

        run_then_exit(lambda: arms_worker(args))
    shape = "tiny" if args.tiny else "qwen2.5-0.5b"
    steps = args.steps if args.steps is not None else (1 if args.tiny else 3)
    rank = args.rank if args.rank is not None else (4 if args.tiny else 32)
    out, p = Path(args.out), num_params(shape)
    out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}; {os.cpu_count()} cores; MemAvailable {mem_available_gb():.1f} GB; "
          f"load {os.getloadavg()}", flush=True)
    started, load_start = time.monotonic(), list(os.getloadavg())
    model = out / "models" / shape
    build_model_dir(shape, model)
    # The full arm's learner (~19 B/param, scale.py) and its receiver's 2 fp32 staging sets, one arm at a time.
    part = Part("lora_costs", "arms", shape, ["--model-dir", str(model), "--steps", str(steps), "--rank", str(rank),
                                              "--arms", *args.arms, "--timeout", str(args.timeout)],
                2, 28 * p / GB + 1, args.timeout, script=Path(__file__).resolve())
    res = run_part(part, out)
    if "error" in res:
        raise SystemExit(f"lora_costs: not measured: {res['error']}")
    head = summarise(res["result"], shape, rank)
    print()
    print_table(head)
    head.update(steps=steps, seconds=round(time.monotonic() - started), load_start=load_start,
                load_end=list(os.getloadavg()))
    print(json.dumps(head))


if __name__ == "__main__":
    main()
