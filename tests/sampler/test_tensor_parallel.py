"""A built-in engine over two TP ranks (real processes, gloo): TP1 logits, identical ranks, lead/follower lockstep;
mixture-of-experts models (every expert's width split, the router whole) give TP1's log-probs and routes, across
in-flight updates too.

One torchrun launch of tests/sampler/tp_worker.py runs every multi-process scenario (a launch costs
seconds); the tests below each check one of its results against a TP1 engine run here.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megarl.models.tp_shard import shard_state_dict
from megarl.sampler.engine import BuiltinEngine
from megarl.sampler.model import KVCache, ModelSpec, forward, forward_tables, load_pretrained, prepare_weights
from tests.helpers import run_forked_ranks
from tests.sampler import TOL, make_tiny_model
from tests.sampler.tp_worker import SEED, SIGMOID_SWAP_LAYOUT, SWAP_STAGES, batches, drive, perturbed, rerouted



@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A random tiny Qwen2 (GQA, q/k/v biases, tied): sampled tokens of high entropy."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen"), "qwen2")


@pytest.fixture(scope="module")
def sigmoid_routed(tmp_path_factory) -> dict:
    """A tiny GLM-4.5 and DeepSeek-V3 (tests/sampler.make_tiny_model: a dense first layer, then the sigmoid router, a
    shared expert; DeepSeek-V3's multi-latent attention with a q latent)."""
    return {kind: make_tiny_model(tmp_path_factory.mktemp(kind), kind) for kind in ("glm4_moe", "deepseek_v3")}


@pytest.fixture(scope="module")
def ranks(embedded_model_dir, embedded_moe_model_dir, qwen, sigmoid_routed, tmp_path_factory) -> tuple[dict, dict]:
    """The results of both ranks of one two-rank launch of the worker."""
    llama = make_tiny_model(tmp_path_factory.mktemp("llama_biased"), "llama", attention_bias=True, mlp_bias=True)
    qwen3_moe = make_tiny_model(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", norm_topk_prob=False)
    gemma3 = make_tiny_model(tmp_path_factory.mktemp("gemma3"), "gemma3")
    out = tmp_path_factory.mktemp("tp_worker")
    proc = run_forked_ranks("tests/sampler/tp_worker.py", 2, str(embedded_model_dir), str(llama), str(qwen),
                            str(embedded_moe_model_dir), str(qwen3_moe), str(gemma3), *map(str, sigmoid_routed.values()),
                            str(out), timeout=300, warm="torch")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return tuple(torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1))


def tp1_run(model_dir, versions_of=None, **engine_kw) -> dict:
    """The worker's schedule on one TP1 engine (same seed, requests and staging steps; with `versions_of`,
    the worker's swaps: versions_of(full weights, version))."""
    cfg, full = load_pretrained(str(model_dir))
    engine = BuiltinEngine(cfg, full, max_running=4, max_seq_len=32, seed=SEED, version=1, **engine_kw)

    def stage(step):
        if versions_of is not None and step in SWAP_STAGES:
            engine.stage_weights(versions_of(full, SWAP_STAGES[step]), SWAP_STAGES[step])
    done, _ = drive(engine, *batches(engine.spec.vocab_size, stop=3), stage=stage)
    return done


def test_shard_spec_shapes_are_the_tp_shard_slices(embedded_model_dir):
    cfg, full = load_pretrained(str(embedded_model_dir))
    spec = ModelSpec.from_hf_config(cfg).shard(2)
    assert (spec.num_heads, spec.num_kv_heads, spec.intermediate_size, spec.tp_size) == (2, 1, 96, 2)
    assert (spec.hidden_size, spec.head_dim, spec.vocab_size) == (64, 16, 264)
    for rank in (0, 1):
        assert {n: tuple(t.shape) for n, t in shard_state_dict(full, 2, rank).items()} == spec.weight_shapes()


def test_an_moe_shard_holds_every_expert_and_the_whole_router_and_a_slice_of_each_experts_width(
        embedded_moe_model_dir, tmp_path):
    cfg, full = load_pretrained(str(embedded_moe_model_dir))
    spec = ModelSpec.from_hf_config(cfg).shard(2)
    assert (spec.num_experts, spec.top_k, spec.intermediate_size, spec.num_heads) == (4, 2, 48, 2)
    for rank in (0, 1):
        sliced = shard_state_dict(full, 2, rank)
        assert {n: tuple(t.shape) for n, t in sliced.items()} == spec.weight_shapes()
        router = "model.layers.1.block_sparse_moe.gate.weight"
        assert torch.equal(sliced[router], full[router])
        w1, w2 = (f"model.layers.1.block_sparse_moe.experts.3.{w}.weight" for w in ("w1", "w2"))
        assert torch.equal(sliced[w1], full[w1][rank * 48:(rank + 1) * 48])
        assert torch.equal(sliced[w2], full[w2][:, rank * 48:(rank + 1) * 48])
    qwen3_cfg = dict(json.loads((make_tiny_model(tmp_path, "qwen3_moe") / "config.json").read_text()),
                     moe_intermediate_size=33)
    with pytest.raises(ValueError, match="tensor parallel size 2 does not divide moe_intermediate_size=33"):
        ModelSpec.from_hf_config(qwen3_cfg).shard(2)


def test_shard_refuses_a_tp_size_that_does_not_divide_the_kv_heads(embedded_model_dir):
    cfg = json.loads((embedded_model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="tensor parallel size 4 does not divide num_key_value_heads=2"):
        ModelSpec.from_hf_config(cfg).shard(4)
    with pytest.raises(ValueError, match="already one of 2"):
        ModelSpec.from_hf_config(cfg).shard(2).shard(2)


@pytest.mark.parametrize("model", ["embedded", "llama_biased", "moe", "qwen3_moe", "gemma3", "glm4_moe", "deepseek_v3"])
def test_tp2_forward_equals_tp1_and_is_bit_identical_across_ranks(ranks, model):
    """Prefill then two decode steps; the Llama has o_proj/down_proj biases (added once, after the all-reduce);
    the MoE models (the embedded tiny Mixtral; a Qwen3-MoE, q/k norms and unnormalised top-k; GLM-4.5 and DeepSeek-V3,
    a dense first layer, the shared expert split as one more expert, the router and its expert bias whole) route every
    position to the same experts as TP1 on both ranks; Gemma 3 normalises o_proj's and down_proj's outputs after
    the all-reduce and scales the vocab-parallel embedding's sum; DeepSeek-V3's ranks each attend with half the heads
    over the same latent cache."""
    for rank in ranks:
        for tp1, tp2 in zip(rank["forward"][model]["tp1"], rank["forward"][model]["tp2"]):
            assert (torch.log_softmax(tp2, -1) - torch.log_softmax(tp1, -1)).abs().max() <= TOL
        if model in ("moe", "qwen3_moe", "glm4_moe", "deepseek_v3"):
            assert torch.equal(rank["forward"][model]["tp2_routes"], rank["forward"][model]["tp1_routes"])
    for a, b in zip(ranks[0]["forward"][model]["tp2"], ranks[1]["forward"][model]["tp2"]):
        assert torch.equal(a, b)


def _same(a, b) -> bool:
    routes = a.routes is None and b.routes is None or np.array_equal(a.routes, b.routes)
    return routes and (a.token_ids, a.logprobs, a.versions, a.finish_reason) == (b.token_ids, b.logprobs, b.versions,
                                                                                b.finish_reason)


def _close_to_tp1(tp2: dict, tp1: dict) -> None:
    """Same tokens, versions and finish reasons as TP1 with the same seed, log-probs to 1e-4 (TP sums in
    another order, so they differ by float rounding; a sampled token could in principle flip if a
    uniform draw lands within that rounding of a CDF boundary: it does not at these seeds)."""
    assert tp2.keys() == tp1.keys()
    for rid, c in tp2.items():
        ref = tp1[rid]
        assert (c.token_ids, c.versions, c.finish_reason) == (ref.token_ids, ref.versions, ref.finish_reason), rid
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref.logprobs)) <= 1e-4
        if ref.routes is not None:  # an MoE model: every position routed as TP1 routed it
            np.testing.assert_array_equal(c.routes, ref.routes)


