"""The embedded chat model: the tiny Qwen2 with chat markers and a chat template, warm-started on tool use.

"tiny-qwen2-tool" is what the multi-turn demo trains (configs/multiturn_demo.yaml, task "tool_arith"):
the embedded tokenizer with two of its reserved specials named `<|im_start|>` / `<|im_end|>` (same
ids, so the vocabulary and every other model are unchanged), `<|im_end|>` as its EOS, and a ChatML
template saved in the model directory (chat_template.jinja), which megarl's samplers use like any
model's. The warm start is supervised on whole episodes rendered exactly as a sampler renders them
(megarl.rollout.chat.ChatTranscript), with the loss on the model's turns only:

    <|im_start|>user\\n37*43<|im_end|>\\n<|im_start|>assistant\\n   >>> 37*43<|im_end|>
    \\n<|im_start|>tool\\n1591<|im_end|>\\n<|im_start|>assistant\\n   1591<|im_end|>

Its noisy phase mixes in near misses -- a tool call with one operand digit changed (whose result is
then copied faithfully), or the right call with one digit of the result miscopied -- so the base
policy calls the tool in the right format but is right only a minority of the time: RL then has to
learn to copy exactly, across the environment's tokens.

"tiny-qwen2-toolcall" is the same warm start with OpenAI tool calling (an agent's `tools=`): the python tool
(PYTHON_TOOL_SCHEMA) rendered in a system block, the call written as the template writes tool calls,
`<tool_call>\n{"name": "python", "arguments": {"code": "37*43"}}\n</tool_call>`, and the tool's answer after it.
"""
from __future__ import annotations

import json
import random

import torch

from megarl.protocols import Prompt
from megarl.rollout.chat import ChatTranscript
from megarl.rollout.environment import PYTHON_TOOL_SCHEMA, TOOL_PREFIX, message_code
from megarl.rollout.tool_calls import parse_hermes
from megarl.rollout.tasks import ToolArithmeticTask

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# ChatML with Qwen's tool calling: `tools` as a system block, an assistant turn's calls as <tool_call> JSON blocks
# (megarl.rollout.tool_calls' "hermes" family). Without tools or calls it renders plain ChatML, exactly as the
# text-protocol demo's episodes. The block holds each tool as its signature, `python(code)`: its name and its
# parameters' names, not the whole JSON schema as Qwen's template writes it. A tiny model warm-started on one
# declaration would not recognise the same tool declared another way (an MCP server adds a description, titles and
# `required`: the verifiers environment in tests/rollout/verifiers_envs/megarl_vf_calc), while every declaration of
# the same function renders the same signature here -- and the block costs ~45 prompt tokens instead of ~150.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}{% for tool in tools %}"
    "{% set f = tool.function if tool.function is defined else tool %}"
    "{% set params = f.parameters.properties if f.parameters is defined and f.parameters.properties is defined "
    "else {} %}{{ '\\n' + f.name + '(' + (params | list | join(', ')) + ')' }}"
    "{% endfor %}{{ '\\n</tools><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% if message.tool_calls is defined and message.tool_calls %}{% for call in message.tool_calls %}"
    "{% set f = call.function if call.function is defined else call %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Model-turn budget to run the tool model with: a call ">>> 99*99" or a product, and <|im_end|>.
TOOL_MAX_NEW_TOKENS = 16
# The tool-calling model ("tiny-qwen2-toolcall"): a <tool_call> JSON block of 75 bytes (one token each) and <|im_end|>.
TOOL_CALLS_MAX_NEW_TOKENS = 96
EVAL_PROMPTS = 100


def build_chat_tokenizer():
    """The embedded tokenizer with `<|im_start|>` / `<|im_end|>` in the ids of its first two reserved
    specials, `<|im_end|>` as EOS, and the ChatML template."""
    from megarl.embedded.tiny import build_tokenizer

    tokenizer = build_tokenizer(chat_markers=(IM_START, IM_END))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _digit_miss(value: int, rng: random.Random) -> int:
    """value with one digit replaced by another (the leading digit never by 0): a near miss."""
    digits = list(str(value))
    i = rng.randrange(len(digits))
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0")])
    return int("".join(digits))


def tool_call_text(code: str) -> str:
    """A call of the python tool as the chat template renders it (the "hermes" format)."""
    return '<tool_call>\n{"name": "python", "arguments": ' + json.dumps({"code": code}) + '}\n</tool_call>'


def episode_tensors(tokenizer, prompt: Prompt, call: str, result: str, answer: str,
                    tool_calls: bool = False) -> tuple[list[int], list[float]]:
    """The ids of one two-turn episode as a sampler renders it, and 1.0 on the model's tokens. With tool_calls
    the request carries the python tool (PYTHON_TOOL_SCHEMA) and the call is OpenAI tool calling's <tool_call>."""
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    chat = ChatTranscript(tokenizer, [{"role": "user", "content": prompt.text}],
                          tools=[PYTHON_TOOL_SCHEMA] if tool_calls else None)
    mask = [0.0] * len(chat.ids)
    first = tool_call_text(call) if tool_calls else TOOL_PREFIX + call
    for turn, tool_result in ((first, result), (answer, None)):
        ids = tokenizer.encode(turn, add_special_tokens=False) + [im_end]
        chat.add_model_turn(ids, (im_end,), parse=parse_hermes if tool_calls else None)
        mask += [1.0] * len(ids)
        if tool_result is not None:
            mask += [0.0] * len(chat.add_messages([{"role": "tool", "content": tool_result}]))
    return chat.ids, mask


