"""Reward of an HF model directory on the worked example's held-out prompts (docs/sft.md).

    python docs/examples/sft_reverse/evaluate.py MODEL_DIR [DATA.jsonl] [--samples K]

Samples K completions per prompt at temperature 1 (as the RL runs sample; default K=4) and one greedy
completion, each at most 8 new tokens, and scores them with reward.py's `score`; prints the mean reward
and the exact-match share of both, and a last line of JSON. The embedded model's path:
`python -c "from megarl.embedded.registry import ensure_embedded_model as e; print(e('tiny-qwen2-count'))"`.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reward import score  # noqa: E402

MAX_NEW_TOKENS = 8


@torch.no_grad()
def complete(model, tokenizer, prompts: list[str], temperature: float, seed: int) -> list[str]:
    """One completion per prompt; prompts of equal token length run as one batch (no padding)."""
    gen = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    encoded = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    out = [""] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    for idx in by_len.values():
        ids = torch.tensor([encoded[i] for i in idx])
        new = torch.empty((len(idx), 0), dtype=torch.long)
        for _ in range(MAX_NEW_TOKENS):
            logits = model(input_ids=torch.cat([ids, new], 1)).logits[:, -1].float()
            nxt = logits.argmax(-1) if temperature == 0 else torch.multinomial(
                torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]
            new = torch.cat([new, nxt[:, None]], 1)
            if (new == eos).any(1).all():
                break
        for row, i in enumerate(idx):
            tokens = new[row].tolist()
            out[i] = tokenizer.decode(tokens[:tokens.index(eos)] if eos in tokens else tokens, skip_special_tokens=True)
    return out


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("data", nargs="?", default="runs/sft_reverse/data/heldout.jsonl")
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args()
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    prompts = [r["prompt"] for r in rows]
    result = {"model": args.model_dir, "prompts": len(rows)}
    for name, temperature, k in (("sampled", 1.0, args.samples), ("greedy", 0.0, 1)):
        rewards, exact = [], []
        for seed in range(k):
            for r, c in zip(rows, complete(model, tokenizer, prompts, temperature, seed)):
                rewards.append(score(r["prompt"], c, r["answer"], {}))
                exact.append(c.strip() == r["answer"])
        result[f"{name}_reward"] = sum(rewards) / len(rewards)
        result[f"{name}_exact"] = sum(exact) / len(exact)
        print(f"{name:8s} reward {result[f'{name}_reward']:.3f}  exact {result[f'{name}_exact']:.3f}  "
              f"({len(rewards)} completions{', T=1' if temperature else ''})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
