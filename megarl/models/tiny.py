"""The embedded default model: a tiny Qwen2 and its tokenizer, created locally and warm-started.

Nothing can be downloaded on the machines megarl must run on, so the default model is built here,
once per machine, into an ordinary HF-format directory (config.json, model.safetensors,
generation_config.json, tokenizer files) that every other component loads like any hub model.

* Tokenizer: byte-level BPE with no merges (one token per byte, id == byte value for 0..255) plus
  special tokens, exactly the pipeline transformers' Qwen2Tokenizer applies. transformers 5 loads the
  tokenizer of any `model_type: qwen2` directory as Qwen2Tokenizer and rebuilds its pre-tokenizer as
  byte-level, so any other design would encode differently depending on who loads it; this one is
  identical under every loader (and never drops a character). 264 ids = a multiple of 8, so
  tensor-parallel sizes 2/4/8 divide the vocabulary.
* Model: Qwen2 (GQA, RMSNorm, RoPE, SwiGLU, tied embeddings), 64 hidden, 2 layers, ~116k params.
* Warm start: a short supervised run on the built-in arithmetic task so the *base* model knows the
  output format (digits then EOS) and roughly where the answer is, but is right only ~20% of the
  time when sampled at T=1: RL then has real headroom (see docs/embedded_model.md).
* Three registered models: "tiny-qwen2-count" (the demo's: "d-k=" -> "defghijk<eos>", the
  alphabet run the prompt names, long-tailed lengths set by the prompt; run it with
  max_new_tokens=COUNT_MAX_NEW_TOKENS=49 and `build_task("count")`), "tiny-qwen2-arith"
  ("12+7=" -> "19<eos>", ~3-token completions) and "tiny-qwen2-arith-think" ("12+7=" ->
  "..........19<eos>": a geometric run of "." thinking filler with mean 10, then the answer; run
  it with max_new_tokens=THINK_MAX_NEW_TOKENS=48 and `build_task("arithmetic", think_mean=10)`).

`ensure_embedded_model` builds atomically under a file lock; `resolve_model_path` turns a config's
model path ("embedded:<name>" or a directory) into a checked directory.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from megarl.filelock import exclusive
from megarl.protocols import Prompt
from megarl.rollout.tasks import THINK_CHAR, ArithmeticTask, CountTask, ToolArithmeticTask

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
    (the chat model, megarl/models/tiny_chat.py): same ids, same vocabulary size."""
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


# ---------------------------------------------------------------------------------------------
# Supervised warm start
# ---------------------------------------------------------------------------------------------

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


def _near_miss(answer: int, lo: int, hi: int, max_offset: int, rng: random.Random) -> int:
    offset = rng.choice([d for d in range(-max_offset, max_offset + 1) if d != 0])
    # Reflect into the task's answer range so a miss is always a plausible result (never "-1" for 0+0).
    return answer + offset if lo <= answer + offset <= hi else answer - offset


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _batch(tokenizer, prompts: list[Prompt], answers: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt+answer+EOS ids and a mask over the completion tokens (answer and EOS).

    Right padding needs no attention mask: causal attention never lets a real token see the pads."""
    seqs, starts = [], []
    for prompt, answer in zip(prompts, answers):
        ids = _encode(tokenizer, prompt.text)
        starts.append(len(ids))
        seqs.append(ids + _encode(tokenizer, answer) + [EOS_ID])
    width = max(map(len, seqs))
    input_ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros(len(seqs), width)
    for i, (seq, start) in enumerate(zip(seqs, starts)):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, start: len(seq)] = 1.0
    return input_ids, mask


def _sequence_nll(model, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence negative log-likelihood of the masked tokens, [B]."""
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), input_ids[:, 1:].reshape(-1), reduction="none")
    return (nll.view(input_ids.size(0), -1) * mask[:, 1:]).sum(1)


