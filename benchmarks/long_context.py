"""Long rows on the megatron learner: peak memory per learner rank and step time at learner.cp = 1 and 2, for one
row or packed rows, with the attention layout or dense masks.

    python benchmarks/long_context.py [--lengths 4096 8192 16384] [--cps 1 2] [--rows single packed]
                                      [--attention layout dense] [--cap-mib 1536]

For each attention input, row kind, context-parallel size and row length S (ascending), one torchrun of `cp` gloo
ranks (one torch thread each) builds the megatron learner on a tiny random Qwen2 (hidden 64, 2 layers, 4 heads, 2 KV
groups, vocabulary 256), takes one warm-up step on a short batch, then one step on the measured batch (every
completion token trained): `single`, one row of S tokens; `packed`, a group of 8 rows that share a 64-token prompt,
one of S tokens and seven that together fill a second packed row of S positions (2 packed rows, 2 S positions, with
shared prefixes). `layout`: the learner as it is (megarl.learner.sdpa_attention.layout_attention); `dense`: boolean
[R, 1, S, S] masks built per micro-batch (benchmarks/attention_layout.py's `use_dense_masks`). Each rank reports the
step's time and its peak resident memory above what it held before that step (ru_maxrss, the kernel's high-water
mark, minus the resident set just before): the step's own memory, the model and the imports left out. A setting stops
growing S at the first length whose step needs more than --cap-mib on some rank (or fails); the longest S under the
cap is reported per setting. Prints a table, then one JSON line (with the environment's MALLOC_MMAP_THRESHOLD_:
glibc's default threshold grows with the largest buffer freed, after which freed blocks stay resident and add
retained heap to the step's live tensors; a fixed threshold measures the live tensors).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=131072, tie_word_embeddings=True, rope_theta=1000000.0,
            rms_norm_eps=1e-6)
PROMPT = 64  # the row's first tokens are its prompt (not trained)


def build_model(path: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**TINY)).save_pretrained(path)
    return path


PACKED_ROWS = 8  # the `packed` batch's rows: one of S tokens, the rest filling a second packed row of S


def batch(length: int, rows: str = "single"):
    """`rows` "single": one row of `length` random tokens; "packed": PACKED_ROWS rows sharing their first PROMPT
    tokens, one of `length` and the others' completions together `length` - PROMPT tokens; completions trained
    (lag 0)."""
    import torch

    from megarl.protocols import TrainBatch

    g = torch.Generator().manual_seed(length)
    ids = torch.randint(1, TINY["vocab_size"], (1, length), generator=g)
    lengths = [length]
    if rows == "packed":
        share = (length - PROMPT) // (PACKED_ROWS - 1)
        lengths += [PROMPT + share] * (PACKED_ROWS - 1)
        ids = ids.repeat(PACKED_ROWS, 1)
        # (the long row last in lexicographic order, so the seven short ones are neighbours: one packed row)
        ids[1:, PROMPT:] = torch.randint(1, TINY["vocab_size"] - 1, (PACKED_ROWS - 1, length - PROMPT), generator=g)
        ids[0, PROMPT] = TINY["vocab_size"] - 1
    positions = torch.arange(length)
    mask = ((positions >= PROMPT) & (positions < torch.tensor(lengths)[:, None])).float()
    ids = ids * (positions < torch.tensor(lengths)[:, None])
    return TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=-5.0 * mask,
                      versions=torch.where(mask > 0, 0, -1), advantages=mask.clone(), learner_version=0)


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(model_dir: str, cp: int, length: int, rows: str, attention: str, out: str) -> None:
    """One rank: warm-up step, then the measured step; rank r writes {out}.rank{r}.json."""
    import torch.distributed as dist

    from megarl.algo.config import LossConfig
    from megarl.config.schema import LearnerConfig
    from megarl.distributed.lifetime import exit_process
    from megarl.learner.megatron import MegatronLearner

    dist.init_process_group("gloo")
    learner = MegatronLearner(model_dir, LearnerConfig(cp=cp, micro_batch_size=PACKED_ROWS, lr=1e-6), LossConfig())
    if attention == "dense":
        from attention_layout import use_dense_masks  # (benchmarks/, this script's directory)

        use_dense_masks(learner)
    learner.train_step(batch(256, rows))
    before = resident_mib()
    dist.barrier()
    start = time.perf_counter()
    metrics = learner.train_step(batch(length, rows))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (KiB on Linux)
    Path(f"{out}.rank{dist.get_rank()}.json").write_text(json.dumps(
        {"step_s": seconds, "step_peak_mib": peak - before, "loss": metrics["loss"]}))
    dist.destroy_process_group()
    exit_process(0)


def measure(model_dir: Path, cp: int, length: int, rows: str, attention: str, workdir: Path, timeout: float) -> dict:
    out = workdir / f"{attention}_{rows}_cp{cp}_s{length}"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}", __file__,
           "--worker", str(model_dir), str(cp), str(length), rows, attention, str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": f"torchrun exit {proc.returncode}: {proc.stderr[-600:]}"}
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(cp)]
    return {"step_s": round(max(r["step_s"] for r in ranks), 3),
            "peak_mib_per_rank": round(max(r["step_peak_mib"] for r in ranks), 1), "loss": ranks[0]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", nargs="+", default=["single", "packed"], choices=["single", "packed"])
    parser.add_argument("--attention", nargs="+", default=["layout"], choices=["layout", "dense"])
    parser.add_argument("--cap-mib", type=float, default=1536.0, help="memory cap per learner rank for one step")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per measurement")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        model_dir, cp, length, rows, attention, out = args.worker
        worker(model_dir, int(cp), int(length), rows, attention, out)
        return
    with tempfile.TemporaryDirectory(prefix="long_context_") as tmp:
        workdir = Path(tmp)
        model_dir = build_model(workdir / "model")
        table: dict[str, dict] = {}
        longest: dict[str, int | None] = {}
        for attention in args.attention:
            for rows in args.rows:
                for cp in args.cps:
                    setting = f"{attention}_{rows}_cp{cp}"
                    longest[setting] = None
                    for length in sorted(args.lengths):
                        result = measure(model_dir, cp, length, rows, attention, workdir, args.timeout)
                        table[f"{setting}_s{length}"] = result
                        print(f"{attention} {rows} cp={cp} S={length}: {result}", flush=True)
                        if "error" in result or result["peak_mib_per_rank"] > args.cap_mib:
                            break
                        longest[setting] = length
    print(json.dumps({"long_context": {"cap_mib": args.cap_mib, "model": TINY, "results": table,
                                       "longest_under_cap": longest,
                                       "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}}))


if __name__ == "__main__":
    main()
