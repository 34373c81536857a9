"""A single-turn verifiers environment from a local dataset with a reward function, written as verifiers' own
scaffold (`vf-init`) writes one: the tests' verifiers environment (tests/rollout/test_verifiers_real.py). It runs in
the verifiers env (megarl/rollout/verifiers_env.py), importable there from PYTHONPATH.

The dataset is products.jsonl beside this file ("37*43" -> "1591"); `calls_tool` rewards a reply that writes the
product as the tool call the embedded tool model knows (">>> 37*43"), `exact` one that is the product."""
import json
from pathlib import Path

import verifiers.v1 as vf

DATA = Path(__file__).with_name("products.jsonl")


class ProductData(vf.TaskData):
    answer: str
    operands: list[int]


class ProductTask(vf.Task[ProductData]):
    @vf.reward(weight=0.5)
    async def calls_tool(self, trace: vf.Trace) -> float:
        a, b = self.data.operands
        return float(trace.last_reply.replace(" ", "") == f">>>{a}*{b}")

    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)


class ProductConfig(vf.TasksetConfig):
    pass


class ProductTaskset(vf.Taskset[ProductTask, ProductConfig]):
    def load(self):
        for line in DATA.read_text().splitlines():
            row = json.loads(line)
            yield ProductTask(ProductData(prompt=row["question"], answer=row["answer"], operands=row["operands"]),
                              self.config.task)


__all__ = ["ProductTaskset"]
