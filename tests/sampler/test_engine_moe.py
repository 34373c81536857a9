"""BuiltinEngine on a mixture-of-experts model (tiny Mixtral, Qwen3-MoE, gpt-oss, GLM-4.5, DeepSeek-V3): log-probs and
routes equal transformers', and across an in-flight update every position's routes are those of the weights that
computed it; DeepSeek-V3's multi-latent attention cache and its absorbed decode; a gpt-oss checkpoint in MXFP4."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megarl.protocols import GenerationRequest, SamplingParams
from megarl.sampler.engine import BuiltinEngine
from megarl.sampler.model import ModelSpec, load_pretrained
from tests.helpers import fp32_logprob_tol
from tests.sampler import (TOL, hf_logprobs_and_routes, make_tiny_model, save_version, transformers_logprobs,
                           transformers_model)

LAYERS, TOP_K, EXPERTS = 2, 2, 4


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("mixtral"), "mixtral")
    return path, *load_pretrained(str(path))


def requests(n, sampling, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 12, (n,), generator=gen).tolist()
    return [GenerationRequest(str(i), torch.randint(0, 32, (k,), generator=gen).tolist(), sampling)
            for i, k in enumerate(lens)]


def test_spec_parses_mixtral(mixtral):
    """(Its tensor-parallel shards: tests/sampler/test_tensor_parallel.py.)"""
    _, cfg, _ = mixtral
    spec = ModelSpec.from_hf_config(cfg)
    assert (spec.num_experts, spec.top_k, spec.is_moe) == (EXPERTS, TOP_K, True)
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide num_attention_heads=4"):
        spec.shard(3)
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        ModelSpec.from_hf_config(dict(cfg, num_experts_per_tok=5))


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0, max_new_tokens=8),
                                      SamplingParams(temperature=1.0, max_new_tokens=10)])
def test_logprobs_and_routes_equal_transformers(mixtral, sampling):
    path, cfg, weights = mixtral
    completions = BuiltinEngine(cfg, weights, max_running=4, version=3).generate(requests(6, sampling))
    for c in completions:
        n = len(c.prompt_ids)
        assert c.routes.dtype == np.uint8 and c.routes.shape == (n + len(c.token_ids) - 1, LAYERS, TOP_K)
        logp, routes = hf_logprobs_and_routes(c.prompt_ids + c.token_ids, (path, None))
        expected = [logp[n - 1 + i, tok].item() for i, tok in enumerate(c.token_ids)]
        assert max(abs(a - b) for a, b in zip(c.logprobs, expected)) <= TOL
        np.testing.assert_array_equal(c.routes, routes[:-1])  # the last token is never an input
        assert c.versions == [3] * len(c.token_ids)


def test_a_prefill_in_chunks_records_every_positions_routes(mixtral):
    """Prompts prefilled in chunks of 3 positions (sampler.prefill_chunk): each chunk writes its positions'
    routes, so every completion's routes and log-probs are still transformers' on its own tokens."""
    path, cfg, weights = mixtral
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    completions = BuiltinEngine(cfg, weights, max_running=4, prefill_chunk=3).generate(requests(4, sampling, seed=2))
    assert max(len(c.prompt_ids) for c in completions) > 2 * 3  # some prompt spans three chunks
    for c in completions:
        n = len(c.prompt_ids)
        logp, routes = hf_logprobs_and_routes(c.prompt_ids + c.token_ids, (path, None))
        assert max(abs(c.logprobs[i] - logp[n - 1 + i, tok].item()) for i, tok in enumerate(c.token_ids)) <= TOL
        np.testing.assert_array_equal(c.routes, routes[:-1])


def test_a_prompt_prefilled_once_gives_every_request_its_routes(mixtral):
    """Requests with one prompt are prefilled once (megarl.sampler.engine: the others copy its cache slot and, on
    an MoE model, its routes): every completion's routes and log-probs are transformers' on its own tokens."""
    path, cfg, weights = mixtral
    prompt = requests(1, None, seed=5)[0].prompt_ids
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    engine = BuiltinEngine(cfg, weights, max_running=4, version=1)
    completions = engine.generate([GenerationRequest(str(i), prompt, sampling) for i in range(4)])
    assert engine.stats()["prefill_tokens"] == len(prompt)
    for c in completions:
        n = len(c.prompt_ids)
        logp, routes = hf_logprobs_and_routes(c.prompt_ids + c.token_ids, (path, None))
        assert max(abs(c.logprobs[i] - logp[n - 1 + i, tok].item()) for i, tok in enumerate(c.token_ids)) <= TOL
        np.testing.assert_array_equal(c.routes, routes[:-1])


def test_qwen3_moe_logprobs_and_routes_equal_transformers(tmp_path):
    """Qwen3-MoE: per-head q/k RMSNorm before RoPE, and the top-k weights not renormalised (norm_topk_prob false;
    true routes as Mixtral)."""
    path = make_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe", norm_topk_prob=False)
    cfg, weights = load_pretrained(str(path))
    spec = ModelSpec.from_hf_config(cfg)
    assert (spec.norm_topk, spec.qk_norm, ModelSpec.from_hf_config(dict(cfg, norm_topk_prob=True)).norm_topk) == (
        False, True, True)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelSpec.from_hf_config(dict(cfg, mlp_only_layers=[1]))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in weights
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10)
    for c in BuiltinEngine(cfg, weights, max_running=4).generate(requests(4, sampling)):
        n = len(c.prompt_ids)
        logp, routes = hf_logprobs_and_routes(c.prompt_ids + c.token_ids, (path, None))
        expected = [logp[n - 1 + i, tok].item() for i, tok in enumerate(c.token_ids)]
        assert max(abs(a - b) for a, b in zip(c.logprobs, expected)) <= TOL
        np.testing.assert_array_equal(c.routes, routes[:-1])


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_routes_across_an_inflight_update_come_from_the_weights_that_computed_them(mixtral, policy, tmp_path):
    """v1 computes the prompt and the first decode inputs; v2 the rest ("recompute": all of it again)."""
    path, cfg, weights = mixtral
    gen = torch.Generator().manual_seed(5)
    v2 = {k: t + 0.3 * torch.randn(t.shape, generator=gen) if k.endswith("gate.weight") else t.clone()
          for k, t in weights.items()}  # a different router: the two versions route many tokens differently
    v2_dir = save_version(path, v2, tmp_path / "v2")
    engine = BuiltinEngine(cfg, weights, max_running=4, kv_on_update=policy)
    reqs = requests(4, SamplingParams(temperature=1.0, max_new_tokens=10), seed=1)
    for r in reqs:
        engine.add_request(r)
    done = {}
    for _ in range(3):  # step 1: prefill (token 1) + decode (token 2); then 2 decodes: positions < n + 3 by v1
        done.update((c.request_id, c) for c in engine.step())
    engine.stage_weights(v2, 1)
    while engine.num_unfinished:
        done.update((c.request_id, c) for c in engine.step())
    differ = 0
    for r in reqs:
        c = done[r.request_id]
        n = len(c.prompt_ids)
        assert c.versions == [0] * 4 + [1] * 6
        ids = c.prompt_ids + c.token_ids
        split = n + 3  # v1 computed positions [0, split); v2 the later ones and, under "recompute", all again
        versions = [(v2_dir, None)] if policy == "recompute" else [(path, split), (v2_dir, None)]
        _, expected = hf_logprobs_and_routes(ids, *versions)
        np.testing.assert_array_equal(c.routes, expected[:-1])
        _, all_v1 = hf_logprobs_and_routes(ids, (path, None))
        differ += int((all_v1[:-1] != c.routes).any(axis=(1, 2)).sum())
    assert differ > 0  # the test can tell the versions apart


def test_routes_survive_slot_packing(mixtral):
    """Requests of different lengths finish, survivors move slots: each keeps its own routes."""
    path, cfg, weights = mixtral
    reqs = [GenerationRequest(r.request_id, r.prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=2 + i))
            for i, r in enumerate(requests(6, None, seed=2))]
    for c in BuiltinEngine(cfg, weights, max_running=3).generate(reqs):
        _, routes = hf_logprobs_and_routes(c.prompt_ids + c.token_ids, (path, None))
        np.testing.assert_array_equal(c.routes, routes[:-1])


def test_dense_models_record_no_routes(tmp_path):
    path = make_tiny_model(tmp_path, "qwen2")
    cfg, weights = load_pretrained(str(path))
    [c] = BuiltinEngine(cfg, weights).generate(requests(1, SamplingParams(temperature=0.0, max_new_tokens=3)))
    assert c.routes is None


def test_a_multi_turn_episodes_routes_come_from_the_prefill_that_computed_them(tmp_path):
    """A tool-style episode on the real chat tokenizer: a model turn under v1, an environment turn, an in-flight
    update to v2 (routers moved), a second model turn. The second turn's request carries the whole episode, so its
    prefill computed the environment tokens (and recomputed turn 1) under v2: the sample's routes are transformers'
    v2 routes of the episode, which differ from v1's, and the positions after the last input are the filler."""
    from megarl.embedded.tiny_chat import build_chat_tokenizer
    from megarl.protocols import Prompt
    from megarl.rollout.chat import ChatTranscript
    from megarl.rollout.episode import Episode

    tokenizer = build_chat_tokenizer()
    path = make_tiny_model(tmp_path / "v1", "mixtral", vocab_size=len(tokenizer))
    cfg, weights = load_pretrained(str(path))
    v2 = {n: (t + 0.5 * torch.randn_like(t) if n.endswith("gate.weight") else t) for n, t in weights.items()}
    v2_dir = save_version(path, v2, tmp_path / "v2")
    engine = BuiltinEngine(cfg, weights, max_running=1)
    stop = (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    chat = ChatTranscript(tokenizer, [{"role": "user", "content": "what is 6*7?"}])
    episode = Episode(key="g/0", prompt=Prompt("what is 6*7?", "42"), chat=chat, prompt_len=len(chat.ids))

    first = engine.generate([GenerationRequest("t1", list(chat.ids), sampling, stop)])[0]
    episode.add_model_turn(first, stop)
    episode.add_environment_turn(chat.prepare([{"role": "tool", "content": "42"}]))
    env_start, env_end = (episode.prompt_len + i for i in episode.env_spans[0])
    engine.stage_weights(v2, 1)
    second = engine.generate([GenerationRequest("t2", list(chat.ids), sampling, stop)])[0]
    assert second.versions == [1] * len(second.token_ids)
    episode.add_model_turn(second, stop)

    routes = episode.sample_routes()
    computed = len(second.prompt_ids) + len(second.token_ids) - 1
    _, v2_routes = hf_logprobs_and_routes(chat.ids, (v2_dir, None))
    _, v1_routes = hf_logprobs_and_routes(chat.ids, (path, None))
    np.testing.assert_array_equal(routes[:computed], v2_routes[:computed])
    assert (v1_routes[env_start:env_end] != v2_routes[env_start:env_end]).any()  # the test tells v1 from v2
    assert routes.shape[0] == len(chat.ids) - 1 and (routes[computed:] == np.arange(TOP_K)).all()


def test_the_paged_layout_gives_the_contiguous_layouts_completions_and_routes(mixtral):
    """sampler.kv_layout=paged on an MoE model: the same tokens and routes, log-probs within fp32 rounding (the
    paged decode sums attention over blocks; a shared prompt's copy included; routes live in the slot buffers)."""
    _, cfg, weights = mixtral
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    reqs = requests(5, sampling, seed=3)
    reqs.append(GenerationRequest("copy", reqs[0].prompt_ids, sampling))
    runs = [BuiltinEngine(cfg, weights, max_running=3, prefill_chunk=4, seed=1, kv_layout=layout,
                          kv_block_size=4).generate(reqs) for layout in ("contiguous", "paged")]
    for c, p in zip(*runs):
        assert p.token_ids == c.token_ids
        assert max(abs(a - b) for a, b in zip(p.logprobs, c.logprobs)) <= TOL
        np.testing.assert_array_equal(p.routes, c.routes)


# ------------------------------------------- gpt-oss, GLM-4.5 (their own routers and expert layouts; native forward)
NATIVE_MOE = ("gpt_oss", "glm4_moe", "deepseek_v3")


@pytest.fixture(scope="module", params=NATIVE_MOE)
def native_moe(request, tmp_path_factory):
    """(kind, path, config, weights) of a tiny gpt-oss, GLM-4.5 and DeepSeek-V3 (tests/sampler.make_tiny_model)."""
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, path, *load_pretrained(str(path))


def _native_tol(cfg) -> float:
    """The fp32 bound of tests.helpers.fp32_logprob_tol at the tiny model's own sizes (|log-prob| <= 8, checked
    where it is used): the engine and transformers differ only in reduction order (the input and post-attention norm
    weights folded into the stacked projections, every expert computed for every token and weighted by zero off the
    chosen k, gpt-oss's sink column appended in another order, GLM-4.5's shared expert summed with the routed ones,
    DeepSeek-V3's attention multiplied out in its latent space); the routers' top-k is the same on such decisive
    routers."""
    return fp32_logprob_tol(cfg, max_logprob=8.0)


def _same_routes(got: np.ndarray, expected: np.ndarray, cfg: dict) -> None:
    """Equal routes: in the router's top-k order, or, for a sigmoid-routed family (whose transformers router takes
    an unsorted top-k), the same set of experts per position and layer."""
    from megarl.models.moe import SIGMOID_ROUTED

    if cfg["model_type"] in SIGMOID_ROUTED:
        got, expected = np.sort(got, axis=-1), np.sort(expected, axis=-1)
    np.testing.assert_array_equal(got, expected)


def test_gpt_oss_runs_natively_and_names_what_it_refuses(tmp_path):
    from megarl.models.layout import check_layout
    from megarl.sampler import hf_model, model as native

    cfg, weights = load_pretrained(str(make_tiny_model(tmp_path, "gpt_oss")))
    spec = ModelSpec.from_hf_config(cfg)
    assert hf_model.choose(cfg) is native and spec.gpt_oss and spec.layer_windows == (4, None)
    assert (spec.num_experts, spec.top_k, spec.swiglu_limit) == (EXPERTS, TOP_K, 2.0)
    assert "model.layers.1.mlp.experts.gate_up_proj" in weights and "model.layers.0.self_attn.sinks" in weights
    with pytest.raises(ValueError, match="sampler.tp = 1"):
        spec.shard(2)
    with pytest.raises(ValueError, match="sampler.tp=2: gpt_oss's fused experts"):
        check_layout(cfg, sampler_tp=2)  # (before a launch)
    with pytest.raises(ValueError, match="quantization_config='bitsandbytes'"):  # (MXFP4 loads: the test below)
        ModelSpec.from_hf_config(dict(cfg, quantization_config={"quant_method": "bitsandbytes"}))


def test_glm4_moe_runs_natively_with_its_router_and_names_what_it_refuses(tmp_path):
    """GLM-4.5's spec: partial RoPE, q/k/v biases without an o_proj bias, q/k norms, the router's group limit and
    scaling, a shared expert, the first layer dense (routes for the MoE layers only); at sampler.tp=2 half of every
    width (the shared expert's and the dense layer's too), the layout check passing before a launch."""
    from megarl.models.layout import check_layout
    from megarl.sampler import hf_model, model as native
    from tests.helpers import GLM4_MOE_ROUTER

    cfg, weights = load_pretrained(str(make_tiny_model(tmp_path, "glm4_moe")))
    spec = ModelSpec.from_hf_config(cfg)
    assert hf_model.choose(cfg) is native and spec.sigmoid_router
    assert (spec.rotary_dim, spec.rope_dim, spec.qkv_bias, spec.o_bias, spec.qk_norm) == (8, 8, True, False, True)
    assert (spec.num_experts, spec.top_k, spec.n_group, spec.topk_group) == tuple(
        GLM4_MOE_ROUTER[k] for k in ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"))
    assert (spec.routed_scaling, spec.shared_ffn_size, spec.dense_layers, spec.num_moe_layers) == (2.5, 16, 1, 1)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in weights and "model.layers.0.mlp.gate_proj.weight" in weights
    half = spec.shard(2)  # (tests/sampler/test_tensor_parallel.py runs it)
    assert (half.num_heads, half.num_kv_heads, half.intermediate_size, half.shared_ffn_size, half.dense_ffn_size) == (
        2, 1, 8, 8, 24)
    check_layout(cfg, sampler_tp=2)
    with pytest.raises(ValueError, match="norm_topk_prob"):
        ModelSpec.from_hf_config(dict(cfg, norm_topk_prob=False))


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0, max_new_tokens=8),
                                      SamplingParams(temperature=1.0, max_new_tokens=10)])