def test_lead_and_follower_generate_in_lockstep_and_match_tp1(ranks, qwen):
    """Sampled (T=1, some top-p), 10 requests through 4 slots, 4 added mid-run: the follower's
    completions equal the lead's bit for bit, and both equal a TP1 engine's with the same seed."""
    lead, follower = ranks[0]["generate"], ranks[1]["generate"]
    assert len(lead["done"]) == 10 and lead["done"].keys() == follower["done"].keys()
    assert all(_same(lead["done"][rid], follower["done"][rid]) for rid in lead["done"])
    assert lead["steps"] == follower["steps"] and lead["stats"]["decode_steps"] == follower["stats"]["decode_steps"]
    assert {c.finish_reason for c in lead["done"].values()} == {"stop", "length"}
    _close_to_tp1(lead["done"], tp1_run(qwen))


def test_in_flight_swap_applies_each_version_at_the_same_step_on_both_ranks(ranks, qwen):
    """The follower's v2 arrives 0.5 s late (it waits for it), its v3 right after: both ranks apply v2
    before step 3 and v3 before step 6, as TP1 does with the same staging."""
    lead, follower = ranks[0]["swap"], ranks[1]["swap"]
    assert all(_same(lead["done"][rid], follower["done"][rid]) for rid in lead["done"])
    assert lead["stats"]["swaps"] == follower["stats"]["swaps"] == 2
    assert lead["stats"]["version"] == follower["stats"]["version"] == 3
    spans = [c.versions for c in lead["done"].values()]
    assert all(v == sorted(v) for v in spans)
    assert any({1, 2} <= set(v) for v in spans) and any(3 in v for v in spans)  # requests ran across swaps
    _close_to_tp1(lead["done"], tp1_run(qwen, lambda full, v: perturbed(full, seed=v), kv_on_update="recompute"))


