"""Worker of tests/sampler/test_tensor_parallel.py: one rank of a two-rank tensor-parallel built-in engine.

    torchrun --nproc-per-node=2 tests/sampler/tp_worker.py EMBEDDED_DIR BIASED_LLAMA_DIR QWEN_DIR MOE_DIR \
        QWEN3_MOE_DIR GEMMA3_DIR GLM4_MOE_DIR DEEPSEEK_V3_DIR OUT_DIR

Runs the scenarios in order over one gloo TP group and writes what each rank saw to OUT_DIR/rank{r}.pt:
  forward   - TP2 and TP1 logits of the same prefill + decode steps (four models: the embedded Qwen2, a
              Llama with non-zero o_proj/down_proj biases, which TP adds once after the all-reduce, the
              embedded tiny Mixtral (MOE_DIR) and a tiny Qwen3-MoE with q/k norms (QWEN3_MOE_DIR); the MoE
              models' routes too), and Gemma 3, GLM-4.5 and DeepSeek-V3 (multi-latent attention: heads split, the
              latents whole);
  generate  - rank 0 drives a TPLeadEngine, rank 1 runs run_follower; sampled requests, some added
              mid-run, on a random tiny Qwen2 (QWEN_DIR: high-entropy next tokens, unlike the embedded
              model on random prompts); both ranks' completions;
  swap      - the same, with kv_on_update="recompute" and versions 2 and 3 staged on the two ranks at
              different times (the follower's v2 arrives 0.5 s after the lead plans it, its v3 right
              after its v2, usually before the lead plans it);
  swap_paged - the swap schedule on the paged KV layout (blocks of 4 positions);
  missing   - the lead plans version 2, which the follower's receiver never stages: the follower's error;
  moe_swap_keep, moe_swap_recompute - the swap schedule on the embedded tiny Mixtral under each
              kv_on_update policy, versions 2 and 3 with their routers' rows rolled (`rerouted`): routes move;
  {glm4_moe,deepseek_v3}_swap_{keep,recompute} - the same on the sigmoid-routed families (shared expert, expert
              bias, a dense first layer), "keep" on the paged KV layout (SIGMOID_SWAP_LAYOUT).
The schedule (`drive`) and the weights (`perturbed`) are shared with the test's TP1 reference.
"""
from __future__ import annotations

import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.distributed.lifetime import exit_process
from megarl.models.tp_shard import shard_state_dict
from megarl.protocols import GenerationRequest, SamplingParams
from megarl.sampler.engine import BuiltinEngine
from megarl.sampler.model import KVCache, ModelSpec, forward, forward_tables, load_pretrained, prepare_weights
from megarl.sampler.tensor_parallel import TPLeadEngine, run_follower
from megarl.secret import run_secret

TIMEOUT_S = 30.0
SEED = 11
ADD_LATER_AT = 2  # the step before which the second batch of requests is added
SWAP_STAGES = {3: 2, 6: 3}  # lead step -> version it stages right before that step
# The KV layout of the sigmoid-routed families' swap scenario under each policy (both layouts, both policies, in two runs)
SIGMOID_SWAP_LAYOUT = {"keep": dict(kv_layout="paged", kv_block_size=4), "recompute": {}}


def perturbed(weights: dict[str, torch.Tensor], seed: int, scale: float = 0.02) -> dict[str, torch.Tensor]:
    """A different weight set of the same shapes (version `seed`), biases included."""
    gen = torch.Generator().manual_seed(seed)
    return {name: t + scale * torch.randn(t.shape, generator=gen) for name, t in weights.items()}


