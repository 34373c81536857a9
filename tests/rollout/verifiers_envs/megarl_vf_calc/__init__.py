"""A multi-turn tool verifiers environment from a local dataset: the products of megarl_vf_products, with a `python`
tool (an MCP server, `vf.Toolset`) the model calls to multiply, rewarded when its final reply is the product.
tests/rollout/test_verifiers_real.py trains the embedded tool-calling model (tiny-qwen2-toolcall) on it: the MCP server
declares the tool with its docstring, titles and `required`, and the model's template renders it as the signature
`python(code)` the model was warm-started on (megarl.embedded.tiny_chat)."""
import json
from pathlib import Path

import verifiers.v1 as vf

from megarl_vf_calc.tools import CalcToolset

DATA = Path(__file__).parent.parent / "megarl_vf_products" / "products.jsonl"


class CalcData(vf.TaskData):
    answer: str


class CalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalcConfig(vf.TasksetConfig):
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self):
        for line in DATA.read_text().splitlines():
            row = json.loads(line)
            yield CalcTask(CalcData(prompt=row["question"], answer=row["answer"]), self.config.task)


__all__ = ["CalcTaskset"]