def test_native_moe_logprobs_and_routes_equal_transformers(native_moe, sampling):
    """Six requests through four slots (continuous batching; gpt-oss's prompts and completions past its sliding window
    of 4): every behaviour log-prob is transformers' (eager attention, fp32) within the fp32 bound, and every
    position's routes are its routers' choice (gpt-oss: in its top-k order)."""
    kind, path, cfg, weights = native_moe
    tol, worst, moe_layers = _native_tol(cfg), 0.0, ModelSpec.from_hf_config(cfg).num_moe_layers
    completions = BuiltinEngine(cfg, weights, max_running=4, version=3).generate(requests(6, sampling))
    assert max(len(c.prompt_ids) + len(c.token_ids) for c in completions) > 2 * 4
    for c in completions:
        n = len(c.prompt_ids)
        assert c.routes.dtype == np.uint8 and c.routes.shape == (n + len(c.token_ids) - 1, moe_layers, c.routes.shape[2])
        logp, routes = hf_logprobs_and_routes(c.prompt_ids + c.token_ids, (path, None))
        expected = [logp[n - 1 + i, tok].item() for i, tok in enumerate(c.token_ids)]
        assert all(abs(e) <= 8.0 for e in expected)  # (the bound's |log-prob| <= 8 on these tokens)
        worst = max(worst, max(abs(a - b) for a, b in zip(c.logprobs, expected)))
        _same_routes(c.routes, routes[:-1], cfg)
        assert c.versions == [3] * len(c.token_ids)
    assert worst <= tol, (worst, tol)


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_native_moe_across_an_inflight_update_equals_transformers_over_its_cache(native_moe, policy, tmp_path):
    """v1 computes the prompt and the first decode inputs, v2 (routers moved; gpt-oss's sinks and expert biases,
    GLM-4.5's expert bias too) the rest; "keep": transformers continuing v1's KV cache under v2, "recompute":
    transformers' v2 forward over it all. Every token's log-prob and every position's routes are those of the weights
    that computed it, on the contiguous and the paged KV layout (blocks of 3 positions) alike."""
    kind, path, cfg, weights = native_moe
    gen = torch.Generator().manual_seed(5)
    moved = ("router.weight", "router.bias", "sinks", "experts.down_proj_bias", "mlp.gate.weight",
             "e_score_correction_bias")
    v2 = {k: t + 0.3 * t.std() * torch.randn(t.shape, generator=gen) if k.endswith(moved) else t.clone()
          for k, t in weights.items()}
    v2_dir = save_version(path, v2, tmp_path / "v2")
    reqs = requests(4, SamplingParams(temperature=1.0, max_new_tokens=10), seed=1)
    layouts = {}
    for layout in ("contiguous", "paged"):
        engine = BuiltinEngine(cfg, weights, max_running=4, kv_on_update=policy, kv_layout=layout, kv_block_size=3)
        for r in reqs:
            engine.add_request(r)
        done = layouts[layout] = {}
        for _ in range(3):
            done.update((c.request_id, c) for c in engine.step())
        engine.stage_weights(v2, 1)
        while engine.num_unfinished:
            done.update((c.request_id, c) for c in engine.step())
    tol, differ = _native_tol(cfg), 0
    for r in reqs:
        c, paged = layouts["contiguous"][r.request_id], layouts["paged"][r.request_id]
        assert paged.token_ids == c.token_ids
        np.testing.assert_array_equal(paged.routes, c.routes)
        n = len(c.prompt_ids)
        assert c.versions == [0] * 4 + [1] * 6
        ids, split = c.prompt_ids + c.token_ids, n + 3
        v1_logp, _ = hf_logprobs_and_routes(ids, (path, None))
        logp, expected = hf_logprobs_and_routes(ids, *([(v2_dir, None)] if policy == "recompute" else
                                                      [(path, split), (v2_dir, None)]))
        _same_routes(c.routes, expected[:-1], cfg)
        got = [(v1_logp if i < 4 else logp)[n - 1 + i, tok].item() for i, tok in enumerate(c.token_ids)]
        for run in (c, paged):
            assert max(abs(a - b) for a, b in zip(run.logprobs, got)) <= tol
        _, all_v1 = hf_logprobs_and_routes(ids, (path, None))
        differ += int((np.sort(all_v1[:-1], -1) != np.sort(c.routes, -1)).any(axis=(1, 2)).sum())
    assert differ > 0  # the test can tell the versions apart


