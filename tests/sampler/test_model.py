"""The pure-torch decoder forward against HF transformers on the same weights (fp32, within tests.sampler.TOL)."""
from __future__ import annotations

import json

import pytest
import torch

from megarl.sampler.model import KVCache, ModelSpec, forward, load_pretrained, prepare_weights, forward_tables
from tests.sampler import MISTRAL_WINDOW, TOL, make_tiny_model



# Llama 3.x RoPE scaling on a large base, so the rescaled long wavelengths exist at head_dim 16.
LLAMA3_ROPE = {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192, "rope_theta": 1e6}}
# YaRN on an original context shorter than the tests' sequences (positions beyond it are what it scales for).
YARN_ROPE = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                 "rope_theta": 1e4}}
ROPES = {"llama3_rope": LLAMA3_ROPE, "yarn_rope": YARN_ROPE}


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3", "mistral", "phi3", "smollm3", "olmo2", "gemma3",
                                        *ROPES])
def tiny(request, tmp_path_factory):
    """(kind, HF model, spec, runtime weights) for a Qwen2 (GQA, bias, tied), a Llama (untied), a Qwen3 (q/k norms,
    wide heads), a Mistral (a sliding window shorter than the tests' sequences), a Phi-3 (fused qkv_proj and
    gate_up_proj), a SmolLM3 (a layer without RoPE), an OLMo 2 (post-norms, q/k norms over the whole projection), a
    Gemma 3 (a local then a global layer, four (1 + w) norms per layer, scaled embeddings, GeGLU) and
    Llamas with Llama-3 and YaRN RoPE
    scaling."""
    from transformers import AutoModelForCausalLM

    kind, overrides = ("llama", ROPES[request.param]) if request.param in ROPES else (request.param, {})
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), kind, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg, weights = load_pretrained(str(path))
    spec = ModelSpec.from_hf_config(cfg)
    return request.param, hf, spec, prepare_weights(spec, weights)


def hf_logprobs(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(ids).logits.float(), dim=-1)


def test_spec_reads_hf_config(tiny):
    kind, hf, spec, _ = tiny
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 32 if kind == "qwen3" else 16)
    assert spec.tie_word_embeddings == (kind in ("qwen2", "qwen3", "smollm3", "gemma3"))
    assert spec.qk_norm == (kind in ("qwen3", "olmo2", "gemma3")) and spec.post_norms == (kind == "olmo2")
    assert spec.gemma == (kind == "gemma3") and spec.local_layers == ((True, False) if kind == "gemma3" else None)
    assert spec.rope_layers == ((True, False) if kind == "smollm3" else None)
    assert (spec.rope_scaling is not None) == (kind in (*ROPES, "gemma3"))  # (Gemma 3's global layers: linear)
    assert spec.qkv_bias == (kind == "qwen2")
    assert spec.sliding_window == (MISTRAL_WINDOW if kind in ("mistral", "gemma3") else None)
    if kind == "gemma3":
        rope = hf.config.rope_parameters
        assert (spec.rope_theta, spec.local_rope_theta) == (rope["full_attention"]["rope_theta"],
                                                            rope["sliding_attention"]["rope_theta"])
        assert spec.attn_scale == hf.config.query_pre_attn_scalar ** -0.5
    else:
        assert spec.rope_theta == hf.config.rope_parameters["rope_theta"]


def test_prefill_matches_hf(tiny):
    _, hf, spec, w = tiny
    ids = torch.randint(0, spec.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))
    cache = KVCache(spec, num_slots=4, max_seq_len=32, dtype=torch.float32)
    positions = torch.arange(12).expand(3, 12)
    with torch.inference_mode():
        ours = torch.log_softmax(forward(spec, w, forward_tables(spec, 32), cache, ids, positions, slot_start=1), -1)
    assert (ours - hf_logprobs(hf, ids)).abs().max() <= TOL


