"""BuiltinEngine: finish reasons, continuous batching, behaviour log-probs, in-flight weight swaps."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from megarl.protocols import Engine, GenerationRequest, SamplingParams
from megarl.sampler.engine import BuiltinEngine, sample_tokens
from megarl.sampler.model import KVCache, ModelSpec, forward, load_pretrained, prepare_weights, forward_tables
from tests.sampler import TIED, TOL, dominant_token_weights, make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3", "mistral", "phi3", "olmo2", "gemma3", "gpt_oss",
                                        "glm4_moe", "deepseek_v3"])
def model(request, tmp_path_factory):
    """(kind, path, HF config dict, HF-named weights) of a tiny Qwen2 (tied, bias), Llama (untied), Qwen3 (q/k
    norms, heads wider than hidden / heads), Mistral (a sliding window shorter than the requests), Phi-3 (fused
    qkv_proj and gate_up_proj, the staging buffers' layout) and OLMo 2 (post-norms, q/k norms over the whole
    projection: nothing folded into the stacked projections) and Gemma 3 (local and global layers, (1 + w) norms
    before and after attention and the MLP, scaled embeddings) and gpt-oss (attention sinks, a sliding layer shorter
    than the requests then a full one, biased linears and experts with the clamped SwiGLU) and GLM-4.5 (partial
    RoPE, q/k/v biases, q/k norms, a dense first layer, then the sigmoid router with its expert bias, group limit and
    shared expert) and DeepSeek-V3 (multi-latent attention: a latent cache, the absorbed decode; the routes of the
    three: tests/sampler/test_engine_moe.py). (SmolLM3's engine differs in its forward alone: tests/sampler/test_model.py.)"""
    from megarl.sampler import hf_model, model as native

    path = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    cfg, weights = load_pretrained(str(path))
    assert hf_model.choose(cfg) is native  # (these tests are the native forward's, not the generic model's)
    return request.param, path, cfg, weights


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("qwen"), "qwen2")
    return path, *load_pretrained(str(path))


def req(rid, prompt, sampling=GREEDY, stop=()):
    return GenerationRequest(str(rid), list(prompt), sampling, tuple(stop))


def prompts(n, lo=2, hi=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=gen).tolist()
    return [torch.randint(0, 32, (k,), generator=gen).tolist() for k in lens]


def full_logprobs(cfg, weights, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) [len(ids), V] from one fresh prefill with the model functions."""
    spec = ModelSpec.from_hf_config(cfg)
    cache = KVCache(spec, 1, len(ids), torch.float32)
    x = torch.tensor([ids])
    with torch.inference_mode():
        logits = forward(spec, prepare_weights(spec, weights), forward_tables(spec, len(ids)), cache, x,
                         torch.arange(len(ids))[None])
    return torch.log_softmax(logits[0] / temperature, -1)


def test_implements_engine_protocol(qwen):
    path, _, _ = qwen
    engine = BuiltinEngine.from_pretrained(str(path), version=3)
    assert isinstance(engine, Engine)
    assert engine.version == 3 and engine.num_unfinished == 0 and engine.num_running == 0


def test_finish_reasons_and_lengths(qwen):
    _, cfg, weights = qwen
    engine = BuiltinEngine(cfg, weights, max_seq_len=16)
    prompt = [1, 2, 3]
    first = int(full_logprobs(cfg, weights, prompt)[-1].argmax())
    stop, by_tokens, by_seq_len = engine.generate([
        req("stop", prompt, stop=(first, 31)),  # the greedy first token is a stop token
        req("len", prompt, SamplingParams(temperature=0.0, max_new_tokens=5)),
        req("cap", list(range(10)), SamplingParams(temperature=0.0, max_new_tokens=100)),
    ])
    assert (stop.finish_reason, stop.token_ids) == ("stop", [first])  # the stop token is included
    assert by_tokens.finish_reason == "length" and len(by_tokens.token_ids) == 5
    assert by_seq_len.finish_reason == "length" and len(by_seq_len.token_ids) == 16 - 10
    for c in (stop, by_tokens, by_seq_len):
        assert len(c.logprobs) == len(c.versions) == len(c.token_ids)
    assert engine.num_unfinished == 0 and engine.stats()["requests_finished"] == 3


def test_continuous_batching_matches_requests_run_alone(model):
    """More requests than slots, different prompt and output lengths: same greedy tokens as solo runs."""
    _, _, cfg, weights = model
    requests = [req(i, p, SamplingParams(temperature=0.0, max_new_tokens=3 + 2 * (i % 4)))
                for i, p in enumerate(prompts(9))]
    batched = BuiltinEngine(cfg, weights, max_running=3, max_seq_len=32).generate(requests)
    solo_engine = BuiltinEngine(cfg, weights, max_running=1, max_seq_len=32)
    for r, c in zip(requests, batched):
        (alone,) = solo_engine.generate([r])
        assert c.request_id == r.request_id
        assert c.token_ids == alone.token_ids
        assert max(abs(a - b) for a, b in zip(c.logprobs, alone.logprobs)) <= TOL


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.0, max_new_tokens=10),
    SamplingParams(temperature=0.7, top_k=5, max_new_tokens=10),
    SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=10),
])
def test_behaviour_logprobs_equal_hf(model, sampling):
    """Recorded log-prob = HF log_softmax(logits / T) over the full vocab (T = 1 for greedy)."""
    from transformers import AutoModelForCausalLM

    _, path, cfg, weights = model
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    completions = BuiltinEngine(cfg, weights, max_running=4, version=7).generate(
        [req(i, p, sampling) for i, p in enumerate(prompts(6))])
    temperature = sampling.temperature or 1.0
    for c in completions:
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.inference_mode():
            ref = torch.log_softmax(hf(ids).logits[0].float() / temperature, -1)
        n = len(c.prompt_ids)
        expected = [ref[n - 1 + i, tok].item() for i, tok in enumerate(c.token_ids)]
        assert max(abs(a - b) for a, b in zip(c.logprobs, expected)) <= TOL
        assert c.versions == [7] * len(c.token_ids)


def test_requests_with_one_prompt_are_prefilled_once_and_each_samples_its_own_completion(model):
    """A group's requests (one prompt, sampled G times) are prefilled once: the prompt's tokens count once in
    prefill_tokens, the others copy its cache slot; every completion's log-probs are still HF's on its own tokens,
    and the copies do not repeat one another's samples."""
    from transformers import AutoModelForCausalLM

    _, path, cfg, weights = model
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    group, other = prompts(2, lo=6, seed=3)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10)
    requests = [req(f"g{j}", group, sampling) for j in range(6)] + [req("o", other, sampling)]
    engine = BuiltinEngine(cfg, weights, max_running=8, seed=0)
    completions = engine.generate(requests)
    assert engine.stats()["prefill_tokens"] == len(group) + len(other)
    assert len({tuple(c.token_ids) for c in completions[:6]}) > 1
    for c in completions:
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.inference_mode():
            ref = torch.log_softmax(hf(ids).logits[0].float(), -1)
        n = len(c.prompt_ids)
        assert max(abs(c.logprobs[i] - ref[n - 1 + i, tok].item()) for i, tok in enumerate(c.token_ids)) <= TOL


