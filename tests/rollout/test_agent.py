"""AgentRunner + the OpenAI-compatible endpoint, driven by agents written against the real `openai` client.

The engine is a script on a loop thread (each model turn's tokens and versions chosen by the test), so
token bookkeeping and every refusal are exact; tests/roles/test_multiturn_e2e.py runs the shipped agent
through a real training run."""
import sys
import threading
import time

import openai
import pytest

from megarl.models.tiny_chat import IM_END, build_chat_tokenizer
from megarl.protocols import Completion, Prompt, SamplingParams
from megarl.rollout.agent import AgentRunner
from megarl.rollout.episode import EpisodeLimits
from tests.helpers import REPO

sys.path.insert(0, str(REPO / "docs" / "examples" / "agent"))
import tool_agent  # noqa: E402  the agent shipped with the docs


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


class ScriptedLoop:
    """The sampler loop's part: polls the runner and answers each request with the next scripted reply."""

    def __init__(self, tok, agent, replies, max_turns=3, timeout_s=20.0, version_per_turn=True):
        self.tok, self.replies, self.requests, self.ended = tok, list(replies), [], []
        self.runner = AgentRunner(agent, tok, self.requests.append, SamplingParams(max_new_tokens=16),
                                  EpisodeLimits(max_turns, 0, 256, 1, 10.0), (tok.convert_tokens_to_ids(IM_END),),
                                  workers=2, timeout_s=timeout_s, model_name="tiny")
        self.version_per_turn = version_per_turn

    def run(self, prompt: Prompt, n: int = 1, deadline_s: float = 60.0):
        for j in range(n):
            self.runner.start(f"s0-g0/{j}", prompt)
        deadline, served = time.monotonic() + deadline_s, 0
        while len(self.ended) < n:
            assert time.monotonic() < deadline, "episodes did not end"
            self.ended += self.runner.poll()
            for request in self.requests[served:]:
                served += 1
                text = self.replies.pop(0) if self.replies else "0"
                ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.convert_tokens_to_ids(IM_END)]
                self.runner.on_completion(Completion(request.request_id, request.prompt_ids, ids, [-0.25] * len(ids),
                                                     [served] * len(ids), "stop"))
            self.runner.ready.wait(0.02)
        self.runner.close()
        return self.ended


def test_the_shipped_agent_trains_through_the_endpoint_token_in_token_out(tok):
    loop = ScriptedLoop(tok, "tool_agent:run", [">>> 37*43", "1591"])
    [episode] = loop.run(Prompt("37*43", "1591"))
    assert episode.error is None and episode.reward == 1.0 and episode.turns == 2
    first, second = loop.requests
    assert first.prompt_ids == tok.encode("<|im_start|>user\n37*43<|im_end|>\n<|im_start|>assistant\n",
                                          add_special_tokens=False) == episode.prompt_ids
    assert second.prompt_ids == episode.prompt_ids + episode.token_ids[:len(second.prompt_ids) - len(first.prompt_ids)]
    [(start, end)] = episode.env_spans
    assert tok.decode(episode.token_ids[start:end]) == "\n<|im_start|>tool\n1591<|im_end|>\n<|im_start|>assistant\n"
    assert episode.versions == [1] * start + [-1] * (end - start) + [2] * (len(episode.token_ids) - end)
    assert second.sampling.max_new_tokens == 16 and second.request_id == "s0-g0/0/1"


def agent_that(behaviour):
    """An agent module attribute for task.agent-style loading."""
    name = f"agent_{len(vars(tool_agent))}"
    setattr(tool_agent, name, behaviour)
    return f"tool_agent:{name}"


def test_refusals_reach_the_agent_as_openai_errors_and_fail_or_truncate_its_episode(tok):
    seen = {}

    def edits_history(base_url, prompt, answer, meta):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        for kwargs, name in [({"stream": True}, "stream"), ({"n": 2}, "n")]:
            try:
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], **kwargs)
            except openai.BadRequestError as exc:
                seen[name] = exc.message
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}])
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "edited"},
                                                            {"role": "assistant", "content": "x"}])

    [failed] = ScriptedLoop(tok, agent_that(edits_history), ["x"]).run(Prompt("q", "a"))
    assert "stream=true is not supported" in seen["stream"] and "n must be 1" in seen["n"]
    assert "BadRequestError" in failed.error and "message 0 differs" in failed.error and failed.reward == 0.0

    def too_many_turns(base_url, prompt, answer, meta):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": prompt}]
        for _ in range(3):
            try:
                content = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
            except openai.BadRequestError as exc:
                seen["turns"] = exc.code
                return 1.0
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "more"}]

    [truncated] = ScriptedLoop(tok, agent_that(too_many_turns), ["a", "b"], max_turns=2).run(Prompt("q", "a"))
    assert seen["turns"] == "context_length_exceeded"
    assert (truncated.finish_reason, truncated.reward, truncated.turns, truncated.error) == ("length", 0.0, 2, None)


def test_an_agent_that_raises_returns_garbage_makes_no_call_or_hangs_fails_only_its_episode(tok):
    release = threading.Event()
    def one_call_then(value):
        def agent(base_url, prompt, answer, meta):
            openai.OpenAI(base_url=base_url, api_key="x").chat.completions.create(
                model="m", messages=[{"role": "user", "content": prompt}])
            return value
        return agent

    cases = [(lambda *a: 1 / 0, "ZeroDivisionError"), (one_call_then("yes"), "must return a finite number"),
             (one_call_then(float("inf")), "must return a finite number"),
             (one_call_then(1e308), "must return a finite number (the reward; within float32's range), got float 1e+308"),
             (lambda *a: 1.0, "without a chat completion request"), (lambda *a: release.wait(30), "timed out after 1s")]
    for behaviour, why in cases:
        loop = ScriptedLoop(tok, agent_that(behaviour), [], timeout_s=1.0)
        [episode] = loop.run(Prompt("q", "a"))
        assert why in episode.error and episode.reward == 0.0 and loop.runner.env_failures == 1
    release.set()


def test_a_session_that_ended_or_never_existed_answers_404(tok):
    loop = ScriptedLoop(tok, "tool_agent:run", [">>> 1+1", "2"])
    loop.run(Prompt("1+1", "2"))
    client = openai.OpenAI(base_url=loop.runner.endpoint.base_url("s0-g0.0"), api_key="x", max_retries=0)
    with pytest.raises(openai.APIConnectionError):  # closed with the runner
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    runner = AgentRunner("tool_agent:run", tok, lambda r: None, SamplingParams(), EpisodeLimits(3, 0, 256), (0,),
                         workers=1, timeout_s=5.0, model_name="tiny")
    try:
        client = openai.OpenAI(base_url=runner.endpoint.base_url("nope"), api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="no open session"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        assert [m.id for m in client.models.list()] == ["tiny"]
    finally:
        runner.close()