def _arithmetic_targets(task: ArithmeticTask, recipe: WarmStartRecipe):
    """draw(step, rng, noisy) -> (prompts, correct completions, near misses or None) for arithmetic."""
    prompts = task.all_prompts()
    lo, hi = task.answer_range()
    short_task = dataclasses.replace(task, think_mean=min(task.think_mean, recipe.short_think_mean))

    def draw(step: int, rng: random.Random, noisy: bool):
        batch = [rng.choice(prompts) for _ in range(recipe.batch_prompts)]
        # Filler run of each target (empty unless the task thinks; then no rng draw is made, so a
        # non-thinking build is unchanged). A correct answer and its near miss share their filler.
        src = short_task if step < recipe.short_steps else task
        think = [THINK_CHAR * src.sample_think_length(rng, recipe.max_think) for _ in batch]
        misses = ([t + str(_near_miss(int(p.answer), lo, hi, recipe.max_offset, rng)) for t, p in zip(think, batch)]
                  if noisy else None)
        return batch, [t + p.answer for t, p in zip(think, batch)], misses

    return draw


def _count_targets(task: CountTask, recipe: WarmStartRecipe):
    """draw(step, rng, noisy) for CountTask: prompts as RL draws them, misses stopped off the end letter."""

    def draw(step: int, rng: random.Random, noisy: bool):
        batch = task.sample_prompts(rng, recipe.batch_prompts)
        misses = [task.near_miss(p, rng, recipe.max_offset) for p in batch] if noisy else None
        return batch, [p.answer for p in batch], misses

    return draw


def warm_start(model, tokenizer, task: ArithmeticTask | CountTask, recipe: WarmStartRecipe, on_step=None) -> None:
    """Train `model` in place (fp32, CPU) with the recipe; deterministic given recipe.seed.
    `on_step(step, model)`, if given, is called after every step (for learning-curve experiments)."""
    draw = _count_targets(task, recipe) if isinstance(task, CountTask) else _arithmetic_targets(task, recipe)

    def make_batch(step: int, rng: random.Random):
        batch, answers, misses = draw(step, rng, noisy=step >= recipe.clean_steps)
        if misses is None:
            weights = torch.ones(len(batch))
        else:
            answers, batch = answers + misses, batch + batch
            n = len(misses)
            weights = torch.cat([torch.full((n,), recipe.p_correct), torch.full((n,), 1.0 - recipe.p_correct)])
        return (*_batch(tokenizer, batch, answers), weights)

    train_supervised(model, recipe, make_batch, on_step)


