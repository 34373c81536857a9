"""Shared test helpers: run real torchrun launches and python subprocesses with a deadline, save the tests' tiny HF
models, and key the test cache of built embedded models (builder_fingerprint)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 120,
                 module: bool = False) -> subprocess.CompletedProcess:
    """A real `torchrun --standalone` launch; output captured, failing loudly on timeout."""
    target = ["-m", str(script)] if module else [str(script)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *target, *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def forked_ranks(nproc: int, script: str | Path, *args: str, timeout_s: float, warm: str = "megatron") -> list[str]:
    """The command that runs `script`'s `nproc` ranks as torchrun would, each a fork of one process that imported
    torch (warm="torch") or torch and a learner backend's framework (warm="megatron", "deepspeed") once
    (tests/forked_ranks.py): for worker scripts whose tests check what the ranks compute, not the launch."""
    return [sys.executable, str(REPO / "tests" / "forked_ranks.py"), str(nproc), str(timeout_s), warm, str(script),
            *map(str, args)]


def run_forked_ranks(script: str | Path, nproc: int, *args: str, timeout: float = 120,
                     warm: str = "megatron") -> subprocess.CompletedProcess:
    """run_torchrun's launch with forked ranks (forked_ranks): output captured, failing loudly on timeout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(forked_ranks(nproc, script, *args, timeout_s=timeout - 10, warm=warm), capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


def run_python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO)


def save_tokenizer(model_dir: Path) -> None:
    """The embedded models' real tokenizer (tokenizer.json + tokenizer_config.json), which megarl's start-up
    check loads: for model directories made up for the CLI's checks (nothing loads their weights)."""
    from megarl.embedded.tiny import build_tokenizer

    build_tokenizer().save_pretrained(model_dir)


# The learner tests' tiny models (save_tiny_qwen2, save_tiny_moe: their experts are no wider); vocab_size is the
# largest any of them uses (the embedded tokenizer's 264), which only loosens the bound below.
LEARNER_TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=48, vocab_size=264, max_position_embeddings=64)


def save_tiny_qwen2(path: Path, tie_word_embeddings: bool, vocab_size: int = 64, tokenizer: bool = False) -> Path:
    """A real HF Qwen2 directory small enough for multi-process learner tests: GQA (4 heads, 2 KV heads),
    2 layers, and q/k/v biases drawn non-zero so that a converter that dropped them would show."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**{**LEARNER_TINY, "vocab_size": vocab_size},
                                         tie_word_embeddings=tie_word_embeddings))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)
    model.save_pretrained(path)
    if tokenizer:
        from megarl.embedded.tiny import build_tokenizer

        build_tokenizer().save_pretrained(path)
    return path


def save_tiny_qwen3(path: Path, vocab_size: int = 64) -> Path:
    """A real HF Qwen3 directory of the learner tests' size: per-head q/k RMSNorm weights drawn away from 1 and
    heads x head_dim (4 x 16) wider than hidden (32), as Qwen3's are, so a converter that dropped the norms or
    assumed head_dim = hidden / heads would show."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**{**LEARNER_TINY, "vocab_size": vocab_size}, head_dim=16,
                                         tie_word_embeddings=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.3)
    model.save_pretrained(path)
    return path


# The window of the tests' tiny Mistrals: shorter than every test's rows, so a forward that ignored it would show.
MISTRAL_WINDOW = 5
YARN_ORIGINAL = 8


