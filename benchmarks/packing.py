"""Sequence packing side by side: the demo's learner step with `learner.pack_sequences` on and off, on the same batches.

    python benchmarks/packing.py [--steps 24] [--model embedded:tiny-qwen2-count] [--backend megatron]

One process, one gloo rank, one torch thread (the demo's learner). Two learners are built from the same model
directory, one packing and one not, and step on the same batches alternately (so load and cache effects hit both
alike); each batch is 16 prompts x 8 samples of the demo's count task with lag-0 behaviour log-probs. Two regimes:
`early`, completions as an untrained policy writes them (the answer's length give or take, one in ten running to
max_new_tokens), and `trained`, the answer and EOS. Prints the step time (median after warm-up) and padding share of
each, the ratio, and ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megarl.algo.config import LossConfig  # noqa: E402
from megarl.config.schema import LearnerConfig  # noqa: E402
from megarl.models.embedded import resolve_model_path  # noqa: E402
from megarl.protocols import TrainBatch  # noqa: E402
from megarl.rollout.tasks import CountTask  # noqa: E402

PROMPTS, GROUP, PROMPT_TOKENS, MAX_NEW, WIDTH = 16, 8, 5, 49, 64


def completion_lengths(regime: str, rng: random.Random) -> list[int]:
    """Per sample, the completion's tokens (letters + EOS) of one batch of the demo task."""
    lengths = []
    for prompt in CountTask().sample_prompts(rng, PROMPTS):
        answer = prompt.meta["length"] + 1
        for _ in range(GROUP):
            if regime == "trained":
                lengths.append(answer)
            elif rng.random() < 0.1:
                lengths.append(MAX_NEW)
            else:
                lengths.append(max(1, min(MAX_NEW, answer + round(rng.gauss(0, 2)))))
    return lengths


def make_batch(learner, lengths: list[int], gen: torch.Generator, vocab: int) -> TrainBatch:
    rows = len(lengths)
    ids = torch.randint(0, vocab, (rows, WIDTH), generator=gen)
    mask = torch.zeros(rows, WIDTH)
    for r, n in enumerate(lengths):
        mask[r, PROMPT_TOKENS:PROMPT_TOKENS + n] = 1.0
    behaviour = learner.logprobs(ids) * mask
    adv = torch.randn(rows, 1, generator=gen).expand(rows, WIDTH) * mask
    return TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=behaviour,
                      versions=torch.where(mask > 0, 0, -1), advantages=adv.clone(), learner_version=0)


def build(model_dir: str, backend: str, pack: bool):
    cfg = LearnerConfig(backend=backend, micro_batch_size=64, lr=5e-4, pack_sequences=pack)
    loss = LossConfig(eps_low=0.2, eps_high=0.28, aggregation="seq_mean")
    if backend == "deepspeed":
        from megarl.learner.deepspeed import DeepSpeedLearner

        return DeepSpeedLearner(model_dir, cfg, loss)
    from megarl.learner.megatron import MegatronLearner

    return MegatronLearner(model_dir, cfg, loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="steps per learner and regime (the first 4 warm up)")
    parser.add_argument("--model", default="embedded:tiny-qwen2-count")
    parser.add_argument("--backend", default="megatron", choices=["megatron", "deepspeed"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("LOCAL_RANK", "0")  # what DeepSpeed asks a launcher for
    store = dist.FileStore(str(Path(tempfile.mkdtemp()) / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model_dir = str(resolve_model_path(args.model))
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    learners = {"packed": build(model_dir, args.backend, True), "unpacked": build(model_dir, args.backend, False)}
    result = {"model": args.model, "backend": args.backend}
    for regime in ("early", "trained"):
        rng, gen = random.Random(0), torch.Generator().manual_seed(0)
        times = {name: [] for name in learners}
        padding = {name: [] for name in learners}
        for i in range(args.steps):
            # One batch for both (behaviour log-probs of one of them: the two take the same steps).
            batch = make_batch(learners["unpacked"], completion_lengths(regime, rng), gen, vocab)
            for name in (("packed", "unpacked") if i % 2 else ("unpacked", "packed")):
                start = time.perf_counter()
                metrics = learners[name].train_step(batch)
                times[name].append(time.perf_counter() - start)
                padding[name].append(metrics["padding_frac"])
        ms = {name: 1000 * statistics.median(t[4:]) for name, t in times.items()}
        pad = {name: statistics.mean(p) for name, p in padding.items()}
        ratio = ms["unpacked"] / ms["packed"]
        print(f"{regime:8s} step: packed {ms['packed']:.1f} ms (padding {pad['packed']:.2f}), unpacked "
              f"{ms['unpacked']:.1f} ms (padding {pad['unpacked']:.2f}): {ratio:.2f}x")
        result[regime] = {"packed_ms": round(ms["packed"], 2), "unpacked_ms": round(ms["unpacked"], 2),
                          "packed_padding_frac": round(pad["packed"], 3),
                          "unpacked_padding_frac": round(pad["unpacked"], 3), "speedup": round(ratio, 3)}
    dist.destroy_process_group()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
