"""The environment protocol's checks, the Python tool (in the real sandbox) and the tool_arith task."""
import concurrent.futures
import random

import pytest

from megarl.rollout.environment import Observation, PythonTool, check_observation, tool_code
from megarl.rollout.tasks import ToolArithmeticTask, build_task


def test_the_tool_runs_code_like_an_interpreter_prints_a_final_expression():
    tool = PythonTool()
    assert tool.output("37*43") == "1591"
    assert tool.output("x = 6\nx * 7") == "42"
    assert tool.output("print('hi')") == "hi"
    assert tool.output("'a' + 'b'") == "'ab'"  # repr, as an interpreter shows it


def test_a_failing_or_runaway_call_answers_with_the_error_not_an_exception():
    assert PythonTool().output("1/0") == "ZeroDivisionError: division by zero"
    assert PythonTool().output("37*") .startswith("SyntaxError")
    assert "limit" in PythonTool(timeout_s=1.0).output("while True: pass")
    assert len(PythonTool(max_chars=10).output("'x' * 100")) == 10


def test_memo_runs_each_distinct_code_once_even_when_called_concurrently(monkeypatch):
    tool = PythonTool(memo=True)
    runs = []
    real = PythonTool._run
    monkeypatch.setattr(PythonTool, "_run", lambda self, code: runs.append(code) or real(self, code))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(tool.output, ["3*4"] * 8 + ["5*5"] * 4))
    assert outputs == ["12"] * 8 + ["25"] * 4
    assert sorted(runs) == ["3*4", "5*5"]


def test_check_observation_names_what_is_malformed():
    assert check_observation(Observation(done=True, reward=1)).reward == 1
    for bad, why in [("text", "must return an Observation"), (Observation(done=True), "real-valued reward"),
                     (Observation(done=True, reward=float("nan")), "real-valued reward"),
                     (Observation(done=True, reward=float("inf")), "reward must be finite, got inf"),
                     (Observation(done=True, reward=1e308), r"reward must be within \+-1e\+06 .*got 1e\+308"),
                     (Observation(), "at least one message"),
                     (Observation(messages=[{"role": "tool", "content": 3}]), "string 'role' and 'content'")]:
        with pytest.raises(ValueError, match=why):
            check_observation(bad)


def test_tool_arith_rewards_only_the_product_after_answering_tool_calls():
    task = build_task("tool_arith")
    prompt = task.sample_prompts(random.Random(0), 1)[0]
    a, b = prompt.meta["a"], prompt.meta["b"]
    assert 10 <= a <= 99 and 10 <= b <= 99 and prompt.text == f"{a}*{b}"
    env = task.environment(prompt)
    history = task.opening_messages(prompt) + [{"role": "assistant", "content": f">>> {a}*{b}"}]
    assert env.step(history) == Observation(messages=[{"role": "tool", "content": str(a * b)}])
    assert env.step(history + [{"role": "assistant", "content": str(a * b)}]) == Observation(done=True, reward=1.0)
    assert env.step(history + [{"role": "assistant", "content": str(a * b + 1)}]).reward == 0.0
    assert tool_code("1591") is None and tool_code(">>> 1+1") == "1+1"
    with pytest.raises(ValueError, match="digits"):
        ToolArithmeticTask(digits=9)
