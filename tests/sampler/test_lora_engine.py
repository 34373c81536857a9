"""Adapter-only versions on the built-in engine (megarl/sampler/lora.py): an adapter update lands on running
requests at the next step, and every token's behaviour log-prob is recomputed exactly under its own version."""
from __future__ import annotations

import pytest
import torch

from megarl.config.schema import LoraConfig
from megarl.models import lora
from megarl.protocols import GenerationRequest, SamplingParams
from megarl.sampler.engine import BuiltinEngine
from megarl.sampler.lora import AdapterStager
from megarl.sampler.model import KVCache, ModelSpec, forward, forward_tables, load_pretrained, prepare_weights
from tests.helpers import fp32_logprob_tol
from tests.sampler import TINY, make_tiny_model

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"])


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return load_pretrained(str(make_tiny_model(tmp_path_factory.mktemp("qwen_lora"), "qwen2")))


def _adapter(cfg, seed, lora_cfg=LORA):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * 0.3 for name, shape, _ in lora.adapter_spec(cfg, lora_cfg)}


def _replay(spec, prepared, ids: list[int], versions_of_position) -> torch.Tensor:
    """Log-probs [len(ids), V] when position p is fed (its K/V written, the next token's logits computed) by
    the weights of version versions_of_position(p), one position at a time through one cache: what the
    engine computes under kv_on_update=keep."""
    n = len(ids)
    cache, tables = KVCache(spec, 1, n, torch.float32), forward_tables(spec, n)
    rows = []
    with torch.inference_mode():
        for p in range(n):
            logits = forward(spec, prepared[versions_of_position(p)], tables, cache, torch.tensor([[ids[p]]]),
                             torch.tensor([[p]]))
            rows.append(torch.log_softmax(logits[0, 0], -1))
    return torch.stack(rows)


def _prefill(spec, prepared, ids: list[int]) -> torch.Tensor:
    """Log-probs [len(ids), V] of one prefill of `ids` under `prepared` weights."""
    cache, tables = KVCache(spec, 1, len(ids), torch.float32), forward_tables(spec, len(ids))
    with torch.inference_mode():
        logits = forward(spec, prepared, tables, cache, torch.tensor([ids]), torch.arange(len(ids))[None])
    return torch.log_softmax(logits[0], -1)


@pytest.mark.parametrize("kv_layout", ["contiguous", "paged"])
@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_adapter_update_mid_rollout_keeps_per_token_versions_exact(qwen, policy, kv_layout):
    cfg, base = qwen
    v1, v2 = _adapter(cfg, 1), _adapter(cfg, 2)
    factor = lora.scale(LORA)
    spec = ModelSpec.from_hf_config(cfg)
    merged = {v: prepare_weights(spec, lora.merge(base, a, factor)) for v, a in ((1, v1), (2, v2))}
    engine = BuiltinEngine(cfg, base, max_running=4, kv_on_update=policy, kv_layout=kv_layout, kv_block_size=4)
    stager = AdapterStager(engine, base, cfg, LORA)
    assert stager.weight_spec() == {n: (torch.Size(s), d) for n, s, d in lora.adapter_spec(cfg, LORA)}
    stager.stage(v1, 1)
    gen = torch.Generator().manual_seed(0)
    requests = [GenerationRequest(str(i), torch.randint(0, 32, (int(k),), generator=gen).tolist(),
                                  SamplingParams(temperature=1.0, max_new_tokens=10))
                for i, k in enumerate(torch.randint(2, 10, (4,), generator=gen))]
    for r in requests:
        engine.add_request(r)
    for _ in range(3):  # v1 applied at the first step; admitted there: 4 tokens each under v1
        assert engine.step() == []
    stager.stage(v2, 2)  # adapter only, mid-rollout
    done = {}
    while engine.num_unfinished:
        done.update((c.request_id, c) for c in engine.step())
    for r in requests:
        c = done[r.request_id]
        assert c.versions == [1] * 4 + [2] * 6
        ids, n = c.prompt_ids + c.token_ids, len(c.prompt_ids)
        if policy == "keep":  # prompt and the first tokens' K/V by v1, the rest fed by v2
            ref = _replay(spec, merged, ids, lambda p: 1 if p < n + 3 else 2)
        else:  # at the swap every running sequence is prefilled again under v2
            ref = torch.cat([_prefill(spec, merged[1], ids)[:n + 3], _prefill(spec, merged[2], ids)[n + 3:]])
        got = torch.tensor(c.logprobs)
        want = torch.stack([ref[n - 1 + i, t] for i, t in enumerate(c.token_ids)])
        # the adapters (0.3-scale, times alpha/rank = 2) widen the log-probs: the bound follows the reference's
        assert (got - want).abs().max() <= fp32_logprob_tol(TINY, float(ref.abs().max()))
        if policy != "keep" or r is not requests[0]:
            continue
        # ... and the other version would have given other log-probs: the versions are told apart.
        other = _replay(spec, merged, ids, lambda p: 2 if p < n + 3 else 1)
        assert max(abs(other[n - 1 + i, t] - want[i]) for i, t in enumerate(c.token_ids)) > 1e-3


