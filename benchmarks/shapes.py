"""The model shapes benchmarks/vs_trl.py compares at: "demo" (the embedded demo model, trained to a reward target)
and "qwen3-0.6b" (random weights at Qwen3-0.6B's shape, built locally: throughput and time split only).

The real-shape model is transformers' Qwen3Config at Qwen3-0.6B's sizes (hidden 1024, 28 layers, 16 query / 8
key-value heads of 128, intermediate 3072, tied embeddings) with the vocabulary of megarl's local byte tokenizer
(megarl/embedded/spec.py: nothing is fetched from a hub), initialised with seed 0 and saved with save_pretrained
into the model cache (`ensure_shape_model`; once per machine, under a file lock, renamed into place when whole).
Random weights never reach a reward threshold, so at this shape the comparison is trained tokens per second, the
step time split and peak memory, over a fixed number of steps.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

# Qwen3-0.6B's transformer sizes (its config.json); the vocabulary is the local tokenizer's.
QWEN3_06B = {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128, "intermediate_size": 3072, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": True}
SHAPES = ("demo", "qwen3-0.6b")
SIZES = {"qwen3-0.6b": QWEN3_06B}  # the built shapes: their transformer sizes
# What the real shape changes in the demo config, so a step fits a loaded 2-core CPU: 2 prompts x 4 samples of at
# most 8 new tokens per step, one micro-batch, publish buckets sized for 1.8 GB of weights.
SHAPE_OVERRIDES = {"qwen3-0.6b": ("algo.prompts_per_step=2", "algo.group_size=4", "sampling.max_new_tokens=8",
                                  "learner.micro_batch_size=8", "sampler.max_running=8", "publish.bucket_mb=64")}
DEFAULT_STEPS = {"demo": 200, "qwen3-0.6b": 3}


def qwen3_config(sizes: dict = QWEN3_06B):
    """The HF Qwen3Config at `sizes` with the local tokenizer's vocabulary and special ids, float32."""
    from transformers import Qwen3Config

    from megarl.embedded.spec import EOS_ID, PAD_ID, VOCAB_SIZE

    return Qwen3Config(vocab_size=VOCAB_SIZE, bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, dtype="float32", **sizes)


def parameter_count(sizes: dict = QWEN3_06B) -> int:
    """Parameters of the Qwen3 model at `sizes` with the local vocabulary (tied embeddings counted once)."""
    from megarl.embedded.spec import VOCAB_SIZE

    h, d, layers = sizes["hidden_size"], sizes["head_dim"], sizes["num_hidden_layers"]
    q, kv = sizes["num_attention_heads"] * d, sizes["num_key_value_heads"] * d
    attention = h * q + 2 * h * kv + q * h + 2 * d  # q, k, v, o projections; q and k norms
    mlp = 3 * h * sizes["intermediate_size"]
    embeddings = VOCAB_SIZE * h * (1 if sizes["tie_word_embeddings"] else 2)
    return layers * (attention + mlp + 2 * h) + embeddings + h


def shape_dir(shape: str, cache_dir: str | Path = "~/.cache/megarl/models") -> Path:
    """Where the model of `shape` lives: named by a hash of its config, so a changed shape is a new directory."""
    digest = hashlib.sha256(json.dumps(qwen3_config(SIZES[shape]).to_dict(), sort_keys=True, default=str).encode()).hexdigest()
    return Path(cache_dir).expanduser() / f"shape-{shape}-{digest[:10]}"


def ensure_shape_model(shape: str, cache_dir: str | Path = "~/.cache/megarl/models") -> Path:
    """The HF directory of `shape` (not "demo"), built with random weights (seed 0) if it is not there yet."""
    if shape not in SIZES:
        raise ValueError(f"--shape {shape!r} has no built model; choose one of {sorted(SIZES)}")
    from megarl.filelock import exclusive

    out = shape_dir(shape, cache_dir)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(out.parent / f".{out.name}.lock"):
        if (out / "config.json").is_file():
            return out
        import torch
        from transformers import AutoModelForCausalLM

        from megarl.embedded.spec import build_tokenizer

        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(qwen3_config(SIZES[shape]), dtype=torch.float32)
        model.save_pretrained(partial)
        build_tokenizer().save_pretrained(partial)
        partial.rename(out)
    return out