def test_seeded_sampling_is_reproducible(qwen):
    _, cfg, weights = qwen
    requests = [req(i, p, SamplingParams(temperature=1.0, max_new_tokens=12)) for i, p in enumerate(prompts(5))]
    runs = [BuiltinEngine(cfg, weights, seed=s).generate(requests) for s in (1, 1, 2)]
    tokens = [[c.token_ids for c in run] for run in runs]
    assert tokens[0] == tokens[1] and tokens[0] != tokens[2]


def test_reseeding_restarts_the_sampling_stream(qwen):
    """A sync-mode batch reseeds the engine (megarl.roles.sampler_main): what it samples then does not depend on
    what the engine sampled before."""
    _, cfg, weights = qwen
    requests = [req(i, p, SamplingParams(temperature=1.0, max_new_tokens=12)) for i, p in enumerate(prompts(5))]
    fresh = BuiltinEngine(cfg, weights, seed=7).generate(requests)
    used = BuiltinEngine(cfg, weights, seed=1)
    used.generate(requests)  # moves its generator on
    used.reseed(7)
    assert [c.token_ids for c in used.generate(requests)] == [c.token_ids for c in fresh]


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2000))
    gen = torch.Generator().manual_seed(0)
    ones, zeros = torch.ones(2000), torch.zeros(2000, dtype=torch.long)
    top2, logp = sample_tokens(logits, ones, ones, zeros + 2, gen)
    assert set(top2.tolist()) == {0, 1}
    assert torch.allclose(logp, logits.gather(1, top2[:, None])[:, 0])  # truncation not folded in
    nucleus, _ = sample_tokens(logits, ones, torch.full((2000,), 0.7), zeros, gen)
    assert set(nucleus.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.7; 0.15 lies outside
    free, _ = sample_tokens(logits, ones, ones, zeros, gen)
    assert set(free.tolist()) == {0, 1, 2, 3}


def test_sampled_frequencies_follow_the_truncated_distribution():
    """One draw per row by inverse CDF: empirical frequencies within 5 sigma of the target probabilities."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01])
    rows = 40_000
    logits = torch.log(probs).expand(rows, -1)
    gen = torch.Generator().manual_seed(0)
    ones, zeros = torch.ones(rows), torch.zeros(rows, dtype=torch.long)
    for top_p, top_k, support in ((1.0, 0, 5), (1.0, 3, 3), (0.85, 0, 3)):
        tokens, _ = sample_tokens(logits, ones, torch.full((rows,), top_p), zeros + top_k, gen)
        target = probs.clone()
        target[support:] = 0
        target /= target.sum()
        freq = torch.bincount(tokens, minlength=5).double() / rows
        sigma = (target * (1 - target) / rows).sqrt().clamp(min=1e-12)
        assert ((freq - target).abs() <= 5 * sigma + 1e-12).all(), (top_p, top_k, freq, target)


def test_fast_path_flags_do_not_change_results():
    """The any_* flags only skip work: with truthful flags the draws equal the default (all-true) path."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 40, generator=gen)
    temperature = torch.rand(64, generator=gen) + 0.5
    top_p, top_k = torch.ones(64), torch.zeros(64, dtype=torch.long)
    default = sample_tokens(logits, temperature, top_p, top_k, torch.Generator().manual_seed(7))
    fast = sample_tokens(logits, temperature, top_p, top_k, torch.Generator().manual_seed(7),
                         any_truncation=False, any_greedy=False)
    assert torch.equal(default[0], fast[0]) and torch.equal(default[1], fast[1])
    temperature[::2] = 0.0  # greedy rows take the argmax; sampled rows are unaffected by them
    mixed, _ = sample_tokens(logits, temperature, top_p, top_k, torch.Generator().manual_seed(7))
    assert torch.equal(mixed[::2], logits[::2].argmax(-1))


def test_completions_stay_consistent_through_packing_and_stops(model):
    """More requests than slots, stop tokens and length limits at T=1: each recorded log-prob equals a
    fresh prefill's, each finish reason and length follows from the tokens."""
    _, _, cfg, weights = model
    stop = (3, 5)
    requests = [req(i, p, SamplingParams(temperature=1.0, max_new_tokens=4 + 3 * (i % 5)), stop=stop)
                for i, p in enumerate(prompts(12, seed=4))]
    engine = BuiltinEngine(cfg, weights, max_running=3, max_seq_len=24, seed=3)
    done = engine.generate(requests)
    reasons = {c.finish_reason for c in done}
    assert reasons == {"stop", "length"}  # both paths exercised
    for r, c in zip(requests, done):
        limit = min(r.sampling.max_new_tokens, 24 - len(r.prompt_ids))
        assert all(t not in stop for t in c.token_ids[:-1])
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in stop and len(c.token_ids) <= limit
        else:
            assert len(c.token_ids) == limit and c.token_ids[-1] not in stop
        ref = full_logprobs(cfg, weights, c.prompt_ids + c.token_ids)
        n = len(c.prompt_ids)
        assert max(abs(lp - ref[n - 1 + i, t].item()) for i, (t, lp) in enumerate(zip(c.token_ids, c.logprobs))) <= TOL
        assert c.versions == [0] * len(c.token_ids)


def test_invalid_requests_are_refused(qwen):
    _, cfg, weights = qwen
    engine = BuiltinEngine(cfg, weights, max_seq_len=16)
    with pytest.raises(ValueError, match="prompt_len=16.*max_seq_len=16"):
        engine.add_request(req("long", range(16)))
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request(req("empty", []))
    with pytest.raises(ValueError, match="outside"):
        engine.add_request(req("oov", [32]))
    engine.add_request(req("ok", range(15)))  # 15 + 1 fits exactly
    assert engine.num_unfinished == 1


def test_stage_weights_validation(model):
    _, _, cfg, weights = model
    engine = BuiltinEngine(cfg, weights, version=1)
    wrong_shape = dict(weights, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.stage_weights(wrong_shape, 2)
    wrong_dtype = dict(weights, **{"model.norm.weight": weights["model.norm.weight"].double()})
    with pytest.raises(ValueError, match="model.norm.weight.*float64"):
        engine.stage_weights(wrong_dtype, 2)
    with pytest.raises(ValueError, match="missing.*model.embed_tokens.weight"):
        engine.stage_weights({k: v for k, v in weights.items() if k != "model.embed_tokens.weight"}, 2)
    with pytest.raises(ValueError, match="unexpected.*bogus"):
        engine.stage_weights(dict(weights, bogus=torch.zeros(1)), 2)
    with pytest.raises(ValueError, match="older"):
        engine.stage_weights(weights, 0)
    engine.stage_weights(weights, 2)
    engine.step()
    assert engine.version == 2 and engine.stats()["swaps"] == 1


def test_staged_versions_are_kept_by_version_and_applied_on_request(qwen):
    """The step-boundary control of a TP group: step(apply_staged=False) leaves staged versions alone,
    apply_staged(v) applies exactly v and drops older ones, a third staged version drops the oldest."""
    _, cfg, weights = qwen
    engine = BuiltinEngine(cfg, weights, version=1)
    assert engine.apply_staged() is None and engine.stats()["swaps"] == 0
    engine.stage_weights(weights, 2)
    engine.stage_weights(weights, 3)
    engine.add_request(req("a", [1, 2, 3], SamplingParams(temperature=1.0, max_new_tokens=4)))
    assert engine.step(apply_staged=False) == []  # 2 tokens of v1
    assert engine.version == 1 and engine.staged_versions() == [2, 3]
    with pytest.raises(KeyError, match=r"version 5 is not staged \(staged: \[2, 3\], current: 1\)"):
        engine.apply_staged(5)
    assert engine.apply_staged(2) == 2 and engine.version == 2 and engine.staged_versions() == [3]
    assert engine.step(apply_staged=False) == []  # 1 token of v2
    engine.stage_weights(weights, 4)
    engine.stage_weights(weights, 5)  # beyond MAX_STAGED: 3 is dropped
    assert engine.staged_versions() == [4, 5]
    (done,) = engine.step()  # applies the newest
    assert done.versions == [1, 1, 2, 5] and engine.staged_versions() == [] and engine.stats()["swaps"] == 2


def test_a_version_received_into_its_staging_buffers_runs_as_if_staged_from_a_dict_in_the_replaced_versions_storage(model):
    """staging_buffers(v): views a receiver writes v into; staged as they are (no copy), v generates
    exactly what the same weights staged as a dict generate, and the storage is the arena of the version
    the last swap replaced (two versions' storage in all, never a third); a pinned version's is never reused."""
    _, _, cfg, weights = model
    new = {name: t * 1.5 if t.dim() == 2 else t for name, t in weights.items()}
    reference = BuiltinEngine(cfg, weights)
    reference.stage_weights(new, 1)
    engine = BuiltinEngine(cfg, weights)
    v0_storage = engine._weights.embed.data_ptr()
    engine.stage_weights(weights, 1)  # a copy, as before: the v0 arena becomes the spare at the swap
    engine.step()
    views = engine.staging_buffers(2)
    assert views["model.embed_tokens.weight"].data_ptr() == v0_storage  # the replaced version's storage
    assert engine.staging_buffers(2)["model.embed_tokens.weight"] is views["model.embed_tokens.weight"]
    for name, t in new.items():
        views[name].copy_(t)
    engine.stage_weights(views, 2)
    assert engine._staged[2].embed.data_ptr() == v0_storage  # finalized in place, not copied
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    reference.add_request(req("a", [1, 2, 3], sampling))
    engine.add_request(req("a", [1, 2, 3], sampling))
    engine._generator.manual_seed(0), reference._generator.manual_seed(0)
    (want,), (got,) = _run(reference), _run(engine)
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs and got.versions == [2] * 6
    v1_storage = engine.staging_buffers(3)["model.embed_tokens.weight"].data_ptr()  # v1's arena, replaced by v2
    pinned = engine.pinned(max_running=1, seed=0)  # pins v2: its arena must outlive the next swap
    engine.stage_weights(weights, 3)
    engine.step()
    fresh = engine.staging_buffers(4)["model.embed_tokens.weight"].data_ptr()
    assert fresh not in (v1_storage, pinned._weights.embed.data_ptr())  # v2's arena stays with the pinned engine


def _run(engine):
    done = []
    while engine.num_unfinished:
        done += engine.step()
    return done


def test_wait_staged_is_bounded(qwen):
    _, cfg, weights = qwen
    engine = BuiltinEngine(cfg, weights)
    start = time.monotonic()
    assert not engine.wait_staged(1, timeout_s=0.1)
    assert not engine.wait_staged(1, timeout_s=30, should_stop=lambda: True)
    assert time.monotonic() - start < 5
    stager = threading.Timer(0.1, engine.stage_weights, (weights, 1))
    stager.start()
    assert engine.wait_staged(1, timeout_s=30) and engine.wait_staged(1, timeout_s=0)
    stager.join()


def _start(engine, requests, steps):
    for r in requests:
        engine.add_request(r)
    for _ in range(steps):
        assert engine.step() == []


def _finish(engine):
    done = {}
    while engine.num_unfinished:
        done.update((c.request_id, c) for c in engine.step())
    return done


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_swap_to_drastic_weights_takes_effect_at_the_next_step(model, policy):
    """After staging v2 the very next token of every running request is v2's favourite, tagged 2."""
    kind, _, cfg, weights = model
    favourite = 17
    v2 = dominant_token_weights(weights, favourite, tied=kind in TIED)
    engine = BuiltinEngine(cfg, weights, max_running=4, version=1, kv_on_update=policy)
    requests = [req(i, p, SamplingParams(temperature=1.0, max_new_tokens=10)) for i, p in enumerate(prompts(4))]
    _start(engine, requests, steps=3)  # admitted in step 1 (prefill token + decode token): 4 tokens each
    engine.stage_weights(v2, 2)
    assert engine.version == 1  # staged, not yet applied
    done = _finish(engine)
    for r in requests:
        c = done[r.request_id]
        assert c.versions == [1] * 4 + [2] * 6  # tokens of v1 then v2, never decreasing
        assert c.token_ids[4:] == [favourite] * 6
        # Already-recorded v1 log-probs are untouched: they are v1's log-probs of those tokens.
        ref_v1 = full_logprobs(cfg, weights, c.prompt_ids + c.token_ids)
        n = len(c.prompt_ids)
        assert max(abs(c.logprobs[i] - ref_v1[n - 1 + i, c.token_ids[i]].item()) for i in range(4)) <= TOL
        assert all(lp > -1e-3 for lp in c.logprobs[4:])  # v2's log-prob of its overwhelming token
        prefix = c.prompt_ids + c.token_ids[:4]
        expected = _keep_reference(cfg, weights, v2, prefix) if policy == "keep" else full_logprobs(cfg, v2, prefix)[-1]
        assert abs(c.logprobs[4] - expected[favourite].item()) <= TOL


def _keep_reference(cfg, v1, v2, prefix: list[int]) -> torch.Tensor:
    """Next-token log-probs when the cache of prefix[:-1] was computed by v1 and v2 feeds prefix[-1]."""
    spec = ModelSpec.from_hf_config(cfg)
    n = len(prefix)
    cache, tables = KVCache(spec, 1, n, torch.float32), forward_tables(spec, n)
    with torch.inference_mode():
        forward(spec, prepare_weights(spec, v1), tables, cache, torch.tensor([prefix[:-1]]), torch.arange(n - 1)[None])
        logits = forward(spec, prepare_weights(spec, v2), tables, cache, torch.tensor([prefix[-1:]]),
                         torch.tensor([[n - 1]]))
    return torch.log_softmax(logits[0, 0], -1)


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_kv_policy_on_swap(model, policy):
    """"keep": the token after the swap comes from v2 over v1's cache; "recompute": from a v2 prefill."""
    _, _, cfg, weights = model
    gen = torch.Generator().manual_seed(5)
    v2 = {k: t + 0.05 * torch.randn(t.shape, generator=gen) for k, t in weights.items()}
    engine = BuiltinEngine(cfg, weights, max_running=4, kv_on_update=policy)
    requests = [req(i, p, SamplingParams(temperature=0.0, max_new_tokens=8)) for i, p in enumerate(prompts(4))]
    _start(engine, requests, steps=2)  # 3 tokens each under v1
    engine.stage_weights(v2, 1)
    done = _finish(engine)
    for r in requests:
        c = done[r.request_id]
        assert c.versions == [0] * 3 + [1] * 5
        prefix = c.prompt_ids + c.token_ids[:3]
        keep = _keep_reference(cfg, weights, v2, prefix)
        fresh = full_logprobs(cfg, v2, prefix)[-1]
        assert (keep - fresh).abs().max() > 1e-3  # the two policies are distinguishable here
        expected = keep if policy == "keep" else fresh
        assert c.token_ids[3] == int(expected.argmax())
        assert abs(c.logprobs[3] - expected[c.token_ids[3]].item()) <= TOL
        # Later tokens: the cache holds v2 K/V from the swap on (plus v1 K/V under "keep").
        if policy == "recompute":
            ref = full_logprobs(cfg, v2, c.prompt_ids + c.token_ids)
            n = len(c.prompt_ids)
            later = [ref[n - 1 + i, c.token_ids[i]].item() for i in range(3, 8)]
            assert max(abs(a - b) for a, b in zip(c.logprobs[3:], later)) <= TOL


def test_swap_while_admitting_and_packing(qwen):
    """Requests finish, are replaced and packed into freed slots across several swaps."""
    _, cfg, weights = qwen
    engine = BuiltinEngine(cfg, weights, max_running=3, max_seq_len=32, kv_on_update="recompute")
    for i, p in enumerate(prompts(8)):
        engine.add_request(req(i, p, SamplingParams(temperature=1.0, max_new_tokens=2 + i)))
    done, version = {}, 0
    while engine.num_unfinished:
        version += 1
        engine.stage_weights(weights, version)
        done.update((c.request_id, c) for c in engine.step())
    assert len(done) == 8
    for i, c in done.items():
        assert len(c.token_ids) == 2 + int(i)
        assert c.versions == sorted(c.versions) and c.versions[0] >= 1


def test_stage_from_another_thread_while_stepping(qwen):
    """A publisher thread stages 30 versions while the main thread keeps decoding. Each version is staged after
    the decode loop took another step (whenever in that step the scheduler lets the thread run), so versions
    land between and during steps on a busy machine too, never all within one step."""
    _, cfg, weights = qwen
    engine = BuiltinEngine(cfg, weights, max_running=4, max_seq_len=40)
    published, errors, done = [], [], {}
    stepped = threading.Event()

    def publisher():
        try:
            for v in range(1, 31):
                if not stepped.wait(timeout=60):
                    raise TimeoutError(f"the decode loop took no step in 60 s before version {v}")
                stepped.clear()
                engine.stage_weights({k: t.clone() for k, t in weights.items()}, v)
                published.append(v)
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=publisher)
    thread.start()
    batch = 0
    while thread.is_alive() or engine.num_unfinished:
        if engine.num_unfinished == 0 and thread.is_alive():  # keep the decode loop busy
            for i, p in enumerate(prompts(6, seed=batch)):
                engine.add_request(req(f"{batch}-{i}", p, SamplingParams(temperature=1.0, max_new_tokens=20)))
            batch += 1
        done.update((c.request_id, c) for c in engine.step())
        stepped.set()
    thread.join()
    engine.step()  # applies whatever was staged last
    assert not errors and len(done) == 6 * batch
    assert engine.version == published[-1] == 30
    for c in done.values():
        assert len(c.token_ids) == 20 and c.versions == sorted(c.versions)
    assert engine.stats()["swaps"] >= 2


# ---------------------------------------------------------------------------------------------- between steps
def test_progress_reports_each_running_requests_output_so_far_and_only_what_is_new(qwen):
    """Polled after every step with `since` = tokens already seen, progress assembles exactly the
    tokens, log-probs and versions each completion ends with, across a swap and slot packing."""
    _, cfg, weights = qwen
    requests = [req(i, p, SamplingParams(temperature=1.0, max_new_tokens=3 + 4 * i)) for i, p in enumerate(prompts(4))]
    engine = BuiltinEngine(cfg, weights, max_running=3, max_seq_len=32, seed=5)
    for r in requests:
        engine.add_request(r)
    seen: dict[str, tuple[list, list, list]] = {}
    done, steps = {}, 0
    while engine.num_unfinished:
        if steps == 4:
            engine.stage_weights(weights, 1)
        done.update((c.request_id, c) for c in engine.step())
        steps += 1
        # Asked about every request: only the running ones are reported, from what was seen on.
        new = engine.progress({r.request_id: len(seen.get(r.request_id, ([],))[0]) for r in requests})
        assert sorted(new) == sorted(engine.progress()) == sorted(set(new) - set(done))
        for rid, p in new.items():
            tokens, logprobs, versions = seen.setdefault(rid, ([], [], []))
            assert p.start == len(tokens) and len(p.token_ids) == len(p.logprobs) == len(p.versions) >= 1
            tokens += p.token_ids
            logprobs += p.logprobs
            versions += p.versions
    for rid, (tokens, logprobs, versions) in seen.items():
        c, n = done[rid], len(tokens)
        assert 0 < n < len(c.token_ids)  # the last step's tokens come with the completion
        assert (tokens, logprobs, versions) == (c.token_ids[:n], c.logprobs[:n], c.versions[:n])
    assert any(set(c.versions) == {0, 1} for c in done.values())
    assert engine.progress() == {} and engine.progress({"0": 0}) == {}


def test_cancel_ends_queued_and_running_requests_with_their_partial_output(qwen):
    _, cfg, weights = qwen
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    requests = [req(i, p, greedy) for i, p in enumerate(prompts(4, seed=2))]
    engine = BuiltinEngine(cfg, weights, max_running=3, max_seq_len=32)
    for r in requests:
        engine.add_request(r)
    for _ in range(3):
        assert engine.step() == []
    so_far = engine.progress()
    assert sorted(so_far) == ["0", "1", "2"]  # "3" is queued
    with pytest.raises(KeyError, match=r"\['nope'\]"):
        engine.cancel(["1", "nope"])
    queued, running = engine.cancel(["3", "1"])  # queued requests first
    assert (queued.request_id, queued.token_ids, queued.logprobs, queued.versions, queued.finish_reason) == \
        ("3", [], [], [], "abort")
    p = so_far["1"]
    assert (running.request_id, running.finish_reason) == ("1", "abort") and len(running.token_ids) == 4
    assert (running.token_ids, running.logprobs, running.versions) == (p.token_ids, p.logprobs, p.versions)
    assert engine.num_unfinished == 2 and engine.stats()["requests_cancelled"] == 2
    # The others go on undisturbed: the same greedy tokens as if they had run alone.
    rest = {}
    while engine.num_unfinished:
        rest.update((c.request_id, c) for c in engine.step())
    solo = BuiltinEngine(cfg, weights, max_running=1, max_seq_len=32)
    for rid in ("0", "2"):
        (alone,) = solo.generate([requests[int(rid)]])
        assert rest[rid].token_ids == alone.token_ids and rest[rid].finish_reason == "length"
    assert engine.stats()["requests_finished"] == 2


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_chunked_prefill_equals_one_pass(model, policy):
    """Prompts prefilled in chunks of 3 positions (each chunk attending to the cache the earlier ones wrote), and a
    recompute re-prefill likewise, give the one-pass prefill's tokens and log-probs (within fp32 rounding: the
    chunks' matmuls sum in another order)."""
    _, _, cfg, weights = model
    gen = torch.Generator().manual_seed(7)
    v2 = {k: t + 0.05 * torch.randn(t.shape, generator=gen) for k, t in weights.items()}
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    requests = [req(i, p, sampling) for i, p in enumerate(prompts(6, lo=2, hi=14, seed=3))]
    runs = {}
    for chunk in (3, 64):
        engine = BuiltinEngine(cfg, weights, max_running=6, kv_on_update=policy, prefill_chunk=chunk, seed=11)
        _start(engine, requests, steps=2)
        engine.stage_weights(v2, 1)
        runs[chunk] = _finish(engine)
    for r in requests:
        chunked, one_pass = runs[3][r.request_id], runs[64][r.request_id]
        assert chunked.token_ids == one_pass.token_ids
        assert max(abs(a - b) for a, b in zip(chunked.logprobs, one_pass.logprobs)) <= TOL
    # The run is one that chunks: some prompt spans several chunks, and some the row's last position is not in.
    assert max(len(r.prompt_ids) for r in requests) > 2 * 3


def test_prefill_chunk_must_be_positive(qwen):
    _, cfg, weights = qwen
    with pytest.raises(ValueError, match="sampler.prefill_chunk"):
        BuiltinEngine(cfg, weights, prefill_chunk=0)


# ------------------------------------------------------------------ the paged KV layout (sampler.kv_layout=paged)
@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3", "mistral", "phi3", "olmo2", "smollm3", "gpt_oss",
                                        "glm4_moe", "deepseek_v3"])
