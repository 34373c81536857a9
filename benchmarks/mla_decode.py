"""DeepSeek-V3's multi-latent attention on the built-in engine: decode tokens/s of the native forward (a latent
cache, the absorbed decode) against the generic model (transformers' own modules over the engine's slot cache), and
the KV-cache bytes per token each holds, on the same random weights in one process (docs/moe.md, "GLM-4.5 and
DeepSeek-V3").

    python benchmarks/mla_decode.py [--threads 1] [--rows 8] [--prompt 32] [--tokens 64]

Both models are driven through the interface the engine uses (ModelSpec, KVCache, forward_tables, prepare_weights,
forward): one prefill of every row, then one decode step per token; prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

# A small DeepSeek-V3: multi-latent attention with a q latent, interleaved YaRN, a dense first layer, then 16 routed
# experts (top-4 of the best 2 of 4 groups) and a shared expert.
CONFIG = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, vocab_size=1024,
              max_position_embeddings=512, intermediate_size=512, moe_intermediate_size=128, n_shared_experts=1,
              n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
              first_k_dense_replace=1, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
              v_head_dim=32, rope_interleave=True, tie_word_embeddings=False, num_nextn_predict_layers=0,
              pad_token_id=None, bos_token_id=None, eos_token_id=2,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                               "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 1.0})


def cache_bytes_per_token(module, spec, cache) -> int:
    """What the cache holds for one position of one slot, over every layer."""
    if module.__name__.endswith(".model"):
        return cache.latent[0, 0, 0].numel() * cache.latent.element_size() * spec.num_layers
    return sum(t[0, :, 0].numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def decode(module, model_dir: Path, ids: torch.Tensor, prompt: int) -> tuple[float, int, torch.Tensor]:
    """(decode tokens/s, cache bytes per token, the decoded positions' log-probs) of one engine model module."""
    cfg, weights = module.load_pretrained(str(model_dir))
    spec = module.ModelSpec.from_hf_config(cfg)
    rows, width = ids.shape
    weights = module.prepare_weights(spec, weights)
    tables, cache = module.forward_tables(spec, width), module.KVCache(spec, rows, width, torch.float32)
    logprobs = []
    with torch.inference_mode():
        module.forward(spec, weights, tables, cache, ids[:, :prompt], torch.arange(prompt).expand(rows, prompt),
                       logit_index=torch.full((rows,), prompt - 1))
        start = time.perf_counter()
        for t in range(prompt, width):
            logits = module.forward(spec, weights, tables, cache, ids[:, t:t + 1], torch.full((rows, 1), t),
                                    attn_len=t + 1)
            logprobs.append(torch.log_softmax(logits[:, 0].float(), -1))
        seconds = time.perf_counter() - start
    return rows * (width - prompt) / seconds, cache_bytes_per_token(module, spec, cache), torch.stack(logprobs)


def main() -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from megarl.sampler import hf_model, model as native

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab_size"], (args.rows, args.prompt + args.tokens),
                        generator=torch.Generator().manual_seed(1))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        DeepseekV3ForCausalLM(DeepseekV3Config(**CONFIG)).save_pretrained(tmp)
        for name, module in (("native", native), ("generic", hf_model)):
            out[name] = decode(module, Path(tmp), ids, args.prompt)
    heads, layers = CONFIG["num_attention_heads"], CONFIG["num_hidden_layers"]
    per_head_kv = 4 * layers * heads * (CONFIG["qk_nope_head_dim"] + CONFIG["qk_rope_head_dim"] + CONFIG["v_head_dim"])
    print(json.dumps({
        **{f"{name}_decode_tokens_per_s": round(rate, 1) for name, (rate, _, _) in out.items()},
        **{f"{name}_kv_bytes_per_token": size for name, (_, size, _) in out.items()},
        "per_head_kv_bytes_per_token": per_head_kv, "threads": args.threads,
        "max_abs_logprob_difference": float((out["native"][2] - out["generic"][2]).abs().max())}))


if __name__ == "__main__":
    main()
