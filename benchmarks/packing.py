"""Sequence packing side by side: the demo's learner step unpacked, packed (`learner.share_prefixes=false`) and packed
with rows sharing their common prefixes (the default), on the same batches.

    python benchmarks/packing.py [--steps 24] [--model embedded:tiny-qwen2-count] [--backend megatron]

One process, one gloo rank, one torch thread (the demo's learner). Three learners are built from the same model
directory and step on the same batches in rotating order (so load and cache effects hit all alike); each batch is 16
prompts x 8 samples of the demo's count task, tokenized as the demo's sampler does ("d-k=" then the letters and EOS),
with lag-0 behaviour log-probs. Two regimes: `early`, completions as an untrained policy writes them (the run's
letters for the answer's length give or take, one in ten running on to max_new_tokens), and `trained`, the answer and
EOS. A group's rows share their prompt and, as far as they agree, their letters. Prints each learner's step time
(median after warm-up), padding and shared shares, the ratios, and ends with one JSON line.
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
from megarl.embedded.registry import resolve_model_path  # noqa: E402
from megarl.protocols import TrainBatch  # noqa: E402
from megarl.rollout.tasks import COUNT_ALPHABET, CountTask  # noqa: E402

PROMPTS, GROUP, MAX_NEW = 16, 8, 49
LEARNERS = {"unpacked": (False, False), "packed": (True, False), "shared": (True, True)}  # pack, share_prefixes


def batch_rows(regime: str, rng: random.Random, tokenizer) -> tuple[list[list[int]], list[int]]:
    """One batch of the demo task: per sample its tokens (prompt, then completion) and its prompt's length."""
    rows, prompt_lengths = [], []
    for prompt in CountTask().sample_prompts(rng, PROMPTS):
        ids = tokenizer.encode(prompt.text, add_special_tokens=False)
        start, answer = prompt.meta["start"], prompt.meta["length"]
        for _ in range(GROUP):
            if regime == "trained":
                letters = answer
            elif rng.random() < 0.1:
                letters = MAX_NEW
            else:
                letters = max(0, answer + round(rng.gauss(0, 2)))
            letters = min(letters, MAX_NEW - 1)
            run = (COUNT_ALPHABET * 2)[start:start + letters]  # the answer's run, continued past it
            completion = tokenizer.encode(run, add_special_tokens=False)[:MAX_NEW - 1] + [tokenizer.eos_token_id]
            rows.append(ids + completion)
            prompt_lengths.append(len(ids))
    return rows, prompt_lengths


def make_batch(learner, rows: list[list[int]], prompt_lengths: list[int], gen: torch.Generator) -> TrainBatch:
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for r, (row, prompt) in enumerate(zip(rows, prompt_lengths)):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, prompt:len(row)] = 1.0
    behaviour = learner.logprobs(ids) * mask
    adv = torch.randn(len(rows), 1, generator=gen).expand(len(rows), width) * mask
    return TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=behaviour,
                      versions=torch.where(mask > 0, 0, -1), advantages=adv.clone(), learner_version=0)


def build(model_dir: str, backend: str, pack: bool, share: bool):
    cfg = LearnerConfig(backend=backend, micro_batch_size=64, lr=5e-4, pack_sequences=pack, share_prefixes=share)
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
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    learners = {name: build(model_dir, args.backend, *flags) for name, flags in LEARNERS.items()}
    result = {"model": args.model, "backend": args.backend}
    for regime in ("early", "trained"):
        rng, gen = random.Random(0), torch.Generator().manual_seed(0)
        times = {name: [] for name in learners}
        shares = {name: [] for name in learners}
        names = list(learners)
        for i in range(args.steps):
            # One batch for all (behaviour log-probs of one of them: they take the same steps).
            batch = make_batch(learners["unpacked"], *batch_rows(regime, rng, tokenizer), gen)
            for name in names[i % 3:] + names[:i % 3]:
                start = time.perf_counter()
                metrics = learners[name].train_step(batch)
                times[name].append(time.perf_counter() - start)
                shares[name].append((metrics["padding_frac"], metrics["shared_frac"]))
        ms = {name: 1000 * statistics.median(t[4:]) for name, t in times.items()}
        frac = {name: [statistics.mean(x) for x in zip(*v)] for name, v in shares.items()}
        print(f"{regime:8s} step: " + ", ".join(f"{name} {ms[name]:.1f} ms (padding {frac[name][0]:.2f}, shared "
                                               f"{frac[name][1]:.2f})" for name in learners)
              + f": packed {ms['unpacked'] / ms['packed']:.2f}x, shared {ms['unpacked'] / ms['shared']:.2f}x "
                f"({ms['packed'] / ms['shared']:.2f}x over packed)")
        result[regime] = {**{f"{name}_ms": round(ms[name], 2) for name in learners},
                          **{f"{name}_padding_frac": round(frac[name][0], 3) for name in learners},
                          "shared_frac": round(frac["shared"][1], 3),
                          "speedup": round(ms["unpacked"] / ms["packed"], 3),
                          "shared_speedup": round(ms["unpacked"] / ms["shared"], 3),
                          "shared_over_packed": round(ms["packed"] / ms["shared"], 3)}
    dist.destroy_process_group()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