def train_supervised(model, recipe: WarmStartRecipe, make_batch, on_step=None) -> None:
    """The warm start's optimisation: AdamW with warm-up over the clean phase and a decaying, scaled-down
    rate over the noisy one; make_batch(step, rng) -> (input_ids, loss mask, per-sequence weights)."""
    rng = random.Random(recipe.seed)
    total = recipe.clean_steps + recipe.noisy_steps
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=0.0)

    def lr_factor(step: int) -> float:
        if step < recipe.clean_steps:
            return min(1.0, (step + 1) / recipe.warmup_steps)
        return recipe.noisy_lr_scale * (1.0 - (step - recipe.clean_steps) / max(1, recipe.noisy_steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()
    for step in range(total):
        input_ids, mask, weights = make_batch(step, rng)
        loss = (_sequence_nll(model, input_ids, mask) * weights).sum() / weights.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if on_step is not None:
            on_step(step, model)
    model.eval()


# ---------------------------------------------------------------------------------------------
# Evaluation (used for the build record and by tests; the RL sampler is megarl/sampler)
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def expected_accuracy(model, tokenizer, prompts: list[Prompt], max_new_tokens: int | None = None) -> float:
    """Mean probability of sampling a correct completion at T=1: the sampled accuracy without sampling noise.

    max_new_tokens=None: P(answer+EOS). Otherwise the probability that T=1 sampling capped at
    max_new_tokens ends in a reward-1 completion: the sum over k of P(k filler tokens, answer, EOS)
    for every k that fits (exact: those completions are disjoint events). Computed with one forward
    pass over prompt+filler per prompt group and a KV cache cropped to each k for the answer."""
    if max_new_tokens is None:
        input_ids, mask = _batch(tokenizer, prompts, [p.answer for p in prompts])
        return torch.exp(-_sequence_nll(model, input_ids, mask)).mean().item()
    import copy

    think_id = _encode(tokenizer, THINK_CHAR)[0]
    groups: dict[tuple[int, int], list[int]] = {}
    encoded = [(_encode(tokenizer, p.text), _encode(tokenizer, p.answer) + [EOS_ID]) for p in prompts]
    for i, (prompt_ids, answer_ids) in enumerate(encoded):
        groups.setdefault((len(prompt_ids), len(answer_ids)), []).append(i)
    per_prompt = torch.zeros(len(prompts))
    for (plen, alen), idx in groups.items():
        max_think = max_new_tokens - alen
        if max_think < 0:
            continue
        prompt_ids = torch.tensor([encoded[i][0] for i in idx])
        answer_ids = torch.tensor([encoded[i][1] for i in idx])
        ids = torch.cat([prompt_ids, torch.full((len(idx), max_think), think_id)], 1)
        out = model(input_ids=ids, use_cache=True)
        prefix_cache = out.cache
        logp = torch.log_softmax(out.logits.float(), -1)  # [B, plen + max_think, V]
        # think_logp[:, k] = log P(k filler tokens first); first_logp[:, k] = log P(answer[0] | k fillers).
        dot = logp[:, plen - 1: plen - 1 + max_think, think_id]
        think_logp = torch.cat([torch.zeros(len(idx), 1), dot.cumsum(1)], 1)
        first_logp = logp[:, plen - 1: plen + max_think].gather(2, answer_ids[:, :1, None].expand(-1, max_think + 1, 1))[..., 0]
        total = []
        for k in range(max_think + 1):
            if alen > 1:
                cache = copy.deepcopy(prefix_cache)
                cache.crop(k - max_think)  # keep the prompt and k fillers (transformers 5: minus tokens to drop)
                rest = torch.log_softmax(model(input_ids=answer_ids[:, :-1], cache=cache, use_cache=True).logits.float(), -1)
                rest_logp = rest.gather(2, answer_ids[:, 1:, None])[..., 0].sum(1)
            else:
                rest_logp = torch.zeros(len(idx))
            total.append(think_logp[:, k] + first_logp[:, k] + rest_logp)
        per_prompt[idx] = torch.logsumexp(torch.stack(total, 1), 1).exp()
    return per_prompt.mean().item()


@torch.no_grad()
def generate_tokens(model, tokenizer, prompts: list[Prompt], temperature: float, seed: int = 0,
                    max_new_tokens: int = 4, banned: int | None = None) -> list[list[int]]:
    """Completion token ids (EOS included when emitted; a list of max_new_tokens ids without EOS was
    cut at the cap), greedy when temperature == 0; token id `banned` is never emitted. Small and
    exact, not fast."""
    gen = torch.Generator().manual_seed(seed)
    out: list[list[int]] = [[] for _ in prompts]
    by_len: dict[int, list[int]] = {}
    encoded = [_encode(tokenizer, p.text) for p in prompts]
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    # Equal-length prompts batch without padding; a KV cache carries the prefix between steps.
    for idx in by_len.values():
        step_ids, cache = torch.tensor([encoded[i] for i in idx]), None
        done = torch.zeros(len(idx), dtype=torch.bool)
        new = []
        for _ in range(max_new_tokens):
            res = model(input_ids=step_ids, cache=cache, use_cache=True)
            logits, cache = res.logits[:, -1].float(), res.cache
            if banned is not None:
                logits[:, banned] = float("-inf")
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]
            nxt = torch.where(done, torch.full_like(nxt, EOS_ID), nxt)
            new.append(nxt)
            done |= nxt == EOS_ID
            step_ids = nxt[:, None]
            if done.all():
                break
        tokens = torch.stack(new, 1).tolist()
        for row, i in enumerate(idx):
            out[i] = tokens[row][: tokens[row].index(EOS_ID) + 1] if EOS_ID in tokens[row] else tokens[row]
    return out


def generate(model, tokenizer, prompts: list[Prompt], temperature: float, seed: int = 0,
             max_new_tokens: int = 4) -> list[str]:
    """Completion texts (EOS not included), greedy when temperature == 0."""
    return [tokenizer.decode([t for t in ids if t != EOS_ID])
            for ids in generate_tokens(model, tokenizer, prompts, temperature, seed, max_new_tokens)]


def greedy_answer_accuracy(model, tokenizer, task: ArithmeticTask, prompts: list[Prompt],
                           think_len: int) -> float:
    """Exact-match accuracy of the greedy answer after a forced run of `think_len` filler tokens
    (prompt + "." * think_len, then greedy with the filler banned).

    This is the thinking model's "greedy accuracy": plain greedy decoding of a geometric thinking
    segment never stops thinking (continuing is always the likelier token), so it measures
    whether the mode of the *answer* is right -- and, over several think_len, whether the model
    still finds the prompt across a long filler run."""
    forced = [Prompt(p.text + THINK_CHAR * think_len, p.answer, p.meta) for p in prompts]
    think_id = _encode(tokenizer, THINK_CHAR)[0]
    answers = generate_tokens(model, tokenizer, forced, temperature=0.0, max_new_tokens=4, banned=think_id)
    return sum(task.reward(p, tokenizer.decode([t for t in ids if t != EOS_ID]))
               for p, ids in zip(prompts, answers)) / len(prompts)


def length_stats(token_lists: list[list[int]], max_new_tokens: int) -> dict:
    """Summary of completion lengths in tokens (EOS included) from `generate_tokens`."""
    lengths = [len(t) for t in token_lists]
    t = torch.tensor(lengths, dtype=torch.float)
    q = lambda f: round(torch.quantile(t, f).item(), 1)  # noqa: E731
    return {"mean": round(t.mean().item(), 2), "median": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": max(lengths),
            "frac_at_cap": round(sum(n >= max_new_tokens and EOS_ID not in ids for n, ids in zip(lengths, token_lists))
                                 / len(lengths), 4)}


# ---------------------------------------------------------------------------------------------
# The registry and the on-disk cache
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EmbeddedSpec:
    task: ArithmeticTask | CountTask | ToolArithmeticTask
    recipe: WarmStartRecipe
    # Completion-token budget the build's evaluation samples with (EOS included), like a sampler's
    # max_new_tokens; for the thinking model some T=1 completions are cut here while still thinking.
    max_new_tokens: int = 4
    # build_config overrides as (key, value) pairs; () = the default tiny config (and its hash).
    config: tuple = ()
    # The Mixtral-style mixture-of-experts variant (megarl/models/tiny_moe.py) instead of the dense Qwen2.
    moe: bool = False

    def model_config(self):
        """The HF config this spec builds (the MoE one from tiny_moe, else build_config)."""
        if self.moe:
            from megarl.models.tiny_moe import build_moe_config

            return build_moe_config(VOCAB_SIZE, EOS_ID, PAD_ID, **dict(self.config))
        return build_config(**dict(self.config))


# vLLM's CPU attention needs head_dim >= 32; the default config has 64 / 4 = 16. These variants have
# 2 query heads and 1 KV head of 32 (still GQA, same hidden size and parameter count).
HEAD_DIM_32 = (("num_attention_heads", 2), ("num_key_value_heads", 1))
# sampler.engine=vllm swaps an embedded model for its head_dim >= 32 variant (megarl.config.load).
VLLM_VARIANTS = {"tiny-qwen2-count": "tiny-qwen2-count-hd32", "tiny-qwen2-tool": "tiny-qwen2-tool-hd32"}


# Completion budget to run the thinking model with (filler + answer + EOS); ~1-2% of T=1 samples hit it.
THINK_MAX_NEW_TOKENS = 48
# Forced filler lengths the thinking model's greedy answer is evaluated after (see greedy_answer_accuracy).
GREEDY_THINK_LENS = (0, 10, 25, 40)

# Completion budget to run the count model with: the longest run (48 letters) + EOS.
COUNT_MAX_NEW_TOKENS = 49
# Prompts the count model is evaluated on in its build: drawn like RL draws them (seed fixed).
COUNT_EVAL_PROMPTS = 400

EMBEDDED_MODELS: dict[str, EmbeddedSpec] = {
    "tiny-qwen2-count": EmbeddedSpec(task=CountTask(), recipe=WarmStartRecipe(clean_steps=300, noisy_steps=150),
                                     max_new_tokens=COUNT_MAX_NEW_TOKENS),
    # The demo's model for sampler.engine=vllm (head_dim 32, see HEAD_DIM_32), same task and recipe.
    "tiny-qwen2-count-hd32": EmbeddedSpec(task=CountTask(), recipe=WarmStartRecipe(clean_steps=300, noisy_steps=150),
                                          max_new_tokens=COUNT_MAX_NEW_TOKENS, config=HEAD_DIM_32),
    "tiny-qwen2-arith": EmbeddedSpec(task=ArithmeticTask(), recipe=WarmStartRecipe()),
    # The mixture-of-experts demo's model (configs/moe.yaml, docs/moe.md): a tiny Mixtral, same task and recipe.
    "tiny-mixtral-count": EmbeddedSpec(task=CountTask(), recipe=WarmStartRecipe(clean_steps=300, noisy_steps=150),
                                       max_new_tokens=COUNT_MAX_NEW_TOKENS, moe=True),
    # The multi-turn demo's chat model (megarl/models/tiny_chat.py): tool calls, episodes of ~75 tokens.
    "tiny-qwen2-tool": EmbeddedSpec(task=ToolArithmeticTask(), recipe=WarmStartRecipe(clean_steps=500, noisy_steps=150),
                                    max_new_tokens=16, config=(("max_position_embeddings", 256),)),
    "tiny-qwen2-tool-hd32": EmbeddedSpec(task=ToolArithmeticTask(), recipe=WarmStartRecipe(clean_steps=500, noisy_steps=150),
                                         max_new_tokens=16, config=(("max_position_embeddings", 256),) + HEAD_DIM_32),
    "tiny-qwen2-arith-think": EmbeddedSpec(task=ArithmeticTask(think_mean=10.0),
                                           recipe=WarmStartRecipe(short_steps=400, noisy_steps=120),
                                           max_new_tokens=THINK_MAX_NEW_TOKENS),
}


def _spec_hash(spec: EmbeddedSpec) -> str:
    # The directory name carries a hash of everything that shapes the model (and the transformers
    # major version, which owns the file format), so changing the recipe builds a new directory
    # instead of silently reusing a stale one.
    import transformers

    config = spec.model_config().to_dict()
    blob = json.dumps({"task": asdict(spec.task), "recipe": asdict(spec.recipe), "config": config,
                       "max_new_tokens": spec.max_new_tokens,
                       "transformers_major": transformers.__version__.split(".")[0]}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def build_embedded_model(name: str, out_dir: str | Path) -> dict:
    """Create, warm-start, evaluate and save the named model into out_dir; returns the build record."""
    from transformers import GenerationConfig, MixtralForCausalLM, Qwen2ForCausalLM

    spec = EMBEDDED_MODELS[name]
    out_dir = Path(out_dir)
    if isinstance(spec.task, ToolArithmeticTask):
        return _build_tool_model(name, spec, out_dir)
    t0 = time.perf_counter()
    tokenizer = build_tokenizer()
    # fork_rng: building must not disturb the caller's global torch RNG stream. One thread: a model
    # this small gains nothing from more, and a fixed thread count makes the build bit-reproducible
    # on machines with different core counts (reduction order depends on it).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.recipe.seed)
            model = (MixtralForCausalLM if spec.moe else Qwen2ForCausalLM)(spec.model_config())
            warm_start(model, tokenizer, spec.task, spec.recipe)
        train_s = time.perf_counter() - t0
        if isinstance(spec.task, CountTask):
            prompts = spec.task.sample_prompts(random.Random(1), COUNT_EVAL_PROMPTS)
        else:
            prompts = spec.task.all_prompts()
        if isinstance(spec.task, ArithmeticTask) and spec.task.think_mean > 0:
            greedy_by_len = {k: greedy_answer_accuracy(model, tokenizer, spec.task, prompts, k) for k in GREEDY_THINK_LENS}
            greedy_acc = greedy_by_len[min(GREEDY_THINK_LENS, key=lambda k: abs(k - spec.task.think_mean))]
        else:
            greedy = generate(model, tokenizer, prompts, temperature=0.0, max_new_tokens=spec.max_new_tokens)
            greedy_acc, greedy_by_len = sum(spec.task.reward(p, c) for p, c in zip(prompts, greedy)) / len(prompts), None
        sampled_ids = generate_tokens(model, tokenizer, prompts, temperature=1.0, seed=0, max_new_tokens=spec.max_new_tokens)
        sampled = [tokenizer.decode([t for t in ids if t != EOS_ID]) for ids in sampled_ids]
        # A count completion has no filler: P(reward 1) is P(run + EOS), one teacher-forced pass.
        expected = expected_accuracy(model, tokenizer, prompts,
                                     None if isinstance(spec.task, CountTask) else spec.max_new_tokens)
    finally:
        torch.set_num_threads(threads)
    record = {
        "name": name,
        "task": asdict(spec.task),
        "recipe": asdict(spec.recipe),
        "warm_start_seconds": round(train_s, 1),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        # Over every distinct prompt of the task: exact P(reward 1) at T=1 within max_new_tokens
        # (P(answer+EOS) for the non-thinking model), and greedy exact match -- for the thinking
        # model, of the greedy answer after a forced filler run of the length nearest think_mean,
        # and by forced length (plain greedy never stops thinking).
        "max_new_tokens": spec.max_new_tokens,
        "expected_sampled_accuracy": round(expected, 4),
        "greedy_accuracy": round(greedy_acc, 4),
        # One T=1 sample per prompt (seed 0): its accuracy and completion lengths in tokens, EOS included.
        "sampled_accuracy": round(sum(spec.task.reward(p, c) for p, c in zip(prompts, sampled)) / len(prompts), 4),
        "sampled_lengths": length_stats(sampled_ids, spec.max_new_tokens),
        "eval_seconds": round(time.perf_counter() - t0 - train_s, 1),
    }
    if greedy_by_len is not None:
        record["greedy_answer_accuracy_by_think_len"] = {str(k): round(v, 4) for k, v in greedy_by_len.items()}
    model.generation_config = GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=None)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / BUILD_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def _build_tool_model(name: str, spec: EmbeddedSpec, out_dir: Path) -> dict:
    from megarl.models.tiny_chat import build_tool_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as build_embedded_model: bit-reproducible whatever the core count
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.recipe.seed)
            fields = build_tool_model(spec, out_dir)
    finally:
        torch.set_num_threads(threads)
    record = {"name": name, "task": asdict(spec.task), "recipe": asdict(spec.recipe), **fields,
              # The accuracy of sampled episodes (the tool runs in them); greedy is not measured.
              "expected_sampled_accuracy": fields["sampled_accuracy"]}
    (out_dir / BUILD_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def ensure_embedded_model(name: str = "tiny-qwen2-arith", cache_dir: str | Path = "~/.cache/megarl/models") -> Path:
    """The directory of the named embedded model, building it on first use.

    Safe under concurrency (every rank of a launch may call it): the build runs under an exclusive
    fcntl lock, in a temporary directory next to the final one, and is published with one atomic
    os.rename; so the final directory, when it exists, is always complete."""
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED_MODELS)}")
    cache_dir = Path(cache_dir).expanduser()
    final = cache_dir / f"{name}-{_spec_hash(EMBEDDED_MODELS[name])}"
    if final.is_dir():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    with exclusive(cache_dir / f".{final.name}.lock"):
        if final.is_dir():  # another process built it while we waited for the lock
            return final
        # Leftovers of a crashed build: nobody else can be building, we hold the lock.
        for stale in cache_dir.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
        try:
            print(f"megarl: building embedded model {name} (once per machine, about a minute on one CPU core)...",
                  file=sys.stderr, flush=True)
            record = build_embedded_model(name, tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    greedy = f", greedy {record['greedy_accuracy']:.2f}" if "greedy_accuracy" in record else ""
    print(f"megarl: built {name} -> {final} in {record['warm_start_seconds']}s "
          f"({record['num_parameters']} params; base accuracy: sampled T=1 {record['expected_sampled_accuracy']:.2f}{greedy})",
          file=sys.stderr, flush=True)
    return final


def resolve_model_path(path: str, cache_dir: str | Path = "~/.cache/megarl/models") -> Path:
    """"embedded:<name>" -> the built embedded model; anything else must be an HF-format model directory."""
    if path.startswith("embedded:"):
        return ensure_embedded_model(path.split(":", 1)[1], cache_dir)
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"model path {str(directory)!r} is not a directory (expected an HF-format model "
                                f"directory with config.json, or 'embedded:<name>' with name in {sorted(EMBEDDED_MODELS)})")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(directory)!r} has no config.json; it is not an HF-format "
                                f"model directory")
    return directory
