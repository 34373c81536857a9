"""Tests of the built-in sampler engine; shared helpers build tiny HF models locally (no hub)."""
from __future__ import annotations

import functools
import shutil
from pathlib import Path

import numpy as np
import torch

from tests.helpers import fp32_logprob_tol

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=32,
            intermediate_size=128, max_position_embeddings=256)
# |log-prob| of the tiny models below stays under 7.4 (measured over random prompts for every kind), so two
# float32 evaluations that differ in reduction order agree within this (tests.helpers.fp32_logprob_tol).
TOL = fp32_logprob_tol(TINY, max_logprob=8.0)
MISTRAL_WINDOW = 6
# The kinds whose lm_head is the embedding.
TIED = ("qwen2", "qwen3", "smollm3", "mixtral", "qwen3_moe", "gemma3")


def make_tiny_model(path: Path, kind: str = "qwen2", seed: int = 0, **overrides) -> Path:
    """Save a tiny randomly initialised HF model to `path` and return it.

    "qwen2": GQA, q/k/v biases, tied embeddings.  "llama": GQA, no biases, untied lm_head.  "qwen3": GQA, per-head
    q/k RMSNorm weights drawn away from 1, heads x head_dim (4 x 32) wider than hidden (64), tied embeddings.
    "mistral": as "llama", with a sliding window of MISTRAL_WINDOW positions (shorter than the tests' sequences).
    "phi3": as "llama", its q/k/v one qkv_proj and gate/up one gate_up_proj (as Phi-3's checkpoints hold them).
    "smollm3": GQA, no biases, tied embeddings, its second layer without RoPE.
    "olmo2": GQA, no biases, untied, norms after attention and the MLP, q/k norms over the whole projection.
    "gemma3": Gemma 3 text as tests.helpers.GEMMA3 (a local layer with a window of MISTRAL_WINDOW, then a global one,
    each with its own RoPE; query_pre_attn_scalar not head_dim; (1 + w) norms drawn away from 0), tied.
    "mixtral": GQA, no biases, tied embeddings, 4 experts of width 64, top-2 (every layer an MoE layer).
    "qwen3_moe": the same experts (unnormalised top-k unless norm_topk_prob=True), per-head q/k RMSNorm weights
    drawn away from 1 (so an engine that skipped them would show).
    "gpt_oss": tests.helpers.save_tiny_gpt_oss at this vocabulary (sinks, a sliding layer of window 4 then a full one,
    biases everywhere, 4 biased experts of width 24 whose clamped SwiGLU cuts, YaRN; untied): every one of its
    dimensions at most TINY's, so TOL bounds it too.
    "glm4_moe": tests.helpers.save_tiny_glm4_moe at this vocabulary and TINY's 2 layers, the first dense, the second
    sigmoid-routed (expert bias, group limit, scaling, a shared expert), partial RoPE, q/k/v biases and q/k norms;
    untied; its dimensions at most TINY's, so TOL bounds it too.
    "deepseek_v3": tests.helpers.save_tiny_deepseek_v3 at this vocabulary and TINY's 2 layers (multi-latent attention
    with a q latent, interleaved YaRN with its mscale, then GLM-4.5's MoE in the second layer; q_lora_rank=None: one
    q_proj); its dimensions at most TINY's, so TOL bounds it too.
    initializer_range is raised from HF's 0.02 so next-token distributions are far from uniform
    (greedy decoding has clear winners), but kept at 0.1: at 0.25 the activations grow large enough
    that fp32 rounding alone (HF's own cached decode vs its prefill) reaches 1e-5 in log-prob.
    """
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                              MixtralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              SmolLM3Config, SmolLM3ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    if kind == "gpt_oss":
        from tests.helpers import save_tiny_gpt_oss

        return save_tiny_gpt_oss(path, **{"vocab_size": TINY["vocab_size"], **overrides})
    if kind in ("glm4_moe", "deepseek_v3"):
        from tests.helpers import save_tiny_deepseek_v3, save_tiny_glm4_moe

        save = save_tiny_glm4_moe if kind == "glm4_moe" else save_tiny_deepseek_v3
        return save(path, **{"vocab_size": TINY["vocab_size"], "num_hidden_layers": 2, **overrides})
    torch.manual_seed(seed)
    moe = {"mixtral": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
           "qwen3_moe": dict(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2)}.get(kind, {})
    kw = dict(TINY, initializer_range=0.1, **{**moe, **overrides})
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **kw))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **kw))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=True, **{"head_dim": 32, **kw}))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(tie_word_embeddings=False, sliding_window=MISTRAL_WINDOW, **kw))
    elif kind == "phi3":
        model = Phi3ForCausalLM(Phi3Config(tie_word_embeddings=False, pad_token_id=None, eos_token_id=2, **kw))
    elif kind == "smollm3":
        model = SmolLM3ForCausalLM(SmolLM3Config(tie_word_embeddings=True, no_rope_layers=[1, 0], pad_token_id=None,
                                                 bos_token_id=1, eos_token_id=2, **kw))
    elif kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(tie_word_embeddings=True, **kw))
    elif kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(tie_word_embeddings=True, **kw))
    elif kind == "olmo2":
        from transformers import Olmo2Config, Olmo2ForCausalLM

        model = Olmo2ForCausalLM(Olmo2Config(tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
                                             eos_token_id=2, **kw))
        with torch.no_grad():  # every norm away from 1: one left out, or mapped in another's place, shows
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(1.0, 0.3)
    elif kind == "gemma3":
        from tests.helpers import gemma3_model

        model = gemma3_model({k: v for k, v in kw.items() if k != "initializer_range"}, sliding_window=MISTRAL_WINDOW,
                             initializer_range=kw["initializer_range"])
    else:
        raise ValueError(kind)
    if kind.startswith("qwen3"):
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    model.save_pretrained(path)
    return path


