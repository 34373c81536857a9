"""vLLM vs the built-in engine: generated tokens/s on CPU, same model, prompts and batch, side by side in one run.

    python benchmarks/vllm_throughput.py [--batch-sizes 8 32 64] [--reps 3] [--new-tokens 48] [--threads 1]

Model: the demo's vLLM variant `tiny-qwen2-count-hd32` (built locally on first use; hidden 64, 2 layers,
2 heads of 32). Prompts: the count task's ("d-k="), drawn with a fixed seed; temperature 1, top_p 1, top_k 0;
each engine stops at EOS or --new-tokens, so tokens/s = tokens generated / wall time of the whole batch
(prefill included). The built-in engine runs in this process with --threads torch threads and
max_running = batch; vLLM 0.32.0 (its own environment, megarl.sampler.vllm_env) runs as a server with
OMP_NUM_THREADS=--threads, --max-num-seqs = batch, eager mode, driven over HTTP by megarl's VLLMEngine (one
streaming request per rollout, log-probs and versions recorded, as in training). vLLM's API server and engine
core are separate processes, so it uses more than --threads cores for HTTP and scheduling.

Rounds alternate the engines after one warm-up each; per batch size the median tokens/s of each over the rounds.
The last line is one JSON object.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.protocols import GenerationRequest, SamplingParams  # noqa: E402


def requests(tokenizer, n: int, new_tokens: int, seed: int, tag: str):
    from megarl.rollout.tasks import CountTask

    prompts = CountTask().sample_prompts(random.Random(seed), n)
    return [GenerationRequest(f"{tag}{i}", tokenizer.encode(p.text, add_special_tokens=False),
                              SamplingParams(1.0, 1.0, 0, new_tokens), stop_token_ids=(256,))
            for i, p in enumerate(prompts)]


def timed(engine, reqs) -> tuple[float, int]:
    start = time.perf_counter()
    out = engine.generate(reqs)
    return time.perf_counter() - start, sum(len(c.token_ids) for c in out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from megarl.config.schema import VLLMConfig
    from megarl.distributed.sglang_publish import free_port
    from megarl.embedded.registry import ensure_embedded_model
    from megarl.sampler.engine import BuiltinEngine
    from megarl.sampler.vllm_env import ensure_env
    from megarl.sampler.vllm_engine import VLLMEngine, server_command, server_env

    torch.set_num_threads(args.threads)
    model_dir = ensure_embedded_model("tiny-qwen2-count-hd32")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    python, _ = ensure_env()
    context = 128
    results = {}
    for batch in args.batch_sizes:
        builtin = BuiltinEngine.from_pretrained(str(model_dir), max_running=batch, max_seq_len=context, seed=0)
        port = free_port("127.0.0.1")
        env = server_env(os.environ, VLLMConfig(), threads=args.threads)
        cmd = server_command(python, model_dir, port, 0, max_model_len=context, max_num_seqs=batch)
        t0 = time.perf_counter()
        vllm = VLLMEngine.start(cmd, env, Path(tempfile.mkdtemp(prefix="megarl-vllm-bench-")) / "vllm.log", port,
                                model_dir=model_dir, max_running=batch, context_length=context,
                                startup_timeout_s=600, request_timeout_s=300)
        startup = time.perf_counter() - t0
        try:
            timed(builtin, requests(tokenizer, batch, args.new_tokens, 99, "wb"))
            timed(vllm, requests(tokenizer, batch, args.new_tokens, 99, "wv"))
            rates = {"builtin": [], "vllm": []}
            for rep in range(args.reps):
                for name, engine in (("builtin", builtin), ("vllm", vllm)):
                    seconds, tokens = timed(engine, requests(tokenizer, batch, args.new_tokens, rep, f"{name}{rep}-"))
                    rates[name].append(tokens / seconds)
            row = {name: round(statistics.median(r), 1) for name, r in rates.items()}
            row["vllm_over_builtin"] = round(row["vllm"] / row["builtin"], 3)
            row["vllm_startup_s"] = round(startup, 1)
            results[str(batch)] = row
            print(f"batch {batch:4d}: built-in {row['builtin']:8.1f} tok/s   vLLM {row['vllm']:8.1f} tok/s   "
                  f"ratio {row['vllm_over_builtin']:.2f}   (vLLM start-up {startup:.0f}s)", flush=True)
        finally:
            vllm.close()
    print(json.dumps({"benchmark": "vllm_throughput", "model": "tiny-qwen2-count-hd32", "threads": args.threads,
                      "new_tokens": args.new_tokens, "tokens_per_s": results}))


if __name__ == "__main__":
    main()