# ------------------------------------------------------------- DeepSeek-V3: multi-latent attention, native forward
@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3")
    return path, *load_pretrained(str(path))


def _latent_cache_logprobs(cfg, weights, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Log-probs [rows, positions, V] of the native forward: a prefill of the first `prefill` positions (the rows in
    slots 1.., as the engine's packed rows), then one position per call (the absorbed decode over the latent cache)."""
    from megarl.sampler.model import KVCache, forward, forward_tables, prepare_weights

    spec = ModelSpec.from_hf_config(cfg)
    rows, width = ids.shape
    cache, tables, w = KVCache(spec, rows + 1, width, torch.float32), forward_tables(spec, width), prepare_weights(
        spec, weights)
    with torch.inference_mode():
        out = [forward(spec, w, tables, cache, ids[:, :prefill], torch.arange(prefill).expand(rows, prefill),
                       slot_start=1)]
        out += [forward(spec, w, tables, cache, ids[:, t:t + 1], torch.full((rows, 1), t), slot_start=1,
                        attn_len=t + 1) for t in range(prefill, width)]
    return torch.log_softmax(torch.cat(out, dim=1), -1)


@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_deepseek_v3_caches_one_latent_per_position_and_equals_transformers(deepseek_v3, q_lora_rank, tmp_path):
    """The cache holds per position and layer the kv latent and the shared key's RoPE dims, kv_lora_rank + rope =
    16 + 4 values, where per-head K and V would be 4 x (8 + 4 + 6); the softmax scale is transformers' (YaRN's mscale
    folded in); a prefill and the absorbed decode after it give transformers' log-probs, with a q latent and with one
    q_proj."""
    from megarl.sampler.model import KVCache

    path, cfg, weights = deepseek_v3
    if q_lora_rank is None:
        path = make_tiny_model(tmp_path, "deepseek_v3", q_lora_rank=None)
        cfg, weights = load_pretrained(str(path))
    spec = ModelSpec.from_hf_config(cfg)
    hf = transformers_model(path)
    assert (spec.latent, spec.kv_lora_rank, spec.head_dim, spec.q_lora_rank) == (True, 16, 4, q_lora_rank)
    assert spec.attn_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    cache = KVCache(spec, num_slots=2, max_seq_len=8, dtype=torch.float32)
    assert cache.k is None and cache.latent.shape == (2, 2, 8, 16 + 4)
    ids = torch.randint(0, 32, (3, 20), generator=torch.Generator().manual_seed(1))
    ours = _latent_cache_logprobs(cfg, weights, ids, prefill=12)
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits.float(), -1)
    assert ref.abs().max() <= 8.0  # (the bound's |log-prob|)
    assert (ours - ref).abs().max() <= TOL


def test_deepseek_v3_shards_its_heads_and_keeps_its_latents_whole(deepseek_v3):
    """At sampler.tp=2 a rank holds half the heads of q_b_proj and kv_b_proj (each head's rows) and their o_proj
    columns, half of every expert's, the shared expert's and the dense layer's width, and the latent projections,
    their norms, the router and its expert bias whole (what tests/sampler/test_tensor_parallel.py runs); the layout
    check passes before a launch; a config it cannot run is named by its field."""
    from megarl.models.layout import check_layout
    from megarl.models.tp_shard import shard_state_dict
    from megarl.sampler import hf_model, model as native

    _, cfg, weights = deepseek_v3
    assert hf_model.choose(cfg) is native
    spec = ModelSpec.from_hf_config(cfg).shard(2)
    assert (spec.num_heads, spec.intermediate_size, spec.shared_ffn_size, spec.dense_ffn_size) == (2, 8, 8, 24)
    attn = "model.layers.1.self_attn."
    for rank in (0, 1):
        sliced = shard_state_dict(weights, 2, rank)
        assert {n: tuple(t.shape) for n, t in sliced.items()} == spec.weight_shapes()
        heads = slice(rank * 2 * (8 + 6), (rank + 1) * 2 * (8 + 6))  # (kv_b_proj: each head's 8 k-nope, 6 v rows)
        assert torch.equal(sliced[attn + "kv_b_proj.weight"], weights[attn + "kv_b_proj.weight"][heads])
        assert torch.equal(sliced[attn + "o_proj.weight"], weights[attn + "o_proj.weight"][:, rank * 12:(rank + 1) * 12])
        for whole in ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                      "self_attn.kv_a_layernorm.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias"):
            assert torch.equal(sliced["model.layers.1." + whole], weights["model.layers.1." + whole])
    check_layout(cfg, sampler_tp=2)
    with pytest.raises(ValueError, match="sampler.tp=4: tensor parallel size 4 does not divide intermediate_size=6"):
        check_layout(dict(cfg, intermediate_size=6, moe_intermediate_size=4), sampler_tp=4)
    with pytest.raises(ValueError, match="rope_interleave"):
        ModelSpec.from_hf_config(dict(cfg, rope_interleave=False))


