"""Built-in engine vs Hugging Face `generate`: generated tokens/s on the same model, prompts and batch.

    python benchmarks/sampler_throughput.py [--quick] [--threads 1] [--batch-sizes 16 32 64]
                                            [--new-tokens 64] [--reps 5] [--models embedded larger]
                                            [--kv-layouts [--kv-block-size 32] [--prompt-len N]]

Models: the embedded default (`tiny-qwen2-arith`: hidden 64, 2 layers, vocab 264, built locally on
first use) and a larger Qwen2 created here, randomly initialised, in a temporary HF directory
(hidden 384, 4 layers, 6 heads / 2 KV heads, intermediate 1024, vocab 8192).

Both sides get the same thing: the same HF directory in fp32, the same prompts (random token ids of
length 4-16, seeded), the same batch size (the engine runs with max_running = batch, so every request
is in one batch, as in HF), temperature 1 / top_p 1 / top_k 0, the same torch thread count, and
exactly `--new-tokens` tokens per row: HF with `eos_token_id=None` (no stop criterion and no EOS
logits processor) and the engine without stop ids, so both generate and count batch * new_tokens
tokens.  HF uses its default generate path (dynamic KV cache, SDPA attention, multinomial sampling);
the engine additionally records each token's behaviour log-prob and version, HF computes nothing extra.

Timing: one warm-up call each, then `--reps` rounds alternating engine and HF; tokens/s = tokens /
time of the whole call (prefill included), in wall time and in process CPU time.  The ratio per batch
size is the median over rounds of (engine / HF) measured back to back.  On an idle machine with one
thread the two agree; on a shared one wall time also counts the time another job held the core, so
the CPU-time ratio is the headline.  Ends with one JSON line of the ratios (CPU time, and wall).

`--kv-layouts`: the engine against itself instead of HF, its contiguous KV layout against the paged one
(sampler.kv_layout, blocks of `--kv-block-size`), same prompts, seed and rounds; the ratio is paged / contiguous
tokens/s (> 1: paged faster).  `--prompt-len N` gives every prompt N tokens (a longer attention span).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

import torch

from megarl.protocols import GenerationRequest, SamplingParams
from megarl.sampler.engine import BuiltinEngine

LARGER = dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
              num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)


def embedded_model_dir() -> str:
    from megarl.embedded.registry import ensure_embedded_model

    return str(ensure_embedded_model("tiny-qwen2-arith"))


def larger_model_dir(root: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    path = f"{root}/qwen2-h384"
    Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **LARGER)).save_pretrained(path)
    return path


def make_prompts(batch: int, vocab: int, seed: int = 0, length: int = 0) -> list[list[int]]:
    """Random prompts of 4-16 tokens, or of exactly `length`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(n),), generator=gen).tolist()
            for n in (torch.full((batch,), length) if length else torch.randint(4, 17, (batch,), generator=gen))]