def test_the_paged_layout_under_tp_gives_the_contiguous_layouts_completions(ranks):
    """Each TP rank's paged cache holds its KV heads in blocks; both ranks allocate alike (same requests, same
    steps) and agree bit for bit, and the swap schedule's completions are the contiguous layout's (log-probs within
    fp32 rounding: the paged decode sums attention over blocks)."""
    assert all(_same(ranks[0]["swap_paged"]["done"][rid], ranks[1]["swap_paged"]["done"][rid])
               for rid in ranks[0]["swap_paged"]["done"])
    paged, contiguous = ranks[0]["swap_paged"]["done"], ranks[0]["swap"]["done"]
    assert paged.keys() == contiguous.keys()
    for rid, c in contiguous.items():
        assert (paged[rid].token_ids, paged[rid].versions, paged[rid].finish_reason) == (
            c.token_ids, c.versions, c.finish_reason)
        assert max(abs(a - b) for a, b in zip(paged[rid].logprobs, c.logprobs)) <= TOL
    assert ranks[0]["swap_paged"]["stats"]["kv_blocks_used"] == ranks[1]["swap_paged"]["stats"]["kv_blocks_used"] == 0


def _routes_under(weights: dict, cfg: dict, ids: list[int]) -> np.ndarray:
    """The routes of every position of `ids` when one TP1 forward under `weights` computes them all."""
    spec = ModelSpec.from_hf_config(cfg)
    routes = torch.zeros((1, len(ids), spec.num_layers, spec.top_k), dtype=torch.long)
    with torch.inference_mode():
        forward(spec, prepare_weights(spec, weights), forward_tables(spec, 32), KVCache(spec, 1, 32, torch.float32),
                torch.tensor([ids]), torch.arange(len(ids))[None], routes=routes)
    return routes[0].numpy()


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_an_moe_engine_swapped_in_flight_at_tp2_routes_as_tp1_and_records_the_new_versions_routes(
        ranks, embedded_moe_model_dir, policy):
    """The swap schedule on the embedded tiny Mixtral, versions 2 and 3 with their routers rolled: both ranks
    agree bit for bit, tokens, log-probs and every position's routes equal TP1's with the same staging, and
    under "recompute" a request that ran into v3 holds v3's routes at every position (re-prefilled), which
    differ from v1's; under "keep" its prompt keeps the routes of the older version that computed it (TP1's
    engine is held to transformers' mixed-version routes in tests/sampler/test_engine_moe.py)."""
    lead, follower = ranks[0][f"moe_swap_{policy}"], ranks[1][f"moe_swap_{policy}"]
    assert all(_same(lead["done"][rid], follower["done"][rid]) for rid in lead["done"])
    assert lead["stats"]["swaps"] == follower["stats"]["swaps"] == 2
    _close_to_tp1(lead["done"], tp1_run(embedded_moe_model_dir, rerouted, kv_on_update=policy))
    cfg, v1 = load_pretrained(str(embedded_moe_model_dir))
    v3 = rerouted(v1, 3)
    ran_into_v3 = [c for c in lead["done"].values() if c.versions[-1] == 3 and c.versions[0] < 3]
    assert ran_into_v3
    for c in ran_into_v3:
        ids = c.prompt_ids + c.token_ids[:-1]
        under_v1, under_v3 = _routes_under(v1, cfg, ids), _routes_under(v3, cfg, ids)
        prompt = len(c.prompt_ids)
        if policy == "recompute":
            np.testing.assert_array_equal(c.routes, under_v3)
        else:
            assert not np.array_equal(c.routes[:prompt], under_v3[:prompt])  # v3 computed none of its prompt
        assert not np.array_equal(under_v1, under_v3)  # the test tells the versions apart