def rerouted(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """`perturbed`, and every MoE router's expert rows rolled by `seed`: the new version routes most tokens
    elsewhere, so routes recorded under it are told apart from the old version's."""
    return {name: torch.roll(t, seed, dims=0) if name.endswith(".gate.weight") else t
            for name, t in perturbed(weights, seed).items()}


def shard(weights: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in shard_state_dict(weights, 2, rank).items()}


def batches(vocab: int, stop: int) -> tuple[list[GenerationRequest], list[GenerationRequest]]:
    """Sampled requests (T=1, some with top-p, all with a stop token), more than the engine's slots."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(10):
        prompt = torch.randint(0, vocab, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen).tolist()
        sampling = SamplingParams(temperature=1.0, top_p=0.9 if i % 3 == 0 else 1.0, max_new_tokens=6 + i % 5)
        out.append(GenerationRequest(f"r{i}", prompt, sampling, stop_token_ids=(stop,)))
    return out[:6], out[6:]


def drive(engine, first, later, stage=lambda step: None) -> tuple[dict, int]:
    """Add `first`, step (adding `later` before step ADD_LATER_AT, calling stage(step) before each step)
    until everything finished; return (request id -> completion, steps)."""
    for r in first:
        engine.add_request(r)
    done, step = {}, 0
    while engine.num_unfinished or step <= ADD_LATER_AT:
        if step == ADD_LATER_AT:
            for r in later:
                engine.add_request(r)
        stage(step)
        done.update((c.request_id, c) for c in engine.step())
        step += 1
    return done, step


class Recording:
    """The follower's engine, keeping the completions run_follower discards (to compare with the lead's)."""

    def __init__(self, engine: BuiltinEngine):
        self.engine, self.done = engine, {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self, apply_staged: bool = True):
        finished = self.engine.step(apply_staged=apply_staged)
        self.done.update((c.request_id, c) for c in finished)
        return finished


def forward_logits(model_dir: str, rank: int, group) -> dict:
    """Prefill 3 right-padded rows, then 2 decode steps, at TP2 (this rank's shard) and TP1 (an MoE model's
    routes of every position under "<tp>_routes")."""
    cfg, weights = load_pretrained(model_dir)
    weights = perturbed(weights, seed=5)  # non-zero biases everywhere
    full = ModelSpec.from_hf_config(cfg)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, full.vocab_size, (3, 7), generator=gen)
    out = {}
    for tp, spec, w in (("tp1", full, weights), ("tp2", full.shard(2), shard(weights, rank))):
        group_arg = group if tp == "tp2" else None
        rw, tables, cache = prepare_weights(spec, w), forward_tables(spec, 16), KVCache(spec, 3, 16, torch.float32)
        routes = torch.zeros((3, 9, spec.num_layers, spec.top_k), dtype=torch.long) if spec.is_moe else None
        with torch.inference_mode():
            logits = [forward(spec, rw, tables, cache, ids, torch.arange(7).expand(3, 7), tp_group=group_arg,
                              routes=None if routes is None else routes[:, :7])]
            for pos in (7, 8):
                tok = logits[-1][:, -1].argmax(-1, keepdim=True)
                logits.append(forward(spec, rw, tables, cache, tok, torch.full((3, 1), pos), attn_len=pos + 1,
                                      tp_group=group_arg, routes=None if routes is None else routes[:, pos:pos + 1]))
        out[tp] = [t.clone() for t in logits]
        if routes is not None:
            out[tp + "_routes"] = routes
    return out


def swap_pair(model_dir: str, rank: int, group, kv_on_update: str, versions_of, **engine_kw) -> dict:
    """The swap scenario on `model_dir`: the lead stages v2 before step 3 and v3 before step 6; the follower's
    receiver stages v2 only after 0.5 s (the follower waits for it) and v3 right after (usually ahead of the
    lead).  `versions_of(full, version)` makes each version's whole weights."""
    cfg, full = load_pretrained(model_dir)
    versions = {v: shard(versions_of(full, v), rank) for v in SWAP_STAGES.values()}
    engine = BuiltinEngine(cfg, shard(full, rank), tp_group=group, max_running=4, max_seq_len=32, seed=SEED,
                           version=1, kv_on_update=kv_on_update, **engine_kw)

    def stage_lead(step):
        if step in SWAP_STAGES:
            engine.stage_weights(versions[SWAP_STAGES[step]], SWAP_STAGES[step])

    def follower_stager():
        time.sleep(0.5)
        for v in sorted(versions):
            engine.stage_weights(versions[v], v)

    return run_pair(rank, group, engine, stage_lead, follower_stager)


