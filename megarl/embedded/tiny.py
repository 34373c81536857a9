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

The registry of the embedded models, their builds and the on-disk cache live in megarl/embedded/registry.py;
this module is the part every builder shares (tiny_chat.py and tiny_moe.py build on it, never the reverse).
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megarl.protocols import Prompt
from megarl.rollout.tasks import THINK_CHAR, ArithmeticTask, CountTask

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