def _family_model(path, kind: str):
    """A tiny HF directory of `kind`: tests.sampler's models, GLM-4.5's and DeepSeek-V3's of tests.helpers (served
    by the engine's generic model) at the engine tests' vocabulary."""
    from tests.helpers import save_tiny_deepseek_v3, save_tiny_glm4_moe

    save = {"glm4_moe": save_tiny_glm4_moe, "deepseek_v3": save_tiny_deepseek_v3}.get(kind)
    return save(path, vocab_size=TINY["vocab_size"]) if save else make_tiny_model(path, kind)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral", "phi3", "smollm3", "olmo2", "gemma3", "qwen3_moe",
                                  "gpt_oss", "glm4_moe", "deepseek_v3"])
def test_an_adapter_version_of_every_family_samples_with_pefts_logprobs(tmp_path, kind):
    """An adapter staged on the engine serving a family's own layout: the tokens it samples carry the log-probs of
    peft's LoraLayer on transformers' model of the same directory (the adapter read from the PEFT directory
    megarl writes), past Mistral's and Gemma 3's windows, on Phi-3's fused qkv_proj and gate_up_proj, and on the
    attention projections of the mixture-of-experts families (Qwen3-MoE's and gpt-oss's native forward, GLM-4.5's
    and DeepSeek-V3's multi-latent attention on the generic model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megarl.models.moe_config import is_moe

    model_dir = _family_model(tmp_path / kind, kind)
    cfg, base = load_pretrained(str(model_dir))
    lora_cfg = LoraConfig(rank=LORA.rank, alpha=LORA.alpha,
                          target_modules=list(lora.ATTENTION_TARGETS) if is_moe(cfg) else LORA.target_modules)
    adapter = _adapter(cfg, 1, lora_cfg)
    engine = BuiltinEngine(cfg, base, max_running=2)
    AdapterStager(engine, base, cfg, lora_cfg).stage(adapter, 1)
    engine.add_request(GenerationRequest("a", [3, 1, 4, 1, 5], SamplingParams(temperature=1.0, max_new_tokens=8)))
    done = []
    while engine.num_unfinished:
        done += engine.step()
    (c,) = done
    assert c.versions == [1] * 8
    lora.save_peft(tmp_path / "adapter", adapter, lora_cfg, str(model_dir))
    base_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([c.prompt_ids + c.token_ids])
    with torch.no_grad():
        untouched = torch.log_softmax(base_model(ids).logits[0].float(), -1)
        ref = torch.log_softmax(PeftModel.from_pretrained(base_model, str(tmp_path / "adapter")).eval()(ids)
                                .logits[0].float(), -1)
    n = len(c.prompt_ids)
    want = torch.stack([ref[n - 1 + i, t] for i, t in enumerate(c.token_ids)])
    assert (torch.stack([untouched[n - 1 + i, t] for i, t in enumerate(c.token_ids)]) - want).abs().max() > 1e-2
    assert (torch.tensor(c.logprobs) - want).abs().max() <= fp32_logprob_tol(cfg, float(ref.abs().max()))


def test_a_wrong_adapter_is_refused_before_it_is_staged(qwen):
    cfg, base = qwen
    engine = BuiltinEngine(cfg, base, max_running=2)
    stager = AdapterStager(engine, base, cfg, LORA)
    adapter = _adapter(cfg, 1)
    name = next(iter(adapter))
    with pytest.raises(ValueError, match="missing"):
        stager.stage({k: v for k, v in adapter.items() if k != name}, 1)
    with pytest.raises(ValueError, match="expected"):
        stager.stage({**adapter, name: adapter[name][:, :-1]}, 1)
    assert engine.staged_versions() == []
