"""The built-in engine's generic model on hybrid models (a tiny Qwen3-Next: gated-DeltaNet layers with a conv state
and a delta-rule state beside a full-attention layer's KV cache; a tiny Nemotron-H: Mamba-2 mixers with a conv state
and an SSM state, attention, and MLP and MoE blocks that hold no cache), against transformers' own forward and its
own cache: continuous batching over right-padded prefills, in one piece and in chunks, and in-flight swaps under
keep and recompute, token by token under the weights each policy says
(docs/sampler.md#in-flight-updates-of-a-hybrid-model)."""
from __future__ import annotations

import pytest
import torch

from megarl.protocols import GenerationRequest, SamplingParams
from megarl.sampler import hf_model
from megarl.sampler.engine import BuiltinEngine
from tests.helpers import (NEMOTRON_H_TINY, QWEN3_NEXT_TINY, fp32_logprob_tol, save_tiny_nemotron_h,
                           save_tiny_qwen3_next)
from tests.sampler import transformers_logprobs, transformers_model

# |log-prob| <= 8 (vocab 264), positions up to the engine's 64; the delta rule adds, per linear layer, a k.v
# product (head_dim) and a running sum over the positions, which the attention terms of the bound already count.
# A Mamba-2 mixer's products (in_proj over hidden, the conv over 4 inputs, C.h over the SSM state of 8, the scan's
# sum over the positions, out_proj over its 32 channels) are each within a layer's terms of the bound too; each of
# Nemotron-H's blocks is counted as a whole layer.
TOL = {"qwen3_next": fp32_logprob_tol(QWEN3_NEXT_TINY, max_logprob=8.0, max_seq_len=64),
       "nemotron_h": fp32_logprob_tol({**NEMOTRON_H_TINY, "num_hidden_layers": len(NEMOTRON_H_TINY["layers_block_type"])},
                                      max_logprob=8.0, max_seq_len=64)}
SAVE = {"qwen3_next": save_tiny_qwen3_next, "nemotron_h": save_tiny_nemotron_h}


@pytest.fixture(scope="module", params=sorted(SAVE))
def hybrid(request, tmp_path_factory):
    """(kind, path, HF config dict, named_parameters' tensors) of a tiny hybrid model."""
    kind = request.param
    path = SAVE[kind](tmp_path_factory.mktemp(kind) / kind, tokenizer=False)
    return (kind, path, *hf_model.load_pretrained(str(path)))


def _max_gap(completion, reference_logprobs, begin: int = 0) -> float:
    n = len(completion.prompt_ids)
    return max(abs(completion.logprobs[i] - reference_logprobs[n - 1 + i, completion.token_ids[i]].item())
               for i in range(begin, len(completion.token_ids)))


def test_hybrid_layers_hold_recurrent_state_per_slot(hybrid):
    """A linear-attention layer (gated DeltaNet, Mamba-2) holds recurrent state, an attention layer a KV cache, and
    Nemotron-H's MLP and MoE blocks (layers of their own in its `layers_block_type`) nothing."""
    from transformers.cache_utils import DummyLayer, LinearAttentionCacheLayerMixin

    kind, _, cfg, _ = hybrid
    spec = hf_model.ModelSpec.from_hf_config(cfg)
    assert spec.is_hybrid
    cache = hf_model.KVCache(spec, 2, 16, torch.float32)
    kinds = ["linear" if isinstance(layer, LinearAttentionCacheLayerMixin) else
             "none" if isinstance(layer, DummyLayer) else "kv" for layer in cache.layers]
    expected = {"qwen3_next": ["linear", "linear", "kv"], "nemotron_h": ["linear", "none", "linear", "kv", "none"]}
    assert kinds == expected[kind]


def test_prefill_and_decode_under_continuous_batching_equal_one_forward(hybrid):
    """More requests than slots, prompts of 1 to 12 tokens prefilled together (right-padded: each row's state is
    taken at its own length) in chunks of 4 positions (each chunk starts from the conv and recurrent state the
    chunks before it left, a row keeps its state through the chunks after its end, a prefill of 9 positions ends in
    a one-token chunk), two with the same prompt (one prefill, its state copied), slots freed and packed while
    others decode: every behaviour log-prob is transformers' single full forward's, within the fp32 bound. (A
    prefill in one piece is its first chunk alone: test_qwen3_5_text_runs_as_transformers_runs_it.)"""
    kind, path, cfg, weights = hybrid
    engine = BuiltinEngine(cfg, weights, max_running=3, max_seq_len=64, seed=1, prefill_chunk=4)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (k,), generator=gen).tolist() for k in (1, 9, 5, 12, 3, 7)]
    prompts.insert(2, prompts[1])
    requests = [GenerationRequest(str(i), p, SamplingParams(temperature=1.0, max_new_tokens=2 + i), ())
                for i, p in enumerate(prompts)]
    done = {c.request_id: c for c in engine.generate(requests)}
    reference = transformers_model(path)
    for r in requests:
        c = done[r.request_id]
        assert len(c.token_ids) == r.sampling.max_new_tokens
        gap = _max_gap(c, transformers_logprobs(reference, c.prompt_ids + c.token_ids))
        assert gap <= TOL[kind], (r.request_id, gap, TOL[kind])