def timed(fn) -> tuple[int, float, float]:
    """(tokens, wall s, process CPU s) of one call of fn() -> tokens."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = fn()
    return tokens, time.perf_counter() - wall, time.process_time() - cpu


def engine_runner(model_dir: str, prompts: list[list[int]], new_tokens: int, **engine_kw):
    engine = BuiltinEngine.from_pretrained(model_dir, max_running=len(prompts),
                                           max_seq_len=max(map(len, prompts)) + new_tokens, **engine_kw)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens)

    def run() -> int:
        done = engine.generate([GenerationRequest(str(i), p, sampling) for i, p in enumerate(prompts)])
        assert all(len(c.token_ids) == new_tokens for c in done)
        return sum(len(c.token_ids) for c in done)
    return run


def hf_runner(model_dir: str, prompts: list[list[int]], new_tokens: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # no stop criterion: every row generates new_tokens
    pad = 0  # any id: left padding is masked out by attention_mask
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1

    def run() -> int:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=0, max_new_tokens=new_tokens, pad_token_id=pad)
        assert out.shape == (len(prompts), width + new_tokens)
        return len(prompts) * new_tokens
    return run


def compare(model_dir: str, vocab: int, batch: int, new_tokens: int, reps: int) -> dict:
    """tokens/s (wall, median over rounds) of each side and the median paired ratios (wall, CPU time)."""
    prompts = make_prompts(batch, vocab)
    runners = {"engine": engine_runner(model_dir, prompts, new_tokens), "hf": hf_runner(model_dir, prompts, new_tokens)}
    for run in runners.values():  # warm-up: allocator, MKL, HF's first-call setup
        run()
    rounds = [{name: timed(run) for name, run in runners.items()} for _ in range(reps)]
    median = statistics.median
    return {
        "engine_tok_s": round(median(r["engine"][0] / r["engine"][1] for r in rounds)),
        "hf_tok_s": round(median(r["hf"][0] / r["hf"][1] for r in rounds)),
        "ratio": round(median(r["hf"][1] / r["engine"][1] for r in rounds), 2),
        "ratio_cpu_time": round(median(r["hf"][2] / r["engine"][2] for r in rounds), 2),
    }


def compare_layouts(model_dir: str, vocab: int, batch: int, new_tokens: int, reps: int, block_size: int,
                    prompt_len: int) -> dict:
    """tokens/s (wall, median over rounds) of the engine on each KV layout and the median paired ratios paged /
    contiguous (wall, CPU time)."""
    prompts = make_prompts(batch, vocab, length=prompt_len)
    runners = {"contiguous": engine_runner(model_dir, prompts, new_tokens),
               "paged": engine_runner(model_dir, prompts, new_tokens, kv_layout="paged", kv_block_size=block_size)}
    for run in runners.values():
        run()
    rounds = [{name: timed(run) for name, run in runners.items()} for _ in range(reps)]
    median = statistics.median
    return {
        "contiguous_tok_s": round(median(r["contiguous"][0] / r["contiguous"][1] for r in rounds)),
        "paged_tok_s": round(median(r["paged"][0] / r["paged"][1] for r in rounds)),
        "ratio": round(median(r["contiguous"][1] / r["paged"][1] for r in rounds), 3),
        "ratio_cpu_time": round(median(r["contiguous"][2] / r["paged"][2] for r in rounds), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="batch 16 and 64, 32 new tokens, 3 rounds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=["embedded", "larger"], choices=["embedded", "larger"])
    parser.add_argument("--kv-layouts", action="store_true", help="the engine's paged KV layout vs its contiguous one")
    parser.add_argument("--kv-block-size", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=0, help="every prompt this long (0: 4-16 tokens)")
    args = parser.parse_args()
    if args.quick:
        args.batch_sizes, args.new_tokens, args.reps = [16, 64], 32, 3
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.new_tokens} new tokens, {args.reps} rounds")

    tmp = tempfile.mkdtemp(prefix="megarl-sampler-bench-")
    headline: dict[str, dict] = {"cpu_time": {}, "wall": {}}
    try:
        for name in args.models:
            model_dir = embedded_model_dir() if name == "embedded" else larger_model_dir(tmp)
            with open(f"{model_dir}/config.json") as f:
                vocab = json.load(f)["vocab_size"]
            for batch in args.batch_sizes:
                if args.kv_layouts:
                    row = compare_layouts(model_dir, vocab, batch, args.new_tokens, args.reps, args.kv_block_size,
                                          args.prompt_len)
                    print(f"{name:9s} batch {batch:3d}: contiguous {row['contiguous_tok_s']:7d} tok/s, paged "
                          f"{row['paged_tok_s']:7d} tok/s (wall); paged / contiguous {row['ratio_cpu_time']:.3f}x "
                          f"CPU time, {row['ratio']:.3f}x wall", flush=True)
                    headline["cpu_time"][f"{name}_b{batch}"] = row["ratio_cpu_time"]
                    headline["wall"][f"{name}_b{batch}"] = row["ratio"]
                    continue
                row = compare(model_dir, vocab, batch, args.new_tokens, args.reps)
                print(f"{name:9s} batch {batch:3d}: engine {row['engine_tok_s']:7d} tok/s, "
                      f"HF generate {row['hf_tok_s']:7d} tok/s (wall); ratio {row['ratio_cpu_time']:.2f}x CPU time, "
                      f"{row['ratio']:.2f}x wall", flush=True)
                headline["cpu_time"][f"{name}_b{batch}"] = row["ratio_cpu_time"]
                headline["wall"][f"{name}_b{batch}"] = row["ratio"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