def save_tiny_dense(path: Path, kind: str, vocab_size: int = 64) -> Path:
    """A real HF directory of a dense family of the learner tests' size (LEARNER_TINY), kind: "mistral" (a sliding
    window of MISTRAL_WINDOW positions, untied), "llama_yarn" (YaRN RoPE over an original context of
    YARN_ORIGINAL positions, shorter than the tests' rows, tied), "phi3" (fused qkv_proj and gate_up_proj, untied),
    "smollm3" (its second layer without RoPE, tied), "olmo2" (norms after attention and the MLP, q/k norms over the
    whole projection, every norm weight drawn away from 1, untied), "gemma3" (GEMMA3: a local layer, then a global
    one, every norm weight drawn away from 0, tied). No pad token: transformers gives the pad token's embedding row
    no gradient (nn.Embedding's padding_idx), which the megatron learner does not copy."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Olmo2Config,
                              Olmo2ForCausalLM, Phi3Config, Phi3ForCausalLM, SmolLM3Config, SmolLM3ForCausalLM)

    torch.manual_seed(0)
    tiny = {**LEARNER_TINY, "vocab_size": vocab_size}
    if kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**tiny, sliding_window=MISTRAL_WINDOW, tie_word_embeddings=False))
    elif kind == "phi3":
        model = Phi3ForCausalLM(Phi3Config(**tiny, tie_word_embeddings=False, pad_token_id=None, eos_token_id=2))
    elif kind == "smollm3":
        model = SmolLM3ForCausalLM(SmolLM3Config(**tiny, no_rope_layers=[1, 0], tie_word_embeddings=True,
                                                 pad_token_id=None, bos_token_id=1, eos_token_id=2))
    elif kind == "olmo2":
        model = Olmo2ForCausalLM(Olmo2Config(**tiny, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
                                             eos_token_id=2))
        with torch.no_grad():  # (a norm left at 1 would hide one mapped in another's place)
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(1.0, 0.3)
    elif kind == "gemma3":
        model = gemma3_model(tiny)
    elif kind == "qwen3_5":
        model = qwen3_5_model(tiny)
    elif kind == "llama_yarn":
        model = LlamaForCausalLM(LlamaConfig(**tiny, tie_word_embeddings=True, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": YARN_ORIGINAL, "rope_theta": 1e4}))
    else:
        raise ValueError(kind)
    model.save_pretrained(path)
    return path


# The tests' tiny Qwen3.5 text: a gated-DeltaNet layer (PP2's first stage) then a gated full-attention one; heads of
# 16 dims (RoPE on a quarter of them: 4), 2 key / 4 value heads of 8 in the linear layer (TP2: one key head a rank).
QWEN3_5 = dict(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
               linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)


def qwen3_5_model(tiny: dict, **overrides):
    """A random HF Qwen3_5ForCausalLM of `tiny`'s shape with QWEN3_5's layers, untied, no pad token; every norm
    weight drawn away from its initial value ((1 + w) norms start at 0, the gated norm at 1: a norm left there
    would hide one mapped in another's place), and the gated-DeltaNet's dt_bias and A_log too."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**tiny, **QWEN3_5, **overrides}, tie_word_embeddings=False,
                                                 pad_token_id=None, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", "A_log")):
                p.add_(torch.randn_like(p) * 0.3)
    return model


# The tests' tiny Gemma 3 text: a local layer (window 5, shorter than every test's rows: PP2's first stage) then a
# global one; the two RoPEs on different bases, the global one linearly scaled (as Gemma 3 4B's); heads of 16 dims
# (wider than hidden / heads) and a query_pre_attn_scalar that is not head_dim.
GEMMA3 = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=MISTRAL_WINDOW,
              layer_types=["sliding_attention", "full_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                               "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}})


def gemma3_model(tiny: dict, **overrides):
    """A random HF Gemma3ForCausalLM of `tiny`'s shape with GEMMA3's features, tied, no pad token, every norm weight
    drawn away from 0 (its norms compute 1 + weight: a norm left at 0 would hide one mapped in another's place)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**tiny, **GEMMA3, **overrides}, tie_word_embeddings=True,
                                               pad_token_id=None, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model


def save_tiny_moe(path: Path, kind: str, vocab_size: int = 64, **overrides) -> Path:
    """A real HF mixture-of-experts directory (kind: mixtral | qwen3_moe): 2 layers, 4 experts, top-2, GQA;
    Qwen3-MoE with its per-head q/k RMSNorm drawn away from 1 so that a converter that dropped it would show."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=vocab_size, max_position_embeddings=64, num_experts_per_tok=2)
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=4, **common, **overrides))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                                   head_dim=8, **common, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            if name.endswith("gate.weight"):  # routers decisive enough that fp32 noise flips no top-k
                p.mul_(8.0)
    model.save_pretrained(path)
    return path


# The tiny GLM-4.5's router: 8 experts in 4 groups of 2, the best 2 groups kept, top-4 (megatron scores a group by
# its best top_k // topk_group = 2 experts, as HF does).
GLM4_MOE_ROUTER = dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=4)


