"""An agent written with the `openai` SDK's tool calling (`tools=`): multiplies with a Python tool it runs itself.

The tool_arith task as agent frameworks write it: the python tool is declared as an OpenAI function tool, the
model's calls come back as `message.tool_calls` (finish_reason "tool_calls"), and the agent answers each with a
`role: "tool"` message naming its `tool_call_id`. megarl renders the tools through the model's chat template and
parses its replies (docs/multiturn.md#openai-tool-calling); the agent needs no megarl in it but the tool.

    PYTHONPATH=docs/examples/agent megarl train configs/multiturn_tools.yaml

Run alone against a live session (a base_url megarl handed to an agent) to see one conversation:

    python docs/examples/agent/tools_agent.py http://127.0.0.1:PORT/sessions/TOKEN/v1 "37*43" 1591
"""
import json
import sys

import openai

from megarl.rollout.environment import PythonTool

MAX_TURNS = 3
TOOL = PythonTool(timeout_s=5.0, memo=True)
TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code and return what it prints or evaluates to.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]


def run(base_url: str, prompt: str, answer: str, meta: dict, stream: bool = False) -> float:
    client = openai.OpenAI(base_url=base_url, api_key="megarl", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    for _ in range(MAX_TURNS):
        try:
            if stream:  # the SDK's streaming helper assembles the chunks into the same message
                with client.chat.completions.stream(model="megarl", messages=messages, tools=TOOLS,
                                                    max_tokens=96) as s:
                    message = s.get_final_completion().choices[0].message
            else:
                message = client.chat.completions.create(model="megarl", messages=messages, tools=TOOLS,
                                                         max_tokens=96).choices[0].message
        except openai.BadRequestError as exc:
            if exc.code == "context_length_exceeded":  # no room left for a turn: the episode ended truncated
                return 0.0
            raise
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not message.tool_calls:  # an answer
            return 1.0 if (message.content or "").strip() == answer else 0.0
        for call in message.tool_calls:
            code = json.loads(call.function.arguments).get("code", "") if call.function.name == "python" else ""
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": TOOL.output(code) if isinstance(code, str) else "code must be a string"})
    return 0.0  # never answered


def run_streamed(base_url: str, prompt: str, answer: str, meta: dict) -> float:
    return run(base_url, prompt, answer, meta, stream=True)


if __name__ == "__main__":
    print(run(sys.argv[1], sys.argv[2], sys.argv[3], {}))
