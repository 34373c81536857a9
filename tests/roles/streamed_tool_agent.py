"""The shipped text-protocol agent (docs/examples/agent/tool_agent.py) reading every reply as a stream
(`create(stream=True)`, the content assembled from its deltas). Used by tests/roles/test_multiturn_e2e.py: a real run's
sampler streams token by token from its engine, and what is trained is what was sampled. `shipped_or_streamed` runs
the shipped agent itself for half the prompts (streamed() tells which), so that one run covers both."""
import zlib

import openai

from megarl.rollout.environment import tool_code

MAX_TURNS = 3


def run(base_url: str, prompt: str, answer: str, meta: dict) -> float:
    from tool_agent import TOOL  # on the sampler's path (docs/examples/agent), not the test's

    client = openai.OpenAI(base_url=base_url, api_key="megarl", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    for _ in range(MAX_TURNS):
        try:
            stream = client.chat.completions.create(model="megarl", messages=messages, max_tokens=16, stream=True)
        except openai.BadRequestError as exc:
            if exc.code == "context_length_exceeded":
                return 0.0
            raise
        content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        messages.append({"role": "assistant", "content": content})
        code = tool_code(content)
        if code is None:
            return 1.0 if content.strip() == answer else 0.0
        messages.append({"role": "tool", "content": TOOL.output(code)})
    return 0.0


def streamed(prompt: str) -> bool:
    """Whether shipped_or_streamed streams `prompt`'s episodes: half the prompts, the same for every episode of one."""
    return zlib.crc32(prompt.encode()) % 2 == 1


def shipped_or_streamed(base_url: str, prompt: str, answer: str, meta: dict) -> float:
    from tool_agent import run as shipped  # (as in run)

    return (run if streamed(prompt) else shipped)(base_url, prompt, answer, meta)