def test_deepseek_v3_decode_stays_transformers_full_forward_over_a_long_continuously_batched_run(deepseek_v3):
    """The engine's absorbed decode of DeepSeek-V3 (latent cache, interleaved RoPE at each row's own position, sigmoid
    routing per token) does not drift from transformers' full forward: three rows of 64 sampled tokens, two running
    at a time (the third admitted as a slot frees, rows moved between slots), every token's behaviour log-prob within
    the fp32 bound for rows of up to 96 positions."""
    path, cfg, weights = deepseek_v3
    engine = BuiltinEngine(cfg, weights, max_running=2, max_seq_len=96, seed=3)
    reqs = [GenerationRequest(str(i), [(5 * i + 3 * j) % 32 for j in range(4 + 6 * i)],
                              SamplingParams(temperature=1.0, max_new_tokens=64)) for i in range(3)]
    reference = transformers_model(path)
    bound = fp32_logprob_tol(cfg, max_logprob=8.0, max_seq_len=96)
    for c in engine.generate(reqs):
        assert len(c.token_ids) == 64
        lp, n = transformers_logprobs(reference, c.prompt_ids + c.token_ids), len(c.prompt_ids)
        assert max(abs(lp[n - 1 + i, t].item()) for i, t in enumerate(c.token_ids)) <= 8.0
        assert max(abs(c.logprobs[i] - lp[n - 1 + i, t].item()) for i, t in enumerate(c.token_ids)) <= bound


