"""The embedded models: their registry, their builds and the on-disk cache.

`EMBEDDED_MODELS` names every model megarl can build locally (docs/embedded_model.md): the dense Qwen2 and
Qwen3 ones and the hybrid Qwen3.5 one are built by megarl/embedded/tiny.py's warm start, the tool model by tiny_chat.py, the
mixture-of-experts ones (Mixtral, Qwen3-MoE) with tiny_moe.py's configs. `ensure_embedded_model` builds
atomically under a file lock; `resolve_model_path` turns a config's model path ("embedded:<name>" or a directory)
into a checked directory.
This module sits above the builders (it imports them; they never import it), so there is no import circle. It
imports torch and the builders only to build: resolving a built model (every rank and `megarl train`'s checks do
it at start) needs neither.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megarl.embedded.builder_fingerprint import builder_fingerprint
from megarl.embedded.spec import (BUILD_RECORD, EOS_ID, PAD_ID, VOCAB_SIZE, WarmStartRecipe, build_config,
                                  build_qwen3_5_config, build_qwen3_config, build_tokenizer)
from megarl.filelock import exclusive
from megarl.rollout.lap_count import LapCountTask
from megarl.rollout.tasks import ArithmeticTask, CountTask, ToolArithmeticTask

@dataclass(frozen=True)
class EmbeddedSpec:
    task: ArithmeticTask | CountTask | LapCountTask | ToolArithmeticTask
    recipe: WarmStartRecipe
    # Completion-token budget the build's evaluation samples with (EOS included), like a sampler's
    # max_new_tokens; for the thinking model some T=1 completions are cut here while still thinking.
    max_new_tokens: int = 4
    # build_config overrides as (key, value) pairs; () = the default tiny config (and its hash).
    config: tuple = ()
    # A mixture-of-experts variant (megarl/models/tiny_moe.py) instead of the dense Qwen2.
    moe: bool = False
    # The family: dense "qwen2" (build_config), "qwen3" (build_qwen3_config: the same sizes) or "qwen3_5" (the hybrid
    # Qwen3.5 text model, build_qwen3_5_config: the same sizes); with moe, "qwen2" picks the tiny Mixtral
    # (build_moe_config), "qwen3_moe" the tiny Qwen3-MoE (build_qwen3moe_config), "deepseek_v3" the tiny DeepSeek-V3
    # (build_deepseek_v3_config).
    family: str = "qwen2"
    # The tool model's protocol (tiny_chat.py): "text" (`>>> code` turns) or "tool_calls" (OpenAI tool calling).
    chat: str = "text"
    # What the build costs on one idle CPU core, for the line that announces it (not part of the hash).
    build_minutes: float = 1.0

    def model_config(self):
        """The HF config this spec builds (the MoE one from tiny_moe, else build_config or build_qwen3_config)."""
        if self.moe:
            from megarl.models.tiny_moe import build_deepseek_v3_config, build_moe_config, build_qwen3moe_config

            build = {"qwen3_moe": build_qwen3moe_config, "deepseek_v3": build_deepseek_v3_config}.get(
                self.family, build_moe_config)
            return build(VOCAB_SIZE, EOS_ID, PAD_ID, **dict(self.config))
        build = {"qwen3": build_qwen3_config, "qwen3_5": build_qwen3_5_config}.get(self.family, build_config)
        return build(**dict(self.config))


# vLLM's CPU attention needs head_dim >= 32; the default config has 64 / 4 = 16. These variants have
# 2 query heads and 1 KV head of 32 (still GQA, same hidden size and parameter count).
HEAD_DIM_32 = (("num_attention_heads", 2), ("num_key_value_heads", 1))
# sampler.engine=vllm swaps an embedded model for its head_dim >= 32 variant: VLLM_VARIANTS (megarl.config.schema).


# A wider, deeper variant of the tiny config (head_dim 32, so vLLM's CPU attention takes it too).
WIDE = (("hidden_size", 128), ("intermediate_size", 384), ("num_hidden_layers", 4), ("max_window_layers", 4),
        ("num_attention_heads", 4), ("num_key_value_heads", 2))

# Completion budget to run the thinking model with (filler + answer + EOS); ~1-2% of T=1 samples hit it.
THINK_MAX_NEW_TOKENS = 48
# Forced filler lengths the thinking model's greedy answer is evaluated after (see greedy_answer_accuracy).
GREEDY_THINK_LENS = (0, 10, 25, 40)

# Completion budget to run the count model with: the longest run (48 letters) + EOS.
COUNT_MAX_NEW_TOKENS = 49
# Prompts the count model is evaluated on in its build: drawn like RL draws them (seed fixed).
COUNT_EVAL_PROMPTS = 400

# Completion budget to run the lap-count model with: nine laps, lap 0 to "Z", EOS (LapCountTask.max_completion_tokens).
LAP_COUNT_MAX_NEW_TOKENS = 531
# Its warm start: 16 prompts a step (a step's rows are ~530 tokens wide: the batch's longest), fewer steps than the
# count model's, and 100 evaluation prompts (each decodes up to 531 tokens).
LAP_COUNT_RECIPE = WarmStartRecipe(clean_steps=300, noisy_steps=100, batch_prompts=16)
LAP_COUNT_EVAL_PROMPTS = 100
LAP_COUNT_BUILD_MINUTES = 2.0  # (~100 s of CPU measured; 25 min of wall time at a load average of ~20)

QWEN3_5_BUILD_MINUTES = 2.0  # (~95 s of CPU measured; 14 min of wall time at a load average of ~35)

EMBEDDED_MODELS: dict[str, EmbeddedSpec] = {
    "tiny-qwen2-count": EmbeddedSpec(task=CountTask(), recipe=WarmStartRecipe(clean_steps=300, noisy_steps=150),
                                     max_new_tokens=COUNT_MAX_NEW_TOKENS),
    # The demo's model for sampler.engine=vllm (head_dim 32, see HEAD_DIM_32), same task and recipe.
    "tiny-qwen2-count-hd32": EmbeddedSpec(task=CountTask(), recipe=WarmStartRecipe(clean_steps=300, noisy_steps=150),
                                          max_new_tokens=COUNT_MAX_NEW_TOKENS, config=HEAD_DIM_32),
    # The demo task on a model 7x the demo's (hidden 128, 4 layers, head_dim 32): benchmarks/vs_trl.py's second
    # comparison, where a step's matmuls, not per-op overheads, set both sides' costs (docs/benchmarks.md).
    "tiny-qwen2-count-wide": EmbeddedSpec(task=CountTask(), recipe=WarmStartRecipe(clean_steps=300, noisy_steps=150),
                                          max_new_tokens=COUNT_MAX_NEW_TOKENS, config=WIDE),
    # The long-rollout task (configs/long.yaml): "3k=" -> three laps of the alphabet counted down, then "a".."k";
    # completions of ~105 tokens on average, up to 531. The demo's sizes, positions up to 1024.
    "tiny-qwen2-lapcount": EmbeddedSpec(task=LapCountTask(), recipe=LAP_COUNT_RECIPE,
                                        max_new_tokens=LAP_COUNT_MAX_NEW_TOKENS,
                                        config=(("max_position_embeddings", 1024),), build_minutes=LAP_COUNT_BUILD_MINUTES),
    "tiny-qwen2-arith": EmbeddedSpec(task=ArithmeticTask(), recipe=WarmStartRecipe()),
    # The demo task on a dense Qwen3 of the demo's sizes (docs/models.md): `model.path=embedded:tiny-qwen3-count`.
    "tiny-qwen3-count": EmbeddedSpec(task=CountTask(), recipe=WarmStartRecipe(clean_steps=300, noisy_steps=150),
                                     max_new_tokens=COUNT_MAX_NEW_TOKENS, family="qwen3"),
    # The demo task on a hybrid Qwen3.5 text model of the demo's sizes (a gated-DeltaNet layer, then a full-attention
    # one; docs/models.md): `model.path=embedded:tiny-qwen3_5-count`, on the megatron learner (megarl.learner.hybrid)
    # or with learner.backend=deepspeed (the generic path).
    "tiny-qwen3_5-count": EmbeddedSpec(task=CountTask(), recipe=WarmStartRecipe(clean_steps=300, noisy_steps=150),
                                       max_new_tokens=COUNT_MAX_NEW_TOKENS, family="qwen3_5",
                                       build_minutes=QWEN3_5_BUILD_MINUTES),
    # The mixture-of-experts demo's model (configs/moe.yaml, docs/moe.md): a tiny Mixtral, same task and recipe.
    "tiny-mixtral-count": EmbeddedSpec(task=CountTask(), recipe=WarmStartRecipe(clean_steps=300, noisy_steps=150),
                                       max_new_tokens=COUNT_MAX_NEW_TOKENS, moe=True),
    # The demo task on a Qwen3-MoE of the Mixtral's sizes (docs/models.md):
    # `model.path=embedded:tiny-qwen3moe-count`.
    "tiny-qwen3moe-count": EmbeddedSpec(task=CountTask(), recipe=WarmStartRecipe(clean_steps=300, noisy_steps=150),
                                        max_new_tokens=COUNT_MAX_NEW_TOKENS, moe=True, family="qwen3_moe"),
    # The demo task on a DeepSeek-V3 of the Mixtral's sizes (docs/models.md; sampled on the built-in engine's native
    # forward): `model.path=embedded:tiny-deepseek-v3-count`.
    "tiny-deepseek-v3-count": EmbeddedSpec(task=CountTask(), recipe=WarmStartRecipe(clean_steps=300, noisy_steps=150),
                                           max_new_tokens=COUNT_MAX_NEW_TOKENS, moe=True, family="deepseek_v3"),
    # The multi-turn demo's chat model (megarl/embedded/tiny_chat.py): tool calls, episodes of ~75 tokens.
    "tiny-qwen2-tool": EmbeddedSpec(task=ToolArithmeticTask(), recipe=WarmStartRecipe(clean_steps=500, noisy_steps=150),
                                    max_new_tokens=16, config=(("max_position_embeddings", 256),)),
    "tiny-qwen2-tool-hd32": EmbeddedSpec(task=ToolArithmeticTask(), recipe=WarmStartRecipe(clean_steps=500, noisy_steps=150),
                                         max_new_tokens=16, config=(("max_position_embeddings", 256),) + HEAD_DIM_32),
    # The tool model for agents using OpenAI tool calling (`tools=`, docs/multiturn.md; configs/multiturn_tools.yaml).
    "tiny-qwen2-toolcall": EmbeddedSpec(task=ToolArithmeticTask(), recipe=WarmStartRecipe(clean_steps=500, noisy_steps=150),
                                        max_new_tokens=96, config=(("max_position_embeddings", 512),), chat="tool_calls",
                                        build_minutes=5.0),  # (the tools block: 47 tokens in every sequence)
    "tiny-qwen2-arith-think": EmbeddedSpec(task=ArithmeticTask(think_mean=10.0),
                                           recipe=WarmStartRecipe(short_steps=400, noisy_steps=120),
                                           max_new_tokens=THINK_MAX_NEW_TOKENS),
}


def _spec_hash(spec: EmbeddedSpec) -> str:
    # The directory name carries a hash of everything that shapes the model (and the transformers
    # major version, which owns the file format), so changing the recipe builds a new directory
    # instead of silently reusing a stale one.
    import transformers

    config = spec.model_config().to_dict()  # (transformers' config: its defaults shape the model too)
    blob = json.dumps({"task": asdict(spec.task), "recipe": asdict(spec.recipe), "config": config,
                       "max_new_tokens": spec.max_new_tokens,
                       "transformers_major": transformers.__version__.split(".")[0],
                       **(_chat_fields(spec) if spec.chat != "text" else {})}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def _chat_fields(spec: EmbeddedSpec) -> dict:
    """A tool-calling model's protocol and the template its warm start rendered tools with (what its prompts hold)."""
    from megarl.embedded.tiny_chat import CHAT_TEMPLATE

    return {"chat": spec.chat, "template": hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()[:10]}