def any_family(request, tmp_path_factory):
    """(kind, HF config, weights) of every dense family, SmolLM3's no-RoPE layer and Mistral's window included,
    gpt-oss (its sinks in the block-by-block decode softmax, its layers' own windows), GLM-4.5 (partial RoPE) and
    DeepSeek-V3 (its latent cache in blocks, gathered for every step)."""
    return request.param, *load_pretrained(str(make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)))


def _paged_schedule(engine, weights, swap_at=3):
    """10 sampled requests (one prompt twice, stop tokens, some top-p) through 4 slots, 3 of them added later,
    prompts prefilled in chunks; a swap to perturbed weights before step `swap_at`."""
    gen = torch.Generator().manual_seed(5)
    v2 = {k: t + 0.05 * torch.randn(t.shape, generator=gen) for k, t in weights.items()}
    ps = prompts(9, lo=2, hi=20, seed=4)
    requests = [req(i, p, SamplingParams(temperature=1.0, top_p=0.9 if i % 3 == 0 else 1.0, max_new_tokens=6 + 3 * (i % 4)),
                    stop=(5,)) for i, p in enumerate(ps + [ps[0]])]
    for r in requests[:7]:
        engine.add_request(r)
    done, step = {}, 0
    while engine.num_unfinished or step < 2:
        if step == 2:
            for r in requests[7:]:
                engine.add_request(r)
        if step == swap_at:
            engine.stage_weights(v2, 1)
        done.update((c.request_id, c) for c in engine.step())
        step += 1
    return done


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_paged_layout_gives_the_contiguous_layouts_completions(any_family, policy):
    """The paged layout's prefill gathers each row's blocks into the operand the contiguous layout holds (the same
    matmuls over the same values); its one-position forwards (decode, a one-position last prefill chunk) attend
    block by block, summing over the blocks in another order: log-probs within fp32 rounding. Tokens, versions and
    finish reasons are the same (packing, a shared prompt, chunked prefill, a swap under either policy)."""
    _, cfg, weights = any_family
    runs = {layout: _paged_schedule(BuiltinEngine(cfg, weights, max_running=4, max_seq_len=48, kv_on_update=policy,
                                                  prefill_chunk=5, seed=2, kv_layout=layout, kv_block_size=4),
                                    weights)
            for layout in ("contiguous", "paged")}
    assert runs["paged"].keys() == runs["contiguous"].keys() and len(runs["paged"]) == 10
    for rid, c in runs["contiguous"].items():
        p = runs["paged"][rid]
        assert (p.token_ids, p.versions, p.finish_reason) == (c.token_ids, c.versions, c.finish_reason)
        assert max(abs(a - b) for a, b in zip(p.logprobs, c.logprobs)) <= TOL
    assert {c.finish_reason for c in runs["paged"].values()} == {"stop", "length"}
    assert any(len(set(c.versions)) == 2 for c in runs["paged"].values())  # some request ran across the swap