def test_deepseek_v3_tokens_after_a_keep_swap_are_the_new_weights_over_the_old_latent_cache(deepseek_v3, tmp_path):
    """What a lag-0 token's behaviour log-prob is when its row began under an older version and the engine kept
    its cache (kv_on_update=keep; docs/models.md, "DeepSeek-V3's lag-0 gap under keep"): the cache holds each
    position's kv latent (after kv_a_layernorm) and its RoPE key, so the new version expands the old version's latents
    with its own kv_b_proj, as transformers' own cache does across two models; every token after the swap is that to
    the fp32 bound. The learner recomputes the whole row under the new version, which differs from it by the swap's
    own change (here well above 1e-3): that, not numerical error, is such a token's gap."""
    from transformers import DynamicCache

    path, cfg, weights = deepseek_v3
    gen = torch.Generator().manual_seed(5)
    v2 = {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in weights.items()}
    engine = BuiltinEngine(cfg, weights, max_running=4, max_seq_len=40, kv_on_update="keep")
    reqs = requests(4, SamplingParams(temperature=0.0, max_new_tokens=8), seed=3)
    for r in reqs:
        engine.add_request(r)
    for _ in range(2):  # step 1: the prefill token and a decode token; then one more: 3 tokens each under v1
        assert engine.step() == []
    engine.stage_weights(v2, 1)
    done = {}
    while engine.num_unfinished:
        done.update((c.request_id, c) for c in engine.step())
    old, new = transformers_model(path), transformers_model(save_version(path, v2, tmp_path / "v2"))
    for r in reqs:
        c = done[r.request_id]
        assert c.versions == [0] * 3 + [1] * 5
        ids, n = c.prompt_ids + c.token_ids, len(c.prompt_ids)
        with torch.no_grad():  # v1 caches the prompt and the first two tokens, v2 feeds the rest over that cache
            cache = DynamicCache(config=old.config)
            old(torch.tensor([ids[:n + 2]]), cache=cache, use_cache=True)
            keep = torch.log_softmax(new(torch.tensor([ids[n + 2:]]), cache=cache, use_cache=True).logits[0], -1)
        fresh = transformers_logprobs(new, ids)  # (what the learner computes at the new version)
        after = range(3, 8)
        assert [c.token_ids[i] for i in after] == [int(keep[i - 3].argmax()) for i in after]
        assert max(abs(c.logprobs[i] - keep[i - 3, c.token_ids[i]].item()) for i in after) <= TOL
        assert max(abs(c.logprobs[i] - fresh[n - 1 + i, c.token_ids[i]].item()) for i in after) > 1e-3