# The modules whose code `_spec_hash` reads beyond the spec: the HF config's builders (build_config,
# build_moe_config) and the chat template (_chat_fields).
_HASHED_SOURCES = (Path(__file__).with_name("spec.py"), Path(__file__).parent.parent / "models" / "tiny_moe.py",
                   Path(__file__).with_name("tiny_chat.py"))


def _memo_key(spec: EmbeddedSpec) -> str:
    """What `_spec_hash` depends on, without importing transformers: the spec, the installed transformers version
    and the source of the modules it reads (_HASHED_SOURCES)."""
    from importlib.metadata import version

    blob = repr(spec) + version("transformers") + "".join(path.read_text() for path in _HASHED_SOURCES)
    return hashlib.sha256(blob.encode()).hexdigest()


def spec_hash(spec: EmbeddedSpec, cache_dir: Path) -> str:
    """`_spec_hash(spec)`, remembered in cache_dir/.spec-hashes.json under `_memo_key(spec)`: computing it imports
    transformers (~0.6 s), which a learner rank otherwise never needs, and every rank resolves the model at start.
    A lost or unreadable memo only costs the import again (concurrent writers: the last rename wins)."""
    memo_path = cache_dir / ".spec-hashes.json"
    key = _memo_key(spec)
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if not isinstance(memo, dict):
        memo = {}
    if isinstance(memo.get(key), str) and re.fullmatch(r"[0-9a-f]{10}", memo[key]):  # a directory name's part:
        return memo[key]  # nothing else is taken from a file others may have written
    memo[key] = _spec_hash(spec)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".spec-hashes.", dir=cache_dir)
        with os.fdopen(fd, "w") as f:
            json.dump(memo, f)
        os.replace(tmp, memo_path)
    except OSError:
        pass  # a read-only cache: the hash is still right, only not remembered
    return memo[key]