@pytest.mark.parametrize("policy", ["keep", "recompute"])
@pytest.mark.parametrize("kind", ["glm4_moe", "deepseek_v3"])
def test_a_sigmoid_routed_moe_swapped_in_flight_at_tp2_equals_tp1(ranks, sigmoid_routed, kind, policy):
    """The swap schedule on GLM-4.5 and DeepSeek-V3 ("keep" on the paged KV layout, "recompute" on the contiguous
    one), versions 2 and 3 with their routers rolled: both ranks agree bit for bit, and tokens, log-probs and every
    position's routes equal a TP1 engine's with the same staging and layout (which tests/sampler/test_engine_moe.py
    holds to transformers across an in-flight update, on both layouts)."""
    lead, follower = ranks[0][f"{kind}_swap_{policy}"], ranks[1][f"{kind}_swap_{policy}"]
    assert all(_same(lead["done"][rid], follower["done"][rid]) for rid in lead["done"])
    assert lead["stats"]["swaps"] == follower["stats"]["swaps"] == 2
    assert any(len(set(c.versions)) > 1 for c in lead["done"].values())  # requests ran across swaps
    _close_to_tp1(lead["done"], tp1_run(sigmoid_routed[kind], rerouted, kv_on_update=policy,
                                        **SIGMOID_SWAP_LAYOUT[policy]))


def test_follower_names_the_version_that_never_arrives(ranks):
    assert ranks[0]["missing"]["version"] == 2  # the lead applied it
    missing = ranks[1]["missing"]
    assert missing["error"] is not None and "weight version 2" in missing["error"]
    assert "staged []" in missing["error"] and 1.0 <= missing["waited_s"] < 10
