"""Weight publish path vs one raw flat broadcast; and what an update costs a decoding sampler.

    python benchmarks/weight_publish.py [--quick] [--receivers 1 2] [--sizes 1 16 128 512] [--reps 3]
                                        [--bucket-mb 16] [--out runs/weight_publish]

For each receiver count R it starts one real `torchrun` with 1 + R processes (rank 0 = the learner's
publish source, ranks 1..R = samplers) that build the publish group exactly as a run does
(`megarl.distributed.topology.publish_group`: a standalone gloo group over the torchrun store).
Per model size (a Qwen2 config whose fp32 weights total about that many MB, random weights):

* bandwidth: the same bytes moved two ways, receivers idle, each timed on rank 0 from a store
  barrier until every receiver reported completion through the store, in rounds of (raw, publish
  with checksum off, publish with checksum on) so that load from other jobs hits them alike; the
  ratio is the median over `--reps` rounds (three times as many for sizes <= 16 MB; two warm-up
  rounds first) of the per-round raw / publish time:
  - raw: one `broadcast` of a single flat fp32 buffer of the model's total size (the practical limit);
  - publish: `WeightPublisher.publish` -> every `WeightReceiver` has handed the version to its
    callback (buckets received, checksums verified, tensors viewed), with `checksum` off and on.
  The headline is publish bandwidth / raw bandwidth.
* update cost on a decoding sampler: every receiver runs a real `BuiltinEngine` on that model (8
  sequences decoding greedily, `stage_weights` as the receive callback, as in a sampler) while rank 0
  publishes 2 + 4 versions (checksum on, the default; the first 2 are warm-up).  From per-step
  timestamps (CLOCK_MONOTONIC, shared by the processes) per update:
  - swap: the time the decode thread spent applying the version at the step boundary;
  - receive CPU: CPU time the sampler process spent off the decode thread (receive, checksums,
    `stage_weights`) from the publish's start to the end of the step that swapped it in, minus the
    same over a control window of equal length in the quiet gap after the update; in decode steps;
  - stall: the extra wall time of the decode steps in that window over the baseline step, minus the
    same over the control window, in decode steps.  On cores shared with other jobs this one is noisy.

Ends with one JSON line: per size and receiver count, publish/raw bandwidth ratios (checksum off and
on), the swap time, the receive CPU and the stall in decode steps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

# (vocab, hidden, intermediate, layers, heads, kv_heads) of a Qwen2 with about SIZE MB of fp32 weights.
CONFIGS = {
    1: (512, 128, 256, 1, 2, 1),
    16: (8192, 256, 768, 3, 4, 2),
    128: (16384, 768, 2048, 3, 12, 4),
    512: (32768, 1024, 2816, 9, 16, 4),
}
DECODE_BATCH = 8
STALL_UPDATES = 4
WARMUP_UPDATES = 2  # the first receives into each staging buffer set touch fresh memory
STORE_TIMEOUT = timedelta(seconds=600)


def hf_config(size_mb: int) -> dict:
    vocab, hidden, inter, layers, heads, kv = CONFIGS[size_mb]
    return {"model_type": "qwen2", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
            "max_position_embeddings": 4096}


def random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    from megarl.sampler.model import ModelSpec

    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in ModelSpec.from_hf_config(cfg).weight_shapes().items():
        weights[name] = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02
    return weights


# ------------------------------------------------------------------------------------------ worker
class Worker:
    """One process of the torchrun launch: rank 0 publishes, the others receive."""

    def __init__(self, out: Path, sizes: list[int], reps: int, bucket_mb: float):
        from megarl.distributed.ranks import Topology
        from megarl.distributed.topology import connect_store, publish_group

        self.out, self.sizes, self.reps, self.bucket_mb = out, sizes, reps, bucket_mb
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        topo = Topology(rank=self.rank, world_size=self.world, num_learners=1, num_samplers=self.world - 1)
        self.store = connect_store(topo, 120)
        # The receiver thread gets its own store connection: a TCPStore client serialises requests, so
        # its header polls would queue behind the main thread's blocking barrier waits.
        self.receiver_store = connect_store(topo, 120)
        self.group = publish_group(topo, self.store, "gloo", 120)

    def barrier(self, tag: str) -> None:
        self.store.set(f"bench/{tag}/{self.rank}", "1")
        self.store.wait([f"bench/{tag}/{r}" for r in range(self.world)], STORE_TIMEOUT)

    def wait_receivers(self, tag: str) -> None:
        self.store.wait([f"bench/{tag}/{r}" for r in range(1, self.world)], STORE_TIMEOUT)

    def run(self) -> None:
        for size in self.sizes:
            cfg = hf_config(size)
            weights = random_weights(cfg, seed=self.rank)
            result = {"size_mb": size, "bytes": sum(t.numel() * t.element_size() for t in weights.values())}
            result["seconds"] = self.bandwidth(size, weights, result["bytes"])
            result["stall"] = self.stall(size, cfg, weights)
            if self.rank == 0:
                with open(self.out / f"size{size}.json", "w") as f:
                    json.dump(result, f)
            del weights

    def reps_for(self, size: int) -> int:
        return self.reps * 3 if size <= 16 else self.reps  # small ones are quick and noisy

    def bandwidth(self, size: int, weights: dict, nbytes: int) -> dict[str, list[float]]:
        """Seconds per transfer, from a barrier until every receiver reported it complete: rounds of
        (raw flat broadcast, publish with checksum off, with checksum on), back to back so that load
        from other jobs hits the three alike.  Two warm-up rounds: the first publishes land in fresh
        staging buffers (one set each)."""
        flat = torch.zeros(nbytes // 4)
        modes = ("raw", "checksum_off", "checksum_on")
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        publishers, receivers, stop = {}, [], threading.Event()
        for mode in modes[1:]:
            prefix = f"bench/bw/{size}/{mode}/"
            if self.rank == 0:
                publishers[mode] = self._publisher(prefix, checksum=mode == "checksum_on")
            else:
                receivers.append(self._bandwidth_receiver(prefix, weights, self._report_done(size, mode), stop))
        for rep in range(-2, self.reps_for(size)):
            for mode in modes:
                tag = f"bw/{size}/{mode}/{rep}"
                self.barrier(tag + "/start")
                start = time.monotonic()
                if mode == "raw":
                    self.group.broadcast(flat, 0).wait()
                    if self.rank > 0:
                        self.store.set(f"bench/{tag}/done/{self.rank}", "1")
                elif self.rank == 0:
                    publishers[mode].publish(rep + 3, weights.items())
                if self.rank == 0:
                    self.wait_receivers(tag + "/done")
                    if rep >= 0:
                        times[mode].append(time.monotonic() - start)
        self.barrier(f"bw/{size}/end")  # rank 0 arrives once the last publish was received everywhere
        stop.set()
        for receiver in receivers:
            receiver.thread.join(60)
            if receiver.error:
                raise receiver.error
        return times

    def _report_done(self, size: int, mode: str):
        def on_version(version, tensors, extra):  # on the receiver thread: its own store connection
            self.receiver_store.set(f"bench/bw/{size}/{mode}/{version - 3}/done/{self.rank}", "1")
        return on_version

    def _bandwidth_receiver(self, prefix: str, weights: dict, on_version, stop: threading.Event):
        """A receiver whose 'engine' uses each version as soon as it is handed over, so its staging sets are
        free again for the next-but-one publish. (Reporting version 0 forever, as this benchmark once did,
        makes the third publish wait for a staging set that is never released: the receive, then the
        publish, time out after 120 s.)"""
        applied = [0]

        def use(version, tensors, extra):
            on_version(version, tensors, extra)
            applied[0] = version

        return self._receiver(prefix, weights, use, lambda: applied[0], stop)

    def _receiver(self, prefix: str, weights: dict, on_version, current_version, stop: threading.Event,
                  destination=None):
        from megarl.distributed.publish import WeightReceiver

        store = self.receiver_store.prefixed(prefix.rstrip("/"))  # a signed view, as the run's
        spec = {n: (t.shape, t.dtype) for n, t in weights.items()}
        return WeightReceiver(self.group, store, spec, torch.device("cpu"), on_version=on_version,
                              current_version=current_version, should_stop=stop.is_set, timeout_s=120,
                              destination=destination).start()

    def _publisher(self, prefix: str, checksum: bool):
        from megarl.distributed.publish import WeightPublisher

        store = self.store.prefixed(prefix.rstrip("/"))
        return WeightPublisher(self.group, store, bucket_mb=self.bucket_mb, timeout_s=120, checksum=checksum)

    def stall(self, size: int, cfg: dict, weights: dict) -> dict:
        tag = f"stall/{size}"
        if self.rank == 0:
            return self._publish_during_decode(tag, weights)
        return self._decode_during_publish(tag, cfg, weights)

    def _publish_during_decode(self, tag: str, weights: dict) -> dict:
        publisher = self._publisher(f"bench/{tag}/", checksum=True)
        self.wait_receivers(f"{tag}/decoding")
        windows = []
        for version in range(1, WARMUP_UPDATES + STALL_UPDATES + 1):
            start = time.monotonic()
            publisher.publish(version, weights.items())
            windows.append((start, time.monotonic()))
            self.wait_receivers(f"{tag}/{version}/swapped")
            # Decode undisturbed in between, long enough for a control window as long as the update.
            time.sleep(max(0.3, 2.5 * (time.monotonic() - start)))
        self.store.set(f"bench/{tag}/stop", "1")
        self.wait_receivers(f"{tag}/report")
        reports = [json.loads(self.store.get(f"bench/{tag}/report/{r}")) for r in range(1, self.world)]
        return summarise_stall(windows, reports)

    def _decode_during_publish(self, tag: str, cfg: dict, weights: dict) -> dict:
        from megarl.protocols import GenerationRequest, SamplingParams
        from megarl.sampler.engine import BuiltinEngine

        engine = BuiltinEngine(cfg, weights, max_running=DECODE_BATCH, max_seq_len=512)
        sampling = SamplingParams(temperature=0.0, max_new_tokens=504)
        stop = threading.Event()
        # As a sampler's receiver (megarl.roles.sampler_main.weight_receiver): into the engine's staging buffers.
        receiver = self._receiver(f"bench/{tag}/", weights, lambda version, tensors, extra: engine.stage_weights(
            tensors, version), lambda: engine.version, stop, destination=engine.staging_buffers)
        # (start, end, admitted, swapped, swap_s, decode-thread CPU at start / end, process CPU at start / end)
        steps = []
        announced, swapped_versions = False, set()
        while not self.store.check([f"bench/{tag}/stop"]):
            for i in range(DECODE_BATCH - engine.num_unfinished):
                engine.add_request(GenerationRequest(f"{len(steps)}-{i}", list(range(1, 9)), sampling))
            before = engine.stats()
            start, thread_start, proc_start = time.monotonic(), time.thread_time(), time.process_time()
            engine.step()
            end, thread_end, proc_end = time.monotonic(), time.thread_time(), time.process_time()
            after = engine.stats()
            steps.append((start, end, after["prefill_tokens"] > before["prefill_tokens"],
                          after["swaps"] > before["swaps"], after["swap_time_s"] - before["swap_time_s"],
                          thread_start, thread_end, proc_start, proc_end))
            if not announced and len(steps) >= 20:
                self.store.set(f"bench/{tag}/decoding/{self.rank}", "1")
                announced = True
            if engine.version not in swapped_versions and engine.version > 0:
                swapped_versions.add(engine.version)
                self.store.set(f"bench/{tag}/{engine.version}/swapped/{self.rank}", "1")
            if receiver.error:
                raise receiver.error
        stop.set()
        receiver.thread.join(60)
        self.store.set(f"bench/{tag}/report/{self.rank}", json.dumps({"steps": steps}))
        return {}


def summarise_stall(windows: list[tuple[float, float]], reports: list[dict]) -> dict:
    """Per receiver: the baseline decode step, and per update the extra decode time of the steps from
    the publish's start to the end of the step that swapped the version in (admission steps excluded),
    minus the same measure over a control window of equal length in the quiet gap after the update:
    the machine is shared, and the control takes out what other jobs cost the decode loop anyway."""
    per_receiver = []
    for report in reports:
        # A step: (start, end, admitted, swapped, swap_s, decode-thread CPU start/end, process CPU start/end).
        swaps = [s for s in report["steps"] if s[3]]
        steps = [s for s in report["steps"] if not s[2]]  # a step that admitted requests also prefilled
        updates = [(pub_start, swap[1]) for (pub_start, _), swap in zip(windows, swaps)]
        next_starts = [start for start, _ in windows[1:]] + [steps[-1][1]]
        updates, next_starts, swaps = updates[WARMUP_UPDATES:], next_starts[WARMUP_UPDATES:], swaps[WARMUP_UPDATES:]
        controls = []
        for (start, end), next_start in zip(updates, next_starts):
            middle = end + (next_start - end - (end - start)) / 2
            # the gap holds a window as long as the update's, and a decode step overlaps it (on a loaded machine a
            # short window can fall between two steps, where the loop was descheduled: nothing to compare)
            if middle > end and any(s[0] < middle + end - start and s[1] > middle for s in report["steps"]):
                controls.append((middle, middle + end - start))

        def overlapping(window):
            return [s for s in steps if s[0] < window[1] and s[1] > window[0]]

        busy = {id(s) for window in updates for s in overlapping(window)}
        baseline = statistics.median(s[1] - s[0] for s in steps if id(s) not in busy)

        def extra(window) -> float:
            return sum(s[1] - s[0] - baseline for s in overlapping(window))

        def other_cpu(window) -> float:  # CPU the sampler process spent off the decode thread
            inside = [s for s in report["steps"] if s[0] < window[1] and s[1] > window[0]]
            return (inside[-1][8] - inside[0][7]) - (inside[-1][6] - inside[0][5])

        update_extra = statistics.median(extra(w) for w in updates)
        control_extra = statistics.median(extra(w) for w in controls) if controls else 0.0
        receive_cpu = statistics.median(other_cpu(w) for w in updates)
        control_cpu = statistics.median(other_cpu(w) for w in controls) if controls else 0.0
        per_receiver.append({
            "baseline_step_ms": round(baseline * 1e3, 3),
            "update_window_steps": round(statistics.median(len(overlapping(w)) for w in updates), 1),
            "extra_ms_per_update": round(update_extra * 1e3, 2),
            "control_extra_ms": round(control_extra * 1e3, 2),
            "stall_steps_per_update": round((update_extra - control_extra) / baseline, 2),
            "receive_cpu_ms": round((receive_cpu - control_cpu) * 1e3, 1),
            "receive_cpu_steps": round((receive_cpu - control_cpu) / baseline, 2),
            "swap_ms": round(1e3 * statistics.median(s[4] for s in swaps), 3),
        })
    return {"publish_s": [round(e - s, 4) for s, e in windows[WARMUP_UPDATES:]], "receivers": per_receiver}


# ------------------------------------------------------------------------------------------ driver
def launch(receivers: int, sizes: list[int], reps: int, bucket_mb: float, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={1 + receivers}",
           __file__, "--worker", str(out), "--sizes", *map(str, sizes), "--reps", str(reps),
           "--bucket-mb", str(bucket_mb)]
    repo = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    if proc.returncode != 0:
        sys.exit(f"torchrun with {receivers} receiver(s) failed:\n{proc.stderr[-4000:]}")
    return [json.loads((out / f"size{size}.json").read_text()) for size in sizes]


def report(receivers: int, result: dict) -> dict:
    mb, seconds = result["bytes"] / 2**20, result["seconds"]
    raw = statistics.median(seconds["raw"])
    row = {"MB": round(mb, 1), "raw_MB_s": round(mb / raw)}
    print(f"{receivers} receiver(s), {mb:7.1f} MB: raw broadcast {mb / raw:7.0f} MB/s ({raw * 1e3:7.1f} ms)")
    for mode in ("checksum_off", "checksum_on"):
        t = statistics.median(seconds[mode])
        ratio = statistics.median(r / p for r, p in zip(seconds["raw"], seconds[mode]))  # paired, per round
        row[f"ratio_{mode}"] = round(ratio, 3)
        print(f"    publish, {mode.replace('_', ' '):12s}: {mb / t:7.0f} MB/s ({t * 1e3:7.1f} ms), {ratio:.2f} of raw")
    stall = result["stall"]
    print(f"    decoding receivers: publish takes {1e3 * statistics.median(stall['publish_s']):.1f} ms")
    for i, r in enumerate(stall["receivers"]):
        print(f"      receiver {i + 1}: step {r['baseline_step_ms']:.2f} ms; swap {r['swap_ms']:.3f} ms; receive CPU "
              f"off the decode thread {r['receive_cpu_ms']:.1f} ms = {r['receive_cpu_steps']:.2f} decode steps; "
              f"update spans {r['update_window_steps']} steps, extra decode time {r['extra_ms_per_update']:.1f} ms "
              f"(control window {r['control_extra_ms']:.1f} ms): stall {r['stall_steps_per_update']:.2f} steps")
    row["swap_ms"] = max(r["swap_ms"] for r in stall["receivers"])
    row["receive_cpu_steps"] = max(r["receive_cpu_steps"] for r in stall["receivers"])
    row["stall_steps"] = max(r["stall_steps_per_update"] for r in stall["receivers"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="sizes 1 16 128, 1 receiver, 2 reps")
    parser.add_argument("--receivers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 128, 512], choices=sorted(CONFIGS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=16.0)  # publish.bucket_mb's default
    parser.add_argument("--out", default="runs/weight_publish")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(1)
        Worker(Path(args.worker), args.sizes, args.reps, args.bucket_mb).run()
        return
    if args.quick:
        args.sizes, args.receivers, args.reps = [1, 16, 128], [1], 2
    print(f"torch {torch.__version__}, gloo over loopback, bucket_mb={args.bucket_mb}, {args.reps} reps, medians")
    headline = {}
    for receivers in args.receivers:
        for result in launch(receivers, args.sizes, args.reps, args.bucket_mb, Path(args.out) / f"r{receivers}"):
            row = report(receivers, result)
            headline[f"{result['size_mb']}MB_r{receivers}"] = {k: v for k, v in row.items()
                                                                if k.startswith(("ratio", "stall", "receive", "swap"))}
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