def build_embedded_model(name: str, out_dir: str | Path) -> dict:
    """Create, warm-start, evaluate and save the named model into out_dir; returns the build record."""
    import torch
    from transformers import (DeepseekV3ForCausalLM, GenerationConfig, MixtralForCausalLM, Qwen2ForCausalLM,
                              Qwen3_5ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM)

    from megarl.embedded.tiny import (expected_accuracy, generate, generate_tokens, greedy_answer_accuracy,
                                      length_stats, warm_start)

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
            model = {("qwen2", True): MixtralForCausalLM, ("qwen3_moe", True): Qwen3MoeForCausalLM,
                     ("deepseek_v3", True): DeepseekV3ForCausalLM,
                     ("qwen3", False): Qwen3ForCausalLM, ("qwen3_5", False): Qwen3_5ForCausalLM,
                     ("qwen2", False): Qwen2ForCausalLM}[
                         spec.family, spec.moe](spec.model_config())
            warm_start(model, tokenizer, spec.task, spec.recipe)
        train_s = time.perf_counter() - t0
        if isinstance(spec.task, (CountTask, LapCountTask)):
            n = LAP_COUNT_EVAL_PROMPTS if isinstance(spec.task, LapCountTask) else COUNT_EVAL_PROMPTS
            prompts = spec.task.sample_prompts(random.Random(1), n)
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
                                     None if isinstance(spec.task, (CountTask, LapCountTask)) else spec.max_new_tokens)
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
    import torch

    from megarl.embedded.tiny_chat import build_tool_model

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
    final = cache_dir / f"{name}-{spec_hash(EMBEDDED_MODELS[name], cache_dir)}"
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
            minutes = EMBEDDED_MODELS[name].build_minutes
            print(f"megarl: building embedded model {name} (once per machine, about "
                  f"{'a minute' if minutes <= 1 else f'{minutes:.0f} minutes'} on one idle CPU core)...",
                  file=sys.stderr, flush=True)
            record = build_embedded_model(name, tmp)
            # Which code built it: a build made by the same code can stand in for another (the test suite's cache)
            record["builder"] = builder_fingerprint()
            (tmp / BUILD_RECORD).write_text(json.dumps(record, indent=2) + "\n")
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