def run_pair(rank: int, group, engine: BuiltinEngine, stage_lead, follower_stager=None) -> dict:
    """Rank 0 drives `engine` as a TPLeadEngine, rank 1 follows; each rank's completions and stats."""
    if rank == 0:
        lead = TPLeadEngine(engine, group, run_secret(), timeout_s=TIMEOUT_S)
        done, steps = drive(lead, *batches(engine.spec.vocab_size, stop=3), stage=stage_lead)
        lead.close()
        return {"done": done, "steps": steps, "stats": engine.stats()}
    stager = threading.Thread(target=follower_stager) if follower_stager else None
    if stager:
        stager.start()
    recording = Recording(engine)
    steps = run_follower(recording, group, run_secret(), should_stop=lambda: False, timeout_s=TIMEOUT_S)
    if stager:
        stager.join(TIMEOUT_S)
    return {"done": recording.done, "steps": steps, "stats": engine.stats()}


def main() -> None:
    embedded_dir, llama_dir, qwen_dir, moe_dir, qwen3_moe_dir, gemma3_dir, glm4_moe_dir, deepseek_v3_dir = sys.argv[1:9]
    out = Path(sys.argv[9])
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    group = dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
    torch.set_num_threads(1)
    results = {"forward": {"embedded": forward_logits(embedded_dir, rank, group),
                           "llama_biased": forward_logits(llama_dir, rank, group),
                           "moe": forward_logits(moe_dir, rank, group),
                           "qwen3_moe": forward_logits(qwen3_moe_dir, rank, group),
                           "gemma3": forward_logits(gemma3_dir, rank, group),
                           "glm4_moe": forward_logits(glm4_moe_dir, rank, group),
                           "deepseek_v3": forward_logits(deepseek_v3_dir, rank, group)}}

    # generate: sampled, continuous batching (4 slots for 10 requests), no swap.
    engine = BuiltinEngine.from_pretrained(qwen_dir, tp_group=group, max_running=4, max_seq_len=32,
                                           seed=SEED, version=1)
    results["generate"] = run_pair(rank, group, engine, stage_lead=lambda step: None)

    results["swap"] = swap_pair(qwen_dir, rank, group, "recompute", lambda full, v: perturbed(full, seed=v))
    results["swap_paged"] = swap_pair(qwen_dir, rank, group, "recompute", lambda full, v: perturbed(full, seed=v),
                                      kv_layout="paged", kv_block_size=4)
    for policy in ("keep", "recompute"):
        results[f"moe_swap_{policy}"] = swap_pair(moe_dir, rank, group, policy, lambda full, v: rerouted(full, v))
        for kind, model_dir in (("glm4_moe", glm4_moe_dir), ("deepseek_v3", deepseek_v3_dir)):
            results[f"{kind}_swap_{policy}"] = swap_pair(model_dir, rank, group, policy, rerouted,
                                                         **SIGMOID_SWAP_LAYOUT[policy])

    # missing: the lead, idle, applies a v2 that the follower never receives (the lead's step runs no
    # forward, so it does not wait; it sends no stop, the follower has left).
    cfg, full = load_pretrained(qwen_dir)
    versions = {2: shard(perturbed(full, seed=2), rank)}
    engine = BuiltinEngine(cfg, shard(full, rank), tp_group=group, version=1)
    if rank == 0:
        engine.stage_weights(versions[2], 2)
        lead = TPLeadEngine(engine, group, run_secret(), timeout_s=TIMEOUT_S)
        lead.step()
        results["missing"] = {"version": lead.version}
    else:
        start = time.monotonic()
        try:
            run_follower(engine, group, run_secret(), should_stop=lambda: False, timeout_s=1.0)
            results["missing"] = {"error": None}
        except TimeoutError as exc:
            results["missing"] = {"error": str(exc), "waited_s": time.monotonic() - start}

    torch.save(results, out / f"rank{rank}.pt")
    exit_process(0)  # the plans went out as gloo async ops: see megarl.distributed.lifetime


if __name__ == "__main__":
    main()