def save_tiny_glm4_moe(path: Path, vocab_size: int = 64, **overrides) -> Path:
    """A real HF GLM-4.5 (glm4_moe) directory of the learner tests' size with every feature that sets it apart drawn
    so that a converter that dropped one would show: 3 layers, the first dense (first_k_dense_replace=1); heads of 16
    dims (wider than hidden / heads) of which partial_rotary_factor 0.5 rotate; q/k/v biases (attention_bias) and
    per-head q/k RMSNorm (use_qk_norm) away from 0 / 1; a shared expert; a sigmoid router with
    e_score_correction_bias, group-limited top-k (GLM4_MOE_ROUTER) and routed_scaling_factor 2.5; untied lm_head."""
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(0)
    config = Glm4MoeConfig(**{**dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=vocab_size, max_position_embeddings=64, intermediate_size=48, moe_intermediate_size=16,
        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        attention_bias=True, use_qk_norm=True, tie_word_embeddings=False, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        pad_token_id=None, bos_token_id=None, eos_token_id=2), **GLM4_MOE_ROUTER, **overrides})
    model = Glm4MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            if name.endswith("_proj.bias"):
                p.normal_(std=0.1)
            if name.endswith("gate.weight"):  # routers decisive enough that fp32 noise flips no top-k
                p.mul_(8.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(std=0.3)
    model.save_pretrained(path)
    return path


def save_tiny_gpt_oss(path: Path, vocab_size: int = 64, **overrides) -> Path:
    """A real HF gpt-oss (gpt_oss) directory of the learner tests' size with every feature that sets it apart drawn so
    that a converter that dropped one would show: 2 layers, sliding (window 4) then full attention (layer_types);
    attention sinks of about +-1 (a fair share of each softmax); biases on q/k/v/o, the router and the experts away
    from 0; 4 experts, top-2, gate/up weights large enough that the SwiGLU clamp (swiglu_limit 2.0 here) cuts some
    of each; YaRN RoPE with truncate false (gpt-oss-20b's); untied lm_head; routers decisive."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(**{**dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=vocab_size, max_position_embeddings=256, intermediate_size=24, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        swiglu_limit=2.0, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": False}),
        **overrides})
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            if name.endswith(("_proj.bias", "router.bias", "_proj_bias")):
                p.normal_(std=0.1)
            if name.endswith("sinks"):
                p.normal_(std=1.0)
            if name.endswith("experts.gate_up_proj"):
                p.normal_(std=0.3)
            if name.endswith("router.weight"):  # routers decisive enough that fp32 noise flips no top-k
                p.mul_(8.0)
    model.save_pretrained(path)
    return path


def save_tiny_gpt_oss_mxfp4(path: Path, vocab_size: int = 64, **overrides) -> Path:
    """save_tiny_gpt_oss (intermediate_size 32: MXFP4 packs groups of 32 along each expert matrix's input) written as
    gpt-oss's hub checkpoints are: every layer's mlp.experts.gate_up_proj and down_proj as MXFP4 `_blocks` / `_scales`
    (megarl.models.mxfp4.quantize), the other tensors as they were, `quantization_config: {quant_method: mxfp4}`."""
    import json

    from safetensors.torch import load_file, save_file

    from megarl.models import mxfp4

    save_tiny_gpt_oss(path, vocab_size, **{"intermediate_size": 32, **overrides})
    weights = load_file(path / "model.safetensors")
    packed = {}
    for name, tensor in weights.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            packed[name + mxfp4.BLOCKS], packed[name + mxfp4.SCALES] = mxfp4.quantize(tensor)
        else:
            packed[name] = tensor
    save_file(packed, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": mxfp4.QUANT_METHOD,
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


# The tiny DeepSeek-V3's YaRN RoPE: a context grown 4x over 16 positions, mscale != mscale_all_dim so that both the
# attention factor on cos / sin (1.07) and the softmax scale's mscale^2 (1.14) differ from 1.
DEEPSEEK_V3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.5}


def save_tiny_deepseek_v3(path: Path, vocab_size: int = 64, **overrides) -> Path:
    """A real HF DeepSeek-V3 (deepseek_v3) directory of the learner tests' size with every feature that sets it apart
    drawn so that a converter that dropped one would show: multi-latent attention with a q latent (q_lora_rank 12;
    q_lora_rank=None: one q_proj) and a kv latent (kv_lora_rank 16), per-head q/k of 8 + 4 (RoPE) dims and v of 6
    (MLA's split head dims), the latent RMSNorms away from 1, interleaved YaRN RoPE (DEEPSEEK_V3_ROPE); GLM-4.5's MoE
    (tests/helpers.GLM4_MOE_ROUTER, a shared expert, e_score_correction_bias, routed_scaling_factor 2.5, the first of 3
    layers dense); untied lm_head."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(**{**dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, vocab_size=vocab_size,
        max_position_embeddings=64, intermediate_size=48, moe_intermediate_size=16, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=12, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True, tie_word_embeddings=False,
        num_nextn_predict_layers=0, rope_parameters=dict(DEEPSEEK_V3_ROPE), pad_token_id=None, bos_token_id=None,
        eos_token_id=2), **GLM4_MOE_ROUTER, **overrides})
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("proj.weight", "lm_head.weight")) or "experts.gate_up" in name or "experts.down" in name:
                # weights of 1 / sqrt(fan in), not transformers' 0.02: scores and logits of order 1, so that the
                # attention factor, the softmax scale or a swapped rope dim move the log-probs well past fp32 noise
                p.normal_(std=p.shape[-1] ** -0.5)
            if "norm" in name:
                p.normal_(1.0, 0.2)
            if name.endswith("gate.weight"):  # routers decisive enough that fp32 noise flips no top-k
                p.mul_(8.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(std=0.3)
    model.save_pretrained(path)
    return path


def train_metrics(run_dir) -> list[dict]:
    """The per-step records of run_dir/metrics.jsonl (evaluation records left out; [] before the file exists)."""
    from megarl.observe.jsonl import read_jsonl
    from megarl.observe.sinks import train_records

    path = Path(run_dir) / "metrics.jsonl"
    return train_records(read_jsonl(path)) if path.exists() else []


def draw_adapter(base: dict, hf_config: dict, lora_cfg, seed: int) -> dict:
    """A random adapter of `lora_cfg` (megarl.models.lora's names) whose update, alpha / r * B @ A, is about half
    each adapted weight's spread in `base`: a version whose tokens tell it from the base at a glance."""
    import torch

    from megarl.models import lora

    gen, adapter = torch.Generator().manual_seed(seed), {}
    for name, shape, _ in lora.adapter_spec(hf_config, lora_cfg):
        adapter[name] = torch.randn(shape, generator=gen)
        if name.endswith("lora_B.weight"):
            a, w = adapter[name.replace("lora_B", "lora_A")], base[name.replace(".lora_B.weight", ".weight")]
            adapter[name] *= 0.5 * w.std() / (lora.scale(lora_cfg) * (adapter[name] @ a).std())
    return adapter


FP32_UNIT_ROUNDOFF = 2.0 ** -24


def fp32_logprob_tol(config: dict, max_logprob: float, max_seq_len: int = 256) -> float:
    """How far two float32 evaluations of the same decoder's log-probs may differ when they differ only in the
    order of their reductions (one prefill vs token-by-token decode, batched vs alone, merged vs unmerged
    adapters, a matmul split over TP ranks), derived from the computation rather than measured.

    A float32 dot product of K terms carries a rounding error of about sqrt(K) units of roundoff u = 2^-24
    relative to its magnitude (the probabilistic bound of Higham & Mary 2019, which holds with overwhelming
    probability for independent roundings; the worst case, K u, is never approached in practice). A token's
    log-prob passes every matmul of every layer on its way (q, k, v, o over hidden; q.k over head_dim; p.v over
    at most max_seq_len positions; gate, up over hidden; down over the MLP width), then the LM head (hidden) and
    the log-sum-exp (vocab); the errors of those stages add, each relative to the log-prob's scale (bounded by
    `max_logprob`, the largest |log-prob| the test sees); two evaluations double it. For the tests' tiny models
    (hidden 64, MLP 128, 2 layers, vocab 32, |log-prob| <= 8) this is ~1.6e-4: ten times what the engines
    are seen to differ by, and an order of magnitude below the 1e-3 gaps that tell two versions apart."""
    hidden, width = config["hidden_size"], config.get("moe_intermediate_size") or config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    per_layer = 6 * hidden ** 0.5 + head_dim ** 0.5 + max_seq_len ** 0.5 + width ** 0.5
    path = config["num_hidden_layers"] * per_layer + hidden ** 0.5 + config["vocab_size"] ** 0.5
    return 2 * FP32_UNIT_ROUNDOFF * path * max_logprob


# |log-prob| <= 8 on the learner tests' tiny models (random weights, vocabularies of 64-264: log 264 = 5.6 plus
# the logits' spread).
LEARNER_TOL = fp32_logprob_tol(LEARNER_TINY, max_logprob=8.0, max_seq_len=64)


def save_tiny_granite(path: Path, vocab_size: int = 264, tokenizer: bool = True, seed: int = 0) -> Path:
    """A real HF Granite directory (a model type megarl has no family row for: the generic path), of the learner
    tests' size, with the embedded tokenizer: GQA, untied lm_head, and Granite's four multipliers (embedding,
    residual, attention, logits) away from 1, so an engine that ran a Llama-like forward instead would show.
    initializer_range 0.1, as tests/sampler's tiny models: next-token distributions with clear winners."""
    import torch
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(seed)
    model = GraniteForCausalLM(GraniteConfig(**{**LEARNER_TINY, "vocab_size": vocab_size}, initializer_range=0.1,
                                             tie_word_embeddings=False, embedding_multiplier=4.0,
                                             residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0))
    model.save_pretrained(path)
    if tokenizer:
        from megarl.embedded.tiny import build_tokenizer

        build_tokenizer().save_pretrained(path)
    return path


# A tiny Qwen3-Next (hybrid: gated-DeltaNet linear attention beside full attention, MoE MLP with a shared expert):
# two linear-attention layers before one full-attention layer, 2 key / 4 value heads in the linear layers.
QWEN3_NEXT_TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                       layer_types=["linear_attention", "linear_attention", "full_attention"],
                       linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                       linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, shared_expert_intermediate_size=16, decoder_sparse_step=1,
                       vocab_size=264)


