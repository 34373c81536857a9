"""The worked example of docs/sft.md: reverse a short random lowercase string ("kqzd<" -> "dzqk").

    python docs/examples/sft_reverse/make_data.py [OUT_DIR]     (default runs/sft_reverse/data)

writes three JSONL files of {"prompt", "completion", "answer"} records (the completion and the answer are
the same string: `megarl sft` reads prompt + completion, `task.name=jsonl` reads prompt + answer):
sft.jsonl (8000 records, supervised training), heldout.jsonl (200, sft.eval_data and the evaluation of
every stage) and rl.jsonl (2000, the prompts of the RL runs), each drawn from its own seed.
Strings are 3 to 6 letters, so a completion is at most 7 tokens with EOS on the embedded byte tokenizer.
"""
import json
import random
import sys
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
        out.append({"prompt": f"{word}<", "completion": word[::-1], "answer": word[::-1]})
    return out


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/sft_reverse/data")
    out.mkdir(parents=True, exist_ok=True)
    for name, n, seed in (("sft", 8000, 1), ("heldout", 200, 2), ("rl", 2000, 3)):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records(n, seed)))
        print(f"wrote {path} ({n} records)")


if __name__ == "__main__":
    main()
