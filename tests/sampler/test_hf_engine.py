"""The built-in engine's generic model (megarl/sampler/hf_model.py) on a model type megarl has no family for (a tiny
Granite: four multipliers a Llama-like forward would miss): behaviour log-probs against transformers' own forward,
continuous batching, in-flight swaps under keep and recompute, the per-row slot cache, and its refusals."""
from __future__ import annotations

import json

import pytest
import torch

from megarl.protocols import GenerationRequest, SamplingParams
from megarl.sampler import hf_model
from megarl.sampler.engine import BuiltinEngine
from tests.helpers import LEARNER_TINY, fp32_logprob_tol, save_tiny_granite
from tests.sampler import make_tiny_model, transformers_logprobs, transformers_model

# |log-prob| <= 8 (vocab 264: log 264 = 5.6 plus the logits' spread); positions up to the engine's 64.
TOL = fp32_logprob_tol(LEARNER_TINY, max_logprob=8.0, max_seq_len=64)


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    """(path, HF config dict, named_parameters' tensors) of the tiny Granite."""
    path = save_tiny_granite(tmp_path_factory.mktemp("granite") / "granite")
    return (path, *hf_model.load_pretrained(str(path)))


def _prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(k),), generator=gen).tolist() for k in torch.randint(2, 12, (n,), generator=gen)]


def _swap_after_two_steps(engine, requests, weights2) -> dict:
    """The requests admitted and stepped twice under version 0 (step 1: the prefill token and a decode token, so 3
    tokens each), `weights2` staged as version 1, then run to their end: their completions by id (_finish)."""
    for r in requests:
        engine.add_request(r)
    for _ in range(2):
        assert engine.step() == []
    engine.stage_weights(weights2, 1)
    return _finish(engine)


def _finish(engine):
    done = {}
    while engine.num_unfinished:
        done.update((c.request_id, c) for c in engine.step())
    return done


def test_a_type_outside_the_families_runs_on_the_generic_model_which_says_once_that_it_is_slower(granite, capfd):
    path, cfg, _ = granite
    hf_model._ANNOUNCED.discard("granite")
    first, second = BuiltinEngine.from_pretrained(str(path)), BuiltinEngine.from_pretrained(str(path))
    assert first._impl is hf_model and second._impl is hf_model
    err = capfd.readouterr().err
    assert err.count("slower than the native engine") == 1 and "docs/models.md#the-generic-path" in err
    qwen = make_tiny_model(path.parent / "qwen2", "qwen2")
    from megarl.sampler import model as native

    assert BuiltinEngine.from_pretrained(str(qwen))._impl is native  # a family keeps the native forward


def test_behaviour_logprobs_under_continuous_batching_equal_transformers(granite):
    """More requests than slots, of different lengths, admitted as slots free up and packed: every token's
    behaviour log-prob is transformers' full forward's, within the fp32 bound."""
    path, cfg, weights = granite
    engine = BuiltinEngine(cfg, weights, max_running=3, max_seq_len=64, seed=1)
    requests = [GenerationRequest(str(i), p, SamplingParams(temperature=1.0, max_new_tokens=3 + 2 * i), ())
                for i, p in enumerate(_prompts(7))]
    for r in requests:
        engine.add_request(r)
    done = _finish(engine)
    reference = transformers_model(path)
    for r in requests:
        c = done[r.request_id]
        assert len(c.token_ids) == r.sampling.max_new_tokens and c.versions == [0] * len(c.token_ids)
        lp = transformers_logprobs(reference, c.prompt_ids + c.token_ids)
        n = len(c.prompt_ids)
        gaps = [abs(c.logprobs[i] - lp[n - 1 + i, t].item()) for i, t in enumerate(c.token_ids)]
        assert max(gaps) <= TOL, (r.request_id, max(gaps), TOL)


def test_a_forced_generic_model_equals_the_native_forward_on_a_family(tmp_path):
    """sampler.model_impl=hf on a family: the same greedy tokens and log-probs as the native engine."""
    path = make_tiny_model(tmp_path / "qwen2", "qwen2")
    cfg, weights = hf_model.load_pretrained(str(path))
    requests = [GenerationRequest(str(i), [t % 32 for t in p], SamplingParams(temperature=0.0, max_new_tokens=6), ())
                for i, p in enumerate(_prompts(4))]
    native, generic = (BuiltinEngine(cfg, weights, max_running=4, model_impl=impl) for impl in ("native", "hf"))
    assert generic._impl is hf_model
    for want, got in zip(native.generate(requests), generic.generate(requests)):
        assert got.token_ids == want.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) <= TOL