def test_a_full_block_pool_queues_requests_until_running_ones_return_blocks(qwen):
    """A pool of 10 blocks of 4 holds two of these requests' reservations (4-5 blocks each), whatever the free
    slots: the rest wait in the queue and run as blocks come back; nothing runs out mid-request, and each
    completion is the one it gets alone."""
    _, cfg, weights = qwen
    requests = [req(i, p, SamplingParams(temperature=0.0, max_new_tokens=8)) for i, p in enumerate(prompts(6, 8, 12))]
    engine = BuiltinEngine(cfg, weights, max_running=6, max_seq_len=64, kv_layout="paged", kv_block_size=4,
                           kv_blocks=10)
    for r in requests:
        engine.add_request(r)
    done, most_running = {}, 0
    while engine.num_unfinished:
        done.update((c.request_id, c) for c in engine.step())
        stats = engine.stats()
        most_running = max(most_running, stats["running"])
        assert stats["kv_blocks_used"] <= stats["kv_blocks_reserved"] <= 10
    assert most_running == 2 and len(done) == 6
    assert (engine.stats()["kv_blocks_used"], engine.stats()["kv_blocks_reserved"]) == (0, 0)
    for r in requests:
        alone = BuiltinEngine(cfg, weights, max_running=1, max_seq_len=64).generate([r])[0]
        assert done[r.request_id].token_ids == alone.token_ids
        assert max(abs(a - b) for a, b in zip(done[r.request_id].logprobs, alone.logprobs)) <= TOL


