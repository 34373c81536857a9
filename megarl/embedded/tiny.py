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
this module is the part every builder shares (tiny_chat.py and tiny_moe.py build on it, never the reverse), its
torch-free names (vocabulary, config builders, WarmStartRecipe) defined in megarl/embedded/spec.py.
"""
from __future__ import annotations

import dataclasses
import random

import torch
import torch.nn.functional as F

from megarl.embedded.spec import (  # noqa: F401 - re-exported: the builders' shared names
    BUILD_RECORD, EOS_ID, EOS_TOKEN, PAD_ID, PAD_TOKEN, VOCAB_SIZE, WarmStartRecipe, build_config, build_qwen3_config,
    build_tokenizer)
from megarl.protocols import Prompt
from megarl.rollout.lap_count import LapCountTask
from megarl.rollout.tasks import THINK_CHAR, ArithmeticTask, CountTask

# ---------------------------------------------------------------------------------------------
# Supervised warm start
# ---------------------------------------------------------------------------------------------

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


def _count_targets(task: CountTask | LapCountTask, recipe: WarmStartRecipe):
    """draw(step, rng, noisy) for CountTask and LapCountTask: prompts as RL draws them, misses stopped off the
    end letter."""

    def draw(step: int, rng: random.Random, noisy: bool):
        batch = task.sample_prompts(rng, recipe.batch_prompts)
        misses = [task.near_miss(p, rng, recipe.max_offset) for p in batch] if noisy else None
        return batch, [p.answer for p in batch], misses

    return draw


def warm_start(model, tokenizer, task: ArithmeticTask | CountTask | LapCountTask, recipe: WarmStartRecipe,
               on_step=None) -> None:
    """Train `model` in place (fp32, CPU) with the recipe; deterministic given recipe.seed.
    `on_step(step, model)`, if given, is called after every step (for learning-curve experiments)."""
    counting = isinstance(task, (CountTask, LapCountTask))
    draw = _count_targets(task, recipe) if counting else _arithmetic_targets(task, recipe)

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