def save_tiny_qwen3_next(path: Path, vocab_size: int = 264, tokenizer: bool = True, seed: int = 0) -> Path:
    """A real HF Qwen3-Next directory of QWEN3_NEXT_TINY's shape (initializer_range 0.1, as the other tiny models),
    with the embedded tokenizer: the hybrid model of the generic path's tests."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**{**QWEN3_NEXT_TINY, "vocab_size": vocab_size},
                                                 initializer_range=0.1, tie_word_embeddings=False))
    model.save_pretrained(path)
    if tokenizer:
        from megarl.embedded.tiny import build_tokenizer

        build_tokenizer().save_pretrained(path)
    return path


# Nemotron-H: every block a layer of its own (layers_block_type): Mamba-2 mixers (4 heads of 8, SSM state 8 in 2
# groups, conv kernel 4, scan chunks of 8 positions so the tests' prompts cross a chunk), an MoE block (4 routed
# experts of 16, top-2, a shared expert), full attention (no RoPE, as Nemotron-H's) and an MLP block (ReLU^2).
NEMOTRON_H_TINY = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       layers_block_type=["linear_attention", "moe", "linear_attention", "full_attention", "mlp"],
                       mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4,
                       chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       moe_shared_expert_intermediate_size=16, n_group=1, topk_group=1, max_position_embeddings=128,
                       vocab_size=264)


def save_tiny_nemotron_h(path: Path, vocab_size: int = 264, tokenizer: bool = True, seed: int = 0) -> Path:
    """A real HF Nemotron-H directory of NEMOTRON_H_TINY's shape (initializer_range 0.1, as the other tiny models;
    the MoE router's expert bias drawn from N(0, 1), so an engine that dropped it would route otherwise), with the
    embedded tokenizer: the Mamba-2 hybrid of the generic path's tests."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    config = NemotronHConfig(**{**NEMOTRON_H_TINY, "vocab_size": vocab_size}, initializer_range=0.1,
                             tie_word_embeddings=False, bos_token_id=None, eos_token_id=256, pad_token_id=257)
    model = NemotronHForCausalLM(config)
    for name, bias in model.named_buffers():  # the router's expert bias (a buffer) away from 0, as a trained one is
        if name.endswith("e_score_correction_bias"):
            bias.copy_(torch.randn(bias.shape))
    model.save_pretrained(path)
    if tokenizer:
        from megarl.embedded.tiny import build_tokenizer

        build_tokenizer().save_pretrained(path)
    return path


def signed_loopback_store(key: bytes, timeout_s: float = 30.0):
    """A SignedStore keyed with `key` over a fresh TCPStore server on 127.0.0.1 (a free port): the store a run's
    roles share, for tests that drive them in one process."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from megarl.distributed.signed_store import SignedStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return SignedStore(dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=timeout_s)), key)