def test_padded_prefill_and_last_logit_index(tiny):
    """Rows of different lengths, right-padded in one call: each row's last logits equal HF's."""
    _, hf, spec, w = tiny
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, spec.vocab_size, (n,), generator=gen) for n in (5, 11, 8)]
    ids = torch.zeros(3, 11, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = s
    cache = KVCache(spec, num_slots=3, max_seq_len=16, dtype=torch.float32)
    last = torch.tensor([len(s) - 1 for s in seqs])
    with torch.inference_mode():
        logits = forward(spec, w, forward_tables(spec, 16), cache, ids, torch.arange(11).expand(3, 11),
                         attn_len=11, logit_index=last)
    for row, s in enumerate(seqs):
        ref = hf_logprobs(hf, s[None])[0, -1]
        assert (torch.log_softmax(logits[row], -1) - ref).abs().max() <= TOL


def test_batched_decode_with_different_lengths_matches_hf(tiny):
    """Continuous batching: rows at different positions advance together, one token per call."""
    _, hf, spec, w = tiny
    gen = torch.Generator().manual_seed(3)
    full = [torch.randint(0, spec.vocab_size, (n,), generator=gen) for n in (14, 20)]
    refs = [hf_logprobs(hf, s[None])[0] for s in full]
    prompt_lens = [3, 9]  # row 0 is 6 tokens behind row 1 throughout
    max_len = 24
    tables = forward_tables(spec, max_len)
    cache = KVCache(spec, num_slots=2, max_seq_len=max_len, dtype=torch.float32)
    ids = torch.zeros(2, 9, dtype=torch.long)
    for row, n in enumerate(prompt_lens):
        ids[row, :n] = full[row][:n]
    with torch.inference_mode():
        forward(spec, w, tables, cache, ids, torch.arange(9).expand(2, 9), logit_index=torch.tensor([2, 8]))
        for step in range(11):
            pos = torch.tensor([[n + step] for n in prompt_lens])
            tok = torch.stack([full[row][pos[row, 0]] for row in range(2)])[:, None]
            out = torch.log_softmax(forward(spec, w, tables, cache, tok, pos, attn_len=int(pos.max()) + 1), -1)
            for row in range(2):
                assert (out[row, 0] - refs[row][pos[row, 0]]).abs().max() <= TOL


def test_shard_spec_is_one_tp_ranks_share(tiny):
    """shard(t) divides the heads, KV heads and MLP width; q/k/v/gate/up and the embedding (vocab rows)
    shrink by rows, o/down by columns; hidden, vocab_size and the rest stay; shard(1) is the model itself."""
    kind, _, spec, w = tiny
    d = 2 if kind == "qwen3" else 1  # (Qwen3's heads are 32 wide: twice hidden / heads)
    if kind in ("phi3", "olmo2"):  # its fused tensors / whole-projection norms have no per-rank slices: refused
        with pytest.raises(ValueError, match=f"{kind}'s (fused qkv_proj / gate_up_proj|q_norm / k_norm over the "
                                             "whole projection) .* sampler.tp = 1"):
            spec.shard(2)
        return
    half = spec.shard(2)
    assert spec.shard(1) == spec and half.tp_size == 2
    full_shapes, shapes = spec.weight_shapes(), half.weight_shapes()
    assert shapes.keys() == full_shapes.keys()
    p = "model.layers.0."
    assert shapes[p + "self_attn.q_proj.weight"] == (32 * d, 64) and shapes[p + "self_attn.k_proj.weight"] == (16 * d, 64)
    assert shapes[p + "self_attn.o_proj.weight"] == (64, 32 * d) and shapes[p + "mlp.down_proj.weight"] == (64, 64)
    assert shapes[p + "mlp.up_proj.weight"] == (64, 64) and shapes["model.embed_tokens.weight"] == (16, 64)
    assert half.vocab_size == spec.vocab_size == 32 and half.shard_vocab == 16
    with pytest.raises(ValueError, match="tp_size=2 needs a tensor-parallel group of that size, got none"):
        zero = torch.zeros(1, 1, dtype=torch.long)
        forward(half, w, forward_tables(half, 8), KVCache(half, 1, 8, torch.float32), zero, zero)


@pytest.mark.parametrize("field, value", [
    ("rope_scaling", {"rope_type": "dynamic", "factor": 8.0}),
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}),
    ("use_sliding_window", True),
    ("model_type", "gemma3"),
    ("hidden_act", "gelu"),
])
def test_unsupported_config_names_the_field(field, value, tmp_path):
    cfg = json.loads((make_tiny_model(tmp_path, "qwen2") / "config.json").read_text())
    cfg[field] = value
    with pytest.raises(ValueError, match=field):
        ModelSpec.from_hf_config(cfg)


def test_check_weights_names_first_problem(tiny):
    _, hf, spec, _ = tiny
    weights = {k: v.detach() for k, v in hf.state_dict().items() if k != "lm_head.weight" or not
               spec.tie_word_embeddings}
    spec.check_weights(weights)
    up = "model.layers.1.mlp." + ("gate_up_proj" if spec.fused_projections else "up_proj") + ".weight"
    bad = dict(weights, **{up: torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=up):
        spec.check_weights(bad)
    missing = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        spec.check_weights(missing)
    with pytest.raises(ValueError, match="unexpected.*extra"):
        spec.check_weights(dict(weights, extra=torch.zeros(1)))


def test_load_sharded_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "single", "llama")
    hf = AutoModelForCausalLM.from_pretrained(path)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    _, single = load_pretrained(str(path))
    _, sharded = load_pretrained(str(tmp_path / "sharded"))
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)
