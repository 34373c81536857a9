"""Router agreement and log-prob gap between a sampler and the megatron learner on an MoE model, with routing
replay off and r3: the table of docs/moe.md.

    python benchmarks/moe_replay.py [--model embedded:tiny-mixtral-count] [--engine-dtype bfloat16] [--rows 64]

The built-in engine (weights cast to --engine-dtype; on CPU bf16 matmuls are real bf16) samples completions of
random prompts and records every position's routes; the megatron learner (fp32 on CPU) takes one step on them
with algo.routing_replay off and again, from the same weights, with r3, and reports per run what its own
router chose against the engine's routes (router/agreement, router/token_diff_frac) and the lag-0 log-prob gap
|log pi_learner - log mu_engine| (all tokens are lag 0: one version). One process, one gloo rank.
Ends with one JSON line. benchmarks/gpu_check.py's moe_replay check runs `measure` on the GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

METRICS = ("router/agreement", "router/token_diff_frac", "lag0/logprob_gap_abs", "ratio/max")


def measure(model_dir: Path, engine_dtype: str, rows: int, new_tokens: int, device: str = "cpu",
            prompt_len: int = 8, seed: int = 3) -> dict:
    """The engine's completions of `rows` random prompts, then one learner step each with replay off and r3.
    Needs torch.distributed initialised over one rank."""
    import torch

    from megarl.algo.config import LossConfig
    from megarl.config.schema import LearnerConfig
    from megarl.learner.megatron import MegatronLearner
    from megarl.models.convert import load_pretrained
    from megarl.protocols import GenerationRequest, SamplingParams, TrainBatch
    from megarl.sampler.engine import BuiltinEngine

    hf_config, weights = load_pretrained(str(model_dir))
    dtype = getattr(torch, engine_dtype)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, hf_config["vocab_size"], (prompt_len,), generator=gen).tolist() for _ in range(rows)]
    engine = BuiltinEngine(hf_config, {k: v.to(dtype) for k, v in weights.items()}, max_running=rows,
                           max_seq_len=prompt_len + new_tokens, device=device)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens)
    done = sorted(engine.generate([GenerationRequest(str(i), p, sampling) for i, p in enumerate(prompts)]),
                  key=lambda c: int(c.request_id))
    engine.close()
    length = max(len(c.prompt_ids) + len(c.token_ids) for c in done)
    layers, k = done[0].routes.shape[1:]
    ids = torch.zeros((rows, length), dtype=torch.long)
    mask, behaviour = torch.zeros((rows, length)), torch.zeros((rows, length))
    routes = torch.arange(k, dtype=torch.uint8).expand(rows, length, layers, k).clone()
    for r, c in enumerate(done):
        seq = c.prompt_ids + c.token_ids
        ids[r, :len(seq)] = torch.tensor(seq)
        mask[r, len(c.prompt_ids):len(seq)] = 1.0
        behaviour[r, len(c.prompt_ids):len(seq)] = torch.tensor(c.logprobs)
        routes[r, :len(seq) - 1] = torch.as_tensor(c.routes.astype("int64"))
    out = {"model": hf_config["model_type"], "experts": hf_config.get("num_local_experts") or hf_config.get("num_experts"),
           "top_k": int(k), "moe_layers": int(layers), "engine_dtype": engine_dtype, "tokens": int(mask.sum())}
    for replay in ("off", "r3"):
        learner = MegatronLearner(str(model_dir), LearnerConfig(micro_batch_size=16, lr=1e-6), LossConfig(),
                                  routing_replay=replay)
        m = learner.train_step(TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=behaviour,
                                          versions=torch.where(mask > 0, 0, -1), advantages=mask, learner_version=0,
                                          routes=routes))
        out[replay] = {key: round(m[key], 6) for key in METRICS if key in m}
        out[replay]["learner_dtype"] = str(next(learner.gpt.parameters()).dtype).replace("torch.", "")
        del learner
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="embedded:tiny-mixtral-count")
    parser.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    from megarl.embedded.registry import ensure_embedded_model

    model_dir = (ensure_embedded_model(args.model.split(":", 1)[1]) if args.model.startswith("embedded:")
                 else Path(args.model))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        result = measure(model_dir, args.engine_dtype, args.rows, args.new_tokens)
        dist.destroy_process_group()
    print(json.dumps({"moe_replay": {"model_path": args.model, **result}}))


if __name__ == "__main__":
    main()