def _continue_decode(old, new, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' own cached decode when `old` computed the cache (KV and recurrent state) of prefix[:-1] and
    `new` then feeds prefix[-1] and `tokens` one at a time: the next-token log-probs [1 + len(tokens), V]."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=old.config)
        old(torch.tensor([prefix[:-1]]), cache=cache, use_cache=True)
        rows = []
        for token in prefix[-1:] + tokens:
            rows.append(new(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1])
    return torch.log_softmax(torch.stack(rows).float(), -1)


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_in_flight_swap_keeps_or_rebuilds_kv_and_recurrent_state(hybrid, policy):
    """v2 staged after three tokens under v1. keep: every later token is v2 decoding over the KV cache and the
    recurrent state v1 computed for the tokens before the swap (transformers' own cache, built by the v1 model and
    continued by the v2 model), and its recorded log-prob is that; recompute: every later token is v2's full
    forward over the whole sequence (the re-prefill runs in chunks of 5 positions). The two references differ by
    far more than the tolerance."""
    kind, path, cfg, weights = hybrid
    gen = torch.Generator().manual_seed(5)
    v2 = {k: t + 0.05 * torch.randn(t.shape, generator=gen) for k, t in weights.items()}
    engine = BuiltinEngine(cfg, weights, max_running=4, kv_on_update=policy, prefill_chunk=5)
    prompts = [torch.randint(0, 256, (k,), generator=gen).tolist() for k in (2, 6, 11, 4)]
    requests = [GenerationRequest(str(i), p, SamplingParams(temperature=1.0, max_new_tokens=8), ())
                for i, p in enumerate(prompts)]
    for r in requests:
        engine.add_request(r)
    for _ in range(2):  # admitted in step 1 (prefill token + decode token): 3 tokens each under v1
        assert engine.step() == []
    engine.stage_weights(v2, 1)
    done = {}
    while engine.num_unfinished:
        done.update((c.request_id, c) for c in engine.step())
    old, new = transformers_model(path, weights), transformers_model(path, v2)
    for r in requests:
        c = done[r.request_id]
        assert c.versions == [0] * 3 + [1] * 5
        n = len(c.prompt_ids)
        before = transformers_logprobs(old, c.prompt_ids + c.token_ids)
        assert max(abs(c.logprobs[i] - before[n - 1 + i, c.token_ids[i]].item()) for i in range(3)) <= TOL[kind]
        kept = _continue_decode(old, new, c.prompt_ids + c.token_ids[:3], c.token_ids[3:-1])
        fresh = transformers_logprobs(new, c.prompt_ids + c.token_ids)[n + 2:-1]
        assert (kept - fresh).abs().max() > 100 * TOL[kind]  # the two policies are told apart
        expected = kept if policy == "keep" else fresh
        gaps = [abs(c.logprobs[3 + j] - expected[j, t].item()) for j, t in enumerate(c.token_ids[3:])]
        assert max(gaps) <= TOL[kind], (policy, r.request_id, gaps, TOL[kind])


def test_qwen3_5_text_runs_as_transformers_runs_it(tmp_path):
    """Qwen3.5's text model (model_type qwen3_5_text: gated DeltaNet with separate qkv / z / b / a projections,
    dense MLP) on the same per-slot state: prompts of 1 to 6 tokens, log-probs equal transformers' forward."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shared = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "layer_types", "linear_key_head_dim", "linear_value_head_dim",
              "linear_num_key_heads", "linear_num_value_heads")
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_5_text", **{k: QWEN3_NEXT_TINY[k] for k in shared}, initializer_range=0.1)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "q")
    cfg, weights = hf_model.load_pretrained(str(tmp_path / "q"))
    engine = BuiltinEngine(cfg, weights, max_running=2, max_seq_len=32, seed=1)
    requests = [GenerationRequest(str(i), p, SamplingParams(temperature=1.0, max_new_tokens=4), ())
                for i, p in enumerate([[1, 2, 3], [5, 6, 7, 8, 9, 10], [4]])]
    reference = transformers_model(tmp_path / "q")
    for c in engine.generate(requests):
        assert _max_gap(c, transformers_logprobs(reference, c.prompt_ids + c.token_ids)) <= TOL["qwen3_next"]