def _keep_reference(path, v1, v2, prefix: list[int]) -> torch.Tensor:
    """transformers' next-token log-probs when v1 computed the cache of prefix[:-1] and v2 feeds prefix[-1]."""
    from transformers import DynamicCache

    old, new = transformers_model(path, v1), transformers_model(path, v2)
    with torch.no_grad():
        cache = DynamicCache(config=old.config)
        old(torch.tensor([prefix[:-1]]), cache=cache, use_cache=True)
        logits = new(torch.tensor([prefix[-1:]]), cache=cache, use_cache=True).logits
    return torch.log_softmax(logits[0, -1].float(), -1)


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_in_flight_swap_under_each_kv_policy(granite, policy):
    """A version staged mid-generation: every token after it is tagged with it; "keep" samples its first token from
    v2 over v1's cache (transformers' own cached decode across the two models), "recompute" from a v2 prefill, and
    every later token under recompute is v2's full forward's, token by token."""
    path, cfg, weights = granite
    gen = torch.Generator().manual_seed(5)
    v2 = {k: t + 0.05 * torch.randn(t.shape, generator=gen) for k, t in weights.items()}
    engine = BuiltinEngine(cfg, weights, max_running=4, kv_on_update=policy)
    requests = [GenerationRequest(str(i), p, SamplingParams(temperature=0.0, max_new_tokens=8), ())
                for i, p in enumerate(_prompts(4, seed=3))]
    done = _swap_after_two_steps(engine, requests, v2)
    fresh_model = transformers_model(path, v2)
    for r in requests:
        c = done[r.request_id]
        assert c.versions == [0] * 3 + [1] * 5
        prefix = c.prompt_ids + c.token_ids[:3]
        keep, fresh = _keep_reference(path, weights, v2, prefix), transformers_logprobs(fresh_model, prefix)[-1]
        assert (keep - fresh).abs().max() > 1e-3  # the two policies are distinguishable here
        expected = keep if policy == "keep" else fresh
        assert c.token_ids[3] == int(expected.argmax())
        assert abs(c.logprobs[3] - expected[c.token_ids[3]].item()) <= TOL
        if policy == "recompute":
            ref = transformers_logprobs(fresh_model, c.prompt_ids + c.token_ids)
            n = len(c.prompt_ids)
            assert max(abs(c.logprobs[i] - ref[n - 1 + i, c.token_ids[i]].item()) for i in range(3, 8)) <= TOL


def test_a_version_received_into_its_staging_buffers_runs_from_them(granite):
    """staging_buffers(v) are the storage v runs from (the replaced version's, no third copy), and the forward's
    parameters are those very tensors, bitwise what was written."""
    _, cfg, weights = granite
    engine = BuiltinEngine(cfg, weights)
    new = {name: t * 1.5 for name, t in weights.items()}
    engine.stage_weights(weights, 1)
    engine.step()
    views = engine.staging_buffers(2)
    for name, t in new.items():
        views[name].copy_(t)
    engine.stage_weights(views, 2)
    engine.step()
    assert engine.version == 2
    for name, t in new.items():
        assert engine._weights.params[name] is views[name] and torch.equal(engine._weights.params[name], t)


def test_sliding_window_layers_see_only_their_window(tmp_path):
    """A hybrid of full and sliding-window layers (Gemma 3 text, window 4 over prompts of up to 16 tokens): each
    layer type gets its own mask, so the engine's log-probs are transformers' forward's."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    Gemma3ForCausalLM(Gemma3TextConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=64, max_position_embeddings=64, sliding_window=4, initializer_range=0.1,
        layer_types=["sliding_attention", "full_attention"])).save_pretrained(tmp_path / "gemma")
    cfg, weights = hf_model.load_pretrained(str(tmp_path / "gemma"))
    engine = BuiltinEngine(cfg, weights, max_running=2, max_seq_len=32, model_impl="hf")
    requests = [GenerationRequest(str(i), [t % 64 for t in p] * 2, SamplingParams(temperature=1.0, max_new_tokens=6),
                                  ()) for i, p in enumerate(_prompts(3, seed=7))]
    reference = transformers_model(tmp_path / "gemma")
    for c in engine.generate(requests):
        lp, n = transformers_logprobs(reference, c.prompt_ids + c.token_ids), len(c.prompt_ids)
        assert max(abs(c.logprobs[i] - lp[n - 1 + i, t].item()) for i, t in enumerate(c.token_ids)) <= TOL


def test_what_the_generic_model_cannot_run_is_refused_naming_the_key(granite):
    path, cfg, weights = granite
    with pytest.raises(ValueError, match=r"sampler\.tp=2"):
        hf_model.ModelSpec.from_hf_config(cfg).shard(2)
    recurrent = {**cfg, "layer_types": ["mamba", "full_attention"]}
    with pytest.raises(ValueError, match=r"layer_types \['mamba'\].*docs/models\.md"):
        hf_model.ModelSpec.from_hf_config(recurrent)
    with pytest.raises(ValueError, match=r"sampler\.model_impl='paged'"):
        hf_model.choose(cfg, "paged")
    with pytest.raises(ValueError, match="missing tensor"):
        BuiltinEngine(cfg, {k: v for k, v in weights.items() if k != "model.norm.weight"})
    # An MoE family whose experts the learners publish per expert, in a config its native forward does not take
    # (partial RoPE), and which this module does not stack (not PER_EXPERT)
    moe = {"model_type": "qwen3_moe", "num_attention_heads": 4, "hidden_size": 32, "num_experts": 4,
           "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}
    with pytest.raises(ValueError, match=r"does not run 'qwen3_moe'.*docs/models\.md"):
        hf_model.choose(moe)
    assert json.loads((path / "config.json").read_text())["model_type"] == "granite"
