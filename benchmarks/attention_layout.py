"""The megatron learner's attention inputs side by side on the demo: the attention layout (O(S) numbers per micro-batch
from which each layer builds its masks, megarl.learner.sdpa_attention.layout_attention) against dense boolean
[B, 1, S, S] masks built once per micro-batch (`use_dense_masks`, what the learner passed before the layout).

    python benchmarks/attention_layout.py [--steps 24] [--model embedded:tiny-qwen2-count]

One process, one gloo rank, one torch thread (the demo's learner). Two megatron learners are built from the same model
directory (packing and shared prefixes on, the defaults) and step on the same batches of benchmarks/packing.py (the
demo's count task, `early` and `trained` completions) in alternating order, so load and cache effects hit both alike.
Prints each one's step time (median after 4 warm-up steps) and the ratio, and ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.packing import batch_rows, make_batch  # noqa: E402
from megarl.algo.config import LossConfig  # noqa: E402
from megarl.config.schema import LearnerConfig  # noqa: E402
from megarl.embedded.registry import resolve_model_path  # noqa: E402
from megarl.learner import context_parallel, packing  # noqa: E402


def use_dense_masks(learner) -> None:
    """Have megatron learner `learner` pass dense boolean masks (True = masked; [B or 1, 1, Q, K], stacked
    [windows, ...] when layers have windows of their own) instead of attention layouts: the reference the layout
    is measured against."""
    def model_inputs(input_ids, mb=None, columns=None):
        input_ids = input_ids.to(learner.device)
        b, s = input_ids.shape
        keys = None if columns is None else context_parallel.key_columns(s, learner.cfg.cp)
        if mb is not None:
            positions = torch.nn.functional.pad(mb["packed_positions"], (0, s - mb["packed_positions"].shape[1]))
            masks = [packing.attention_mask(mb, s, learner.device, w, columns, keys) for w in learner.windows]
        else:
            positions = torch.arange(s).unsqueeze(0).expand(b, s)
            masks = [packing.causal_mask(s, learner.device, w, columns, keys) for w in learner.windows]
        positions = positions.to(learner.device)
        if columns is not None:
            input_ids, positions = input_ids[:, columns], positions[:, columns]
        return input_ids, positions, masks[0] if len(masks) == 1 else torch.stack(masks)

    learner._model_inputs = model_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="steps per learner and regime (the first 4 warm up)")
    parser.add_argument("--model", default="embedded:tiny-qwen2-count")
    args = parser.parse_args()
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(tempfile.mkdtemp()) / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model_dir = str(resolve_model_path(args.model))
    from transformers import AutoTokenizer

    from megarl.learner.megatron import MegatronLearner

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cfg = LearnerConfig(backend="megatron", micro_batch_size=64, lr=5e-4)
    loss = LossConfig(eps_low=0.2, eps_high=0.28, aggregation="seq_mean")
    learners = {name: MegatronLearner(model_dir, cfg, loss) for name in ("layout", "dense")}
    use_dense_masks(learners["dense"])
    result = {"model": args.model}
    for regime in ("early", "trained"):
        rng, gen = random.Random(0), torch.Generator().manual_seed(0)
        times = {name: [] for name in learners}
        losses = {name: [] for name in learners}
        names = list(learners)
        for i in range(args.steps):
            batch = make_batch(learners["dense"], *batch_rows(regime, rng, tokenizer), gen)
            for name in names[i % 2:] + names[:i % 2]:
                start = time.perf_counter()
                metrics = learners[name].train_step(batch)
                times[name].append(time.perf_counter() - start)
                losses[name].append(metrics["loss"])
        ms = {name: 1000 * statistics.median(t[4:]) for name, t in times.items()}
        gap = max(abs(a - b) for a, b in zip(losses["layout"], losses["dense"]))
        print(f"{regime:8s} step: layout {ms['layout']:.1f} ms, dense masks {ms['dense']:.1f} ms "
              f"(dense / layout {ms['dense'] / ms['layout']:.3f}); largest loss difference {gap:.2e}")
        result[regime] = {"layout_ms": round(ms["layout"], 2), "dense_ms": round(ms["dense"], 2),
                          "dense_over_layout": round(ms["dense"] / ms["layout"], 3), "max_loss_diff": gap}
    dist.destroy_process_group()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
