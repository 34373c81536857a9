"""How much of a bf16 publish changes from one optimizer step to the next: the measurement that decides
whether a delta publish (send only the changed bf16 words) pays.

    python benchmarks/delta_fraction.py [--steps 6] [--out runs/delta_fraction]

For each case, a model trains `--steps` AdamW steps in fp32 (the learner's master weights) on a
language-model loss over random tokens (a real backward, so gradients, Adam moments and the update
sizes are those of training; the data does not matter for how far Adam moves each weight), and after
every step the weights are rounded to bf16 and compared word for word with the previous step's bf16
words. Printed per case: the changed fraction at each step, and the bytes a delta would send against a
full bf16 publish: what megarl's delta publish sends (`publish.delta_payload` per 16 MB bucket, the
smallest of (int32 index, bf16 value) pairs, 6 bytes per changed word; a changed-word bitmap plus the
values, 1/8 byte per word + 2 per changed word; the bucket whole), and the bitmap alone for comparison.

Why the fraction follows from lr: Adam moves a weight by about lr per step (|m / sqrt(v)| <= ~1), and a
bf16 word (8 significant bits) changes once the move exceeds half its spacing, |w| * 2**-8; so the
weights with |w| < ~256 * lr change. The demo's lr 5e-4 makes that |w| < 0.13, i.e. nearly every weight
of a model initialised with std 0.02; an LLM RL lr of 1e-6 makes it |w| < 2.6e-4, a few percent.

Ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

CASES = {
    # name: (model config kwargs, lr). The demo model's shape (tiny-qwen2-count) at the demo's lr; a
    # Qwen2.5-0.5B-shaped block (its hidden size, heads and MLP width; 4 of its 24 layers, vocab cut to
    # 32k) at RL learning rates.
    "demo_model_lr5e-4": (dict(vocab_size=264, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2), 5e-4),
    "qwen0.5b_block_lr1e-6": (dict(vocab_size=32768, hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
                                   num_attention_heads=14, num_key_value_heads=2), 1e-6),
    "qwen0.5b_block_lr1e-5": (dict(vocab_size=32768, hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
                                   num_attention_heads=14, num_key_value_heads=2), 1e-5),
}


BUCKET_ELEMENTS = 8 * 2**20  # 16 MB of bf16: publish.bucket_mb's default


def bf16_words(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to(torch.bfloat16) for p in model.parameters()])


def megarl_delta_bytes(new: torch.Tensor, old: torch.Tensor) -> int:
    """Bytes megarl's delta publish sends for this step: per bucket its delta size word and payload."""
    from megarl.distributed.publish import delta_payload

    total = 0
    for start in range(0, new.numel(), BUCKET_ELEMENTS):
        _, _, payload = delta_payload(new[start:start + BUCKET_ELEMENTS], old[start:start + BUCKET_ELEMENTS])
        total += 16 + payload.numel() * payload.element_size()
    return total


def measure(config_kwargs: dict, lr: float, steps: int, batch: int, seq: int) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(max_position_embeddings=seq, tie_word_embeddings=True, **config_kwargs))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    params = sum(p.numel() for p in model.parameters())
    previous, fractions, sent = bf16_words(model), [], []
    start = time.perf_counter()
    for step in range(steps):
        ids = torch.randint(0, config_kwargs["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        words = bf16_words(model)
        fractions.append(float((words.view(torch.int16) != previous.view(torch.int16)).float().mean()))
        sent.append(megarl_delta_bytes(words, previous) / (2 * words.numel()))
        previous = words
    later = fractions[1:] or fractions  # step 1 is Adam's first, full-size move (|m / sqrt(v)| = 1 exactly)
    changed = sum(later) / len(later)
    return {"params": params, "lr": lr, "changed_frac_per_step": [round(f, 4) for f in fractions],
            "changed_frac_mean": round(changed, 4),
            "megarl_delta_bytes_frac": round(sum(sent[1:] or sent) / len(sent[1:] or sent), 4),
            "bitmap_bytes_frac": round(1 / 16 + changed, 4),  # (1/8 + 2 * changed) / 2
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    print(f"{'case':>24} {'params':>9} {'lr':>7}  changed bf16 words per step   delta/full bytes after step 1: "
          f"megarl, bitmap")
    for name, (config_kwargs, lr) in CASES.items():
        r = measure(config_kwargs, lr, args.steps, args.batch, args.seq)
        results[name] = r
        print(f"{name:>24} {r['params'] / 1e6:8.1f}M {lr:7.0e}  {r['changed_frac_per_step']}  "
              f"{r['megarl_delta_bytes_frac']:.3f}, {r['bitmap_bytes_frac']:.3f}")
    print(json.dumps({"cases": results,
                      "delta_bytes_frac": {name: r["megarl_delta_bytes_frac"] for name, r in results.items()}}))


if __name__ == "__main__":
    main()
