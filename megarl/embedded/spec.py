"""What an embedded model is made of, without torch: its vocabulary and tokenizer, its HF config builders and its
warm-start recipe.

megarl.embedded.registry names every embedded model by these and resolves a built one to its directory; every rank
and `megarl train`'s checks do that at start, so this module and the registry import neither torch nor transformers
(transformers only inside the builders, when a model is built or its hash first computed). megarl/embedded/tiny.py
holds the torch part (warm start, evaluation) and re-exports these names.
"""
from __future__ import annotations

from dataclasses import dataclass

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# Spare specials reserved for later use (e.g. chat markers) that also round the vocab up to 264.
_SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN] + [f"<|reserved_{i}|>" for i in range(6)]
VOCAB_SIZE = 256 + len(_SPECIAL_TOKENS)
EOS_ID, PAD_ID = 256, 257

BUILD_RECORD = "megarl_embedded.json"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer(chat_markers: tuple[str, str] | None = None):
    """A `PreTrainedTokenizerFast`: one token per byte, no special tokens added on encode. With
    chat_markers (start, end) the first two reserved specials carry those names and `end` is the EOS
    (the chat model, megarl/embedded/tiny_chat.py): same ids, same vocabulary size."""
    specials = list(_SPECIAL_TOKENS)
    if chat_markers is not None:
        specials[2:4] = chat_markers
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    vocab.update({tok: 256 + i for i, tok in enumerate(specials)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    # Same normalizer / pre-tokenizer / decoder as transformers' Qwen2Tokenizer (see module docstring).
    tok.normalizer = normalizers.NFC()
    qwen2_split = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                   r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(qwen2_split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN if chat_markers is None else chat_markers[1], pad_token=PAD_TOKEN,
        model_max_length=128, additional_special_tokens=specials[2:],
    )


def build_config(**overrides):
    """The tiny Qwen2 config; `overrides` replace keys (an EmbeddedSpec's `config`, e.g. fewer, wider heads)."""
    from transformers import Qwen2Config

    kwargs = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, max_window_layers=2,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID, torch_dtype="float32",
    )
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def build_qwen3_config(**overrides):
    """The tiny config as a dense Qwen3 (no q/k/v bias, per-head q/k RMSNorm; head_dim given, as Qwen3's config
    needs it): the same sizes as build_config's."""
    from transformers import Qwen3Config

    qwen2 = build_config(**overrides).to_dict()
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "max_window_layers", "rms_norm_eps", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id")
    kwargs = {k: qwen2[k] for k in keys}
    return Qwen3Config(**kwargs, head_dim=kwargs["hidden_size"] // kwargs["num_attention_heads"],
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dtype="float32")


def build_qwen3_5_config(**overrides):
    """The tiny config as a Qwen3.5 text model (`qwen3_5_text`, a hybrid): the same sizes as build_config's, its
    first layer gated DeltaNet linear attention (conv kernel 4; 2 key and 4 value heads of 16, so the value
    projection is as wide as the hidden size), its second full attention (4 query and 2 KV heads of 16, RoPE on a
    quarter of each head as Qwen3.5's config has it, gated output). Overrides replace keys of either."""
    from transformers import Qwen3_5TextConfig

    qwen2 = build_config(**{k: v for k, v in overrides.items() if k in build_config().to_dict()}).to_dict()
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "bos_token_id",
            "eos_token_id", "pad_token_id")
    head_dim = qwen2["hidden_size"] // qwen2["num_attention_heads"]
    kwargs = {k: qwen2[k] for k in keys}
    kwargs.update(head_dim=head_dim, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                  linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_num_key_heads=2,
                  linear_num_value_heads=4, dtype="float32")
    kwargs.update({k: v for k, v in overrides.items() if k not in keys})
    return Qwen3_5TextConfig(**kwargs)


@dataclass(frozen=True)
class WarmStartRecipe:
    """Two phases. 1) `clean_steps` on correct answers: learn the task (fast, low-variance signal).
    2) `noisy_steps` on a label mixture: each prompt is trained on its correct answer with weight
    `p_correct` and on a near miss (answer +-1..3) with weight 1 - p_correct, so the base policy
    ends up putting a minority of its mass on the exact answer and the rest on plausible misses.
    Both completions of a prompt are in the same batch (stratified), which is far less noisy than
    drawing one label per prompt. For CountTask the near miss is the run stopped 1..max_offset
    letters early or late, and prompts are drawn from the task's own long-tailed distribution."""

    seed: int = 0
    clean_steps: int = 550
    noisy_steps: int = 250
    batch_prompts: int = 64
    lr: float = 3e-3
    noisy_lr_scale: float = 0.3  # phase 2 starts at lr * this and decays linearly to 0
    warmup_steps: int = 30
    p_correct: float = 0.3
    max_offset: int = 3
    # Thinking tasks (task.think_mean > 0): longest filler run in a training target. Longer geometric
    # draws are redrawn, so the model sees a constant stop rate up to here; keeps batches narrow.
    max_think: int = 44
    # Thinking tasks: the first `short_steps` of the clean phase draw filler runs with mean
    # `short_think_mean` instead of task.think_mean (short, cheap sequences on which the arithmetic
    # and finding the prompt across a variable gap are learnt fast); the full length after that.
    short_steps: int = 0
    short_think_mean: float = 2.0