def dominant_token_weights(weights: dict[str, torch.Tensor], token: int, tied: bool,
                           strength: float = 200.0) -> dict[str, torch.Tensor]:
    """A copy of `weights` under which `token` is overwhelmingly likely after any prefix.

    Residual-stream dim 0 is made a positive constant: every embedding row gets 1 there, `token`'s
    row more, and no layer writes to it (row 0 of every o_proj / down_proj is zeroed).  The output
    row of `token` then reads that dim with a huge weight.  Works for tied embeddings too: there the
    embedding row *is* the output row, and the input contribution of dim 0 is positive either way.
    """
    w = {name: t.clone() for name, t in weights.items()}
    w["model.embed_tokens.weight"][:, 0] = 1.0
    for name in w:
        if name.endswith(("self_attn.o_proj.weight", "down_proj.weight", ".w2.weight")):  # (experts' too)
            w[name][0] = 0.0
        if name.endswith(("self_attn.o_proj.bias", "experts.down_proj", "experts.down_proj_bias")):
            w[name][..., 0] = 0.0  # (gpt-oss: its biases, and its fused downs [E, I, H], write dim 0 too)
    head = w["model.embed_tokens.weight"] if tied else w["lm_head.weight"]
    head[:, 0] = 1.0 if tied else 0.0
    head[token, 0] = strength
    return w


def save_version(model_dir: Path, weights: dict, out: Path) -> Path:
    """An HF directory of `weights` (transformers converts the per-expert names only when it loads a directory)."""
    from safetensors.torch import save_file

    out.mkdir()
    shutil.copy(model_dir / "config.json", out / "config.json")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@functools.lru_cache(maxsize=4)
def _hf_model(model_dir: str):
    """transformers' model of a directory, loaded once per test session (the references only read it)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def hf_logprobs_and_routes(ids: list[int], *versions: tuple[Path, int | None]) -> tuple[torch.Tensor, np.ndarray]:
    """transformers' log-probs [len(ids), V] and routes [len(ids), MoE layers, top_k], each (model dir, end) of
    `versions` computing positions up to `end` (None: to the end) over the KV cache the earlier ones left:
    what an engine that keeps its cache across an update computed."""
    chosen, logits, cache, begin = [], [], None, 0
    for model_dir, end in versions:
        hf = _hf_model(str(model_dir))
        # (each router returns (logits, weights, chosen experts); gpt-oss's is `mlp.router`; a GLM-4.5's or
        # DeepSeek-V3's first layers are dense: no router)
        hooks = [getattr(layer.mlp, "router", None) or getattr(layer.mlp, "gate", None) for layer in hf.model.layers]
        hooks = [router.register_forward_hook(lambda _m, _i, out: chosen.append(out[2]))
                 for router in hooks if router is not None]
        end = len(ids) if end is None else end
        with torch.inference_mode():
            out = hf(torch.tensor([ids[begin:end]]), cache=cache, use_cache=True)
        for h in hooks:
            h.remove()
        logits.append(out.logits[0].float())
        cache, begin = out.cache, end
    # chosen: per forward call, per MoE layer, [tokens, top_k]
    layers = len(hooks)
    per_call = [torch.stack(chosen[i:i + layers], dim=1) for i in range(0, len(chosen), layers)]
    return torch.log_softmax(torch.cat(logits), -1), torch.cat(per_call).numpy()


def transformers_model(path, weights=None):
    """transformers' own model of `path` in fp32 (the reference), with `weights` (name -> tensor) loaded over it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if weights is not None:
        model.load_state_dict(weights, strict=False)
    return model


def transformers_logprobs(model, ids: list[int]) -> torch.Tensor:
    """Next-token log-probs [len(ids), V] of one transformers forward."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