def test_a_request_larger_than_the_block_pool_is_refused_naming_the_key(qwen):
    _, cfg, weights = qwen
    engine = BuiltinEngine(cfg, weights, max_running=2, max_seq_len=64, kv_layout="paged", kv_block_size=4,
                           kv_blocks=3)
    engine.add_request(req(0, [1] * 4, SamplingParams(temperature=0.0, max_new_tokens=9)))  # 12 positions: 3 blocks
    with pytest.raises(ValueError, match=r"13 KV positions need 4 blocks of 4, the pool has 3 \(raise sampler.kv_blocks\)"):
        engine.add_request(req(1, [1] * 4, SamplingParams(temperature=0.0, max_new_tokens=10)))
    with pytest.raises(ValueError, match="sampler.kv_layout"):
        BuiltinEngine(cfg, weights, kv_layout="blocks")


def test_a_pool_sized_for_the_mix_serves_one_long_request_among_short_ones(qwen):
    """8 slots of max_seq_len 1024: the contiguous layout holds 8 x 1024 positions per layer. Seven short requests
    (2 blocks of 16 each) and a 600-token prompt (39 blocks) reserve 53 blocks: a pool of exactly that, 848
    positions plus the sink block, runs all eight at once, with the contiguous layout's completions."""
    _, cfg, weights = qwen
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24)
    long_prompt = torch.randint(0, 32, (600,), generator=torch.Generator().manual_seed(9)).tolist()
    requests = [req(i, p, sampling) for i, p in enumerate(prompts(7, 8, 10) + [long_prompt])]
    contiguous = BuiltinEngine(cfg, weights, max_running=8, max_seq_len=1024, seed=1)
    paged = BuiltinEngine(cfg, weights, max_running=8, max_seq_len=1024, seed=1, kv_layout="paged",
                          kv_block_size=16, kv_blocks=53)
    per_position = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (cfg["hidden_size"] // 4) * 4  # bytes
    assert contiguous._cache.k.nbytes + contiguous._cache.v.nbytes == 8 * 1024 * per_position
    assert paged._cache.k.nbytes + paged._cache.v.nbytes == 54 * 16 * per_position  # 10.5% of it
    for r in requests:
        paged.add_request(r)
    done = {c.request_id: c for c in paged.step()}
    assert paged.stats()["running"] == 8 and paged.stats()["kv_blocks_reserved"] == 53  # all at once
    while paged.num_unfinished:
        done.update((c.request_id, c) for c in paged.step())
    for c in contiguous.generate(requests):
        assert done[c.request_id].token_ids == c.token_ids
        assert max(abs(a - b) for a, b in zip(done[c.request_id].logprobs, c.logprobs)) <= TOL


def test_a_pinned_engine_keeps_the_paged_layout_with_its_own_pool(qwen):
    _, cfg, weights = qwen
    engine = BuiltinEngine(cfg, weights, max_running=2, max_seq_len=32, kv_layout="paged", kv_block_size=4, kv_blocks=6)
    twin = engine.pinned(max_running=3, seed=0)
    assert twin.stats()["kv_blocks"] == 6 and twin._cache is not engine._cache
    assert [len(c.token_ids) for c in twin.generate([req(i, [1, 2, 3]) for i in range(3)])] == [8, 8, 8]
