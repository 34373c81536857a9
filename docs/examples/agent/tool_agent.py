"""An agent for megarl's OpenAI-compatible endpoint: multiplies with a Python tool it runs itself.

megarl calls `run(base_url, prompt, answer, meta)` once per episode (task.agent=tool_agent:run, with this
directory on PYTHONPATH); the agent talks to the sampler through the `openai` client like to any
server and returns the episode's reward. It is the agent-side twin of the built-in tool_arith
environment: the model asks for a tool call by answering ">>> <code>"; the agent runs the code
(in megarl's sandbox here; any tool an agent has would do) and sends the output back as a "tool" message.

    PYTHONPATH=docs/examples/agent megarl train configs/multiturn_demo.yaml task.agent=tool_agent:run 'eval.sets=[]'

Run alone against a live session (a base_url megarl handed to an agent) to see one conversation:

    python docs/examples/agent/tool_agent.py http://127.0.0.1:PORT/sessions/TOKEN/v1 "37*43" 1591
"""
import sys

import openai

from megarl.rollout.environment import PythonTool, tool_code

MAX_TURNS = 3
TOOL = PythonTool(timeout_s=5.0, memo=True)


def run(base_url: str, prompt: str, answer: str, meta: dict) -> float:
    client = openai.OpenAI(base_url=base_url, api_key="megarl", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    for _ in range(MAX_TURNS):
        try:
            reply = client.chat.completions.create(model="megarl", messages=messages, max_tokens=16)
        except openai.BadRequestError as exc:
            if exc.code == "context_length_exceeded":  # no room left for a turn: the episode ended truncated
                return 0.0
            raise
        content = reply.choices[0].message.content
        messages.append({"role": "assistant", "content": content})
        code = tool_code(content)
        if code is None:  # an answer
            return 1.0 if content.strip() == answer else 0.0
        messages.append({"role": "tool", "content": TOOL.output(code)})
    return 0.0  # never answered


if __name__ == "__main__":
    print(run(sys.argv[1], sys.argv[2], sys.argv[3], {}))