def tool_traces(task: ToolArithmeticTask, tokenizer, recipe, tool_calls: bool = False):
    """make_batch(step, rng) for megarl.embedded.tiny.train_supervised: correct episodes, then in the noisy
    phase each prompt also as a near miss (weights p_correct / 1 - p_correct)."""
    pad_id = tokenizer.pad_token_id

    def episode(p: Prompt, rng: random.Random, noisy: bool):
        a, b = p.meta["a"], p.meta["b"]
        if not noisy:
            return episode_tensors(tokenizer, p, f"{a}*{b}", str(a * b), str(a * b), tool_calls)
        if rng.random() < 0.5:  # wrong operand, result copied faithfully
            a2, b2 = (_digit_miss(a, rng), b) if rng.random() < 0.5 else (a, _digit_miss(b, rng))
            return episode_tensors(tokenizer, p, f"{a2}*{b2}", str(a2 * b2), str(a2 * b2), tool_calls)
        return episode_tensors(tokenizer, p, f"{a}*{b}", str(a * b), str(_digit_miss(a * b, rng)), tool_calls)

    def make_batch(step: int, rng: random.Random):
        prompts = task.sample_prompts(rng, recipe.batch_prompts)
        noisy = step >= recipe.clean_steps
        rows = [episode(p, rng, False) for p in prompts]
        weights = [1.0] * len(rows)
        if noisy:
            rows += [episode(p, rng, True) for p in prompts]
            weights = [recipe.p_correct] * len(prompts) + [1.0 - recipe.p_correct] * len(prompts)
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width)
        for i, (ids, m) in enumerate(rows):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            mask[i, :len(m)] = torch.tensor(m)
        return input_ids, mask, torch.tensor(weights)

    return make_batch


@torch.no_grad()
def sampled_accuracy(model, tokenizer, task: ToolArithmeticTask, prompts: list[Prompt], seed: int = 0,
                     max_turns: int = 3, tool_calls: bool = False) -> dict:
    """Episodes sampled at T=1 with transformers' generate and the task's own environment (the real tool):
    the share rewarded, and the share whose first turn called the tool."""
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    gen = torch.Generator().manual_seed(seed)
    rewarded = called = 0
    for p in prompts:
        chat = ChatTranscript(tokenizer, task.opening_messages(p), tools=[PYTHON_TOOL_SCHEMA] if tool_calls else None)
        env = task.environment(p)
        for turn in range(max_turns):
            ids = _sample(model, chat.ids, im_end, TOOL_CALLS_MAX_NEW_TOKENS if tool_calls else TOOL_MAX_NEW_TOKENS, gen)
            chat.add_model_turn(ids, (im_end,), parse=parse_hermes if tool_calls else None)
            called += turn == 0 and message_code(chat.messages[-1]) is not None
            obs = env.step(chat.messages)
            if obs.done:
                rewarded += obs.reward
                break
            chat.add_messages(list(obs.messages))
    return {"sampled_accuracy": round(rewarded / len(prompts), 4), "tool_call_rate": round(called / len(prompts), 4)}


def _sample(model, context: list[int], stop_id: int, max_new: int, gen: torch.Generator) -> list[int]:
    """T=1 ancestral sampling of one turn (one sequence, no cache: the episodes are short)."""
    ids, out = torch.tensor([context]), []
    for _ in range(max_new):
        logits = model(input_ids=ids).logits[0, -1].float()
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        out.append(token)
        if token == stop_id:
            break
        ids = torch.cat([ids, torch.tensor([[token]])], 1)
    return out


def build_tool_model(spec, out_dir) -> dict:
    """Create, warm-start, evaluate and save the tool model (megarl.embedded.registry.build_embedded_model's part for
    a ToolArithmeticTask spec); returns the build record's fields."""
    import time

    from transformers import GenerationConfig, Qwen2ForCausalLM

    from megarl.embedded.tiny import PAD_ID, build_config, train_supervised

    tokenizer = build_chat_tokenizer()
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    tool_calls = spec.chat == "tool_calls"
    t0 = time.perf_counter()
    model = Qwen2ForCausalLM(build_config(eos_token_id=im_end, **dict(spec.config)))
    train_supervised(model, spec.recipe, tool_traces(spec.task, tokenizer, spec.recipe, tool_calls))
    train_s = time.perf_counter() - t0
    record = {"warm_start_seconds": round(train_s, 1), "num_parameters": sum(p.numel() for p in model.parameters()),
              "max_new_tokens": TOOL_CALLS_MAX_NEW_TOKENS if tool_calls else TOOL_MAX_NEW_TOKENS,
              **sampled_accuracy(model, tokenizer, spec.task, spec.task.sample_prompts(random.Random(1), EVAL_PROMPTS),
                                 tool_calls=tool_calls),
              "eval_seconds": round(time.perf_counter() - t0 - train_s, 1)}
    model.generation_config = GenerationConfig(eos_token_id=im_end, pad_token_id=PAD_ID, bos_token_id=None)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return record