def test_an_mxfp4_gpt_oss_checkpoint_samples_with_the_logprobs_of_transformers_dequantized_model(tmp_path):
    """A gpt-oss directory written in MXFP4 (tests.helpers.save_tiny_gpt_oss_mxfp4: its experts as `_blocks` /
    `_scales`) starts the engine on its dequantized experts (megarl.models.mxfp4): every behaviour log-prob and every
    position's routes are those of transformers' own model of that directory (which dequantizes it on CPU), within
    the fp32 bound."""
    from tests.helpers import save_tiny_gpt_oss_mxfp4

    path = save_tiny_gpt_oss_mxfp4(tmp_path / "gpt_oss_mxfp4", vocab_size=64)
    engine = BuiltinEngine.from_pretrained(str(path), max_running=3)
    cfg = json.loads((path / "config.json").read_text())
    tol = _native_tol(cfg)
    for c in engine.generate(requests(3, SamplingParams(temperature=1.0, max_new_tokens=8), seed=2)):
        n = len(c.prompt_ids)
        logp, routes = hf_logprobs_and_routes(c.prompt_ids + c.token_ids, (path, None))
        expected = [logp[n - 1 + i, tok].item() for i, tok in enumerate(c.token_ids)]
        assert all(abs(e) <= 8.0 for e in expected)
        assert max(abs(a - b) for a, b in zip(c.logprobs, expected)) <= tol
        _same_routes(c.routes, routes[:-1], cfg)
