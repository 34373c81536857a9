"""AgentRunner + the OpenAI-compatible endpoint, driven by agents written against the real `openai` client
(honest ones and hostile ones; tests/rollout/test_agent_endpoint.py sends the endpoint raw bytes).

The engine is a script on a loop thread (each model turn's tokens and versions chosen by the test), so
token bookkeeping and every refusal are exact; tests/roles/test_multiturn_e2e.py runs the shipped agent
through a real training run."""
import sys
import threading
import time

import openai
import pytest

from megarl.embedded.tiny_chat import IM_END, build_chat_tokenizer
from megarl.protocols import Completion, Prompt, SamplingParams
from megarl.rollout.agent import AgentRunner
from megarl.rollout.agent_endpoint import new_session_token
from megarl.rollout.environment import PYTHON_TOOL_SCHEMA
from megarl.rollout.episode import EpisodeLimits
from tests.helpers import REPO

sys.path.insert(0, str(REPO / "docs" / "examples" / "agent"))
import tool_agent  # noqa: E402  the agent shipped with the docs


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


MAX_SEQ_LEN = 256


class ScriptedLoop:
    """The sampler loop's part: polls the runner and answers each request with the next scripted reply
    (or, with a callable, the reply to the request's text)."""

    def __init__(self, tok, agent, replies, max_turns=3, timeout_s=20.0, workers=2, max_seq_len=MAX_SEQ_LEN,
                 max_new_tokens=16, tool_parser="auto"):
        self.tok, self.replies, self.requests, self.ended = tok, replies, [], []
        self.runner = AgentRunner(agent, tok, self.requests.append, SamplingParams(max_new_tokens=max_new_tokens),
                                  EpisodeLimits(max_turns, 0, max_seq_len, 1, 10.0),
                                  (tok.convert_tokens_to_ids(IM_END),), workers=workers, timeout_s=timeout_s,
                                  model_name="tiny", tool_parser=tool_parser)

    def reply(self, request) -> str:
        if callable(self.replies):
            return self.replies(self.tok.decode(request.prompt_ids))
        return self.replies.pop(0) if self.replies else "0"

    def logprobs(self, ids: list[int]) -> list[float]:
        """The scripted engine's behaviour log-prob of each token of a reply."""
        return [-0.25] * len(ids)

    def run(self, prompt: Prompt | list[Prompt], n: int = 1, deadline_s: float = 60.0):
        prompts = prompt if isinstance(prompt, list) else [prompt] * n
        for j, p in enumerate(prompts):
            self.runner.start(f"s0-g0/{j}", p)
        deadline, served = time.monotonic() + deadline_s, 0
        while len(self.ended) < len(prompts):
            assert time.monotonic() < deadline, "episodes did not end"
            self.ended += self.runner.poll()
            for request in self.requests[served:]:
                served += 1
                text = self.reply(request)
                ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.convert_tokens_to_ids(IM_END)]
                self.runner.on_completion(Completion(request.request_id, request.prompt_ids, ids, self.logprobs(ids),
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
        for kwargs, name in [({"tool_choice": "required", "tools": [PYTHON_TOOL_SCHEMA]}, "tool_choice"),
                             ({"n": 2}, "n")]:
            try:
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], **kwargs)
            except openai.BadRequestError as exc:
                seen[name] = exc.message
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}])
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "edited"},
                                                            {"role": "assistant", "content": "x"}])

    [failed] = ScriptedLoop(tok, agent_that(edits_history), ["x"]).run(Prompt("q", "a"))
    assert "tool_choice must be auto or none" in seen["tool_choice"] and "n must be 1" in seen["n"]
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

    def raises_on_the_refusal(base_url, prompt, answer, meta):  # as agent frameworks do on a 400
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": prompt}]
        while True:
            content = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "more"}]

    for agent in too_many_turns, raises_on_the_refusal:
        [truncated] = ScriptedLoop(tok, agent_that(agent), ["a", "b"], max_turns=2).run(Prompt("q", "a"))
        assert (truncated.finish_reason, truncated.reward, truncated.turns, truncated.error) == ("length", 0.0, 2,
                                                                                                  None)
    assert seen["turns"] == "context_length_exceeded"


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
    urls = []
    loop.runner.agent = lambda base_url, *args: urls.append(base_url) or tool_agent.run(base_url, *args)
    loop.run(Prompt("1+1", "2"))
    client = openai.OpenAI(base_url=urls[0], api_key="x", max_retries=0)
    with pytest.raises(openai.APIConnectionError):  # closed with the runner
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    runner = AgentRunner("tool_agent:run", tok, lambda r: None, SamplingParams(), EpisodeLimits(3, 0, 256), (0,),
                         workers=1, timeout_s=5.0, model_name="tiny")
    try:
        for session in ("nope", "s0-g0.0", new_session_token()):  # what was a session id before, a random token
            client = openai.OpenAI(base_url=runner.endpoint.base_url(session), api_key="x", max_retries=0)
            with pytest.raises(openai.NotFoundError, match="no open session"):
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
            with pytest.raises(openai.NotFoundError, match="no open session"):
                client.models.list()
    finally:
        runner.close()


class CountingTokenizer:
    """The real tokenizer, counting the characters it is asked to encode; text holding HOLD waits (up to 20 s)
    until `release` is set, so a test can see what goes on meanwhile."""

    HOLD = "hold on"

    def __init__(self, tok):
        self.tok, self.encoded_chars, self.release, self.held_until_released = tok, [], threading.Event(), None

    def encode(self, text, **kwargs):
        self.encoded_chars.append(len(text))
        if self.HOLD in text:
            self.held_until_released = self.release.wait(20)
        return self.tok.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def arithmetic_reply(text: str) -> str:
    """The model's part of tool_arith: a tool call, then the tool's answer copied."""
    return text.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0] if "<|im_start|>tool" in text else ">>> 37*43"


def test_an_8mb_message_an_over_context_one_and_a_turn_into_another_session_are_refused_and_never_trained(tok):
    counting = CountingTokenizer(tok)
    seen, injection_tried = {}, threading.Event()

    def status_of(call):
        try:
            call()
        except openai.APIStatusError as exc:
            return exc.status_code, exc.code
        return 200, None

    def attacker(base_url, prompt, answer, meta):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        if prompt == "opens too long":  # 4 KB in a 256-token context, as the first request
            seen["opening"] = status_of(lambda: client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "7" * 4000}]))
            return 1.0
        messages = [{"role": "user", "content": "q"}]
        reply = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        # A turn into the honest session (open: its agent waits for this) under what its URL was before
        # session tokens, and under a random token.
        for name, session in (("guessed", "s0-g0.2"), ("random", new_session_token())):
            other = openai.OpenAI(base_url=base_url.replace(base_url.split("/")[-2], session), api_key="x",
                                  max_retries=0)
            seen[name] = (status_of(lambda: other.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "37*43"}, {"role": "user", "content": "injected"}])),
                status_of(other.models.list))
        injection_tried.set()
        seen["8mb"] = status_of(lambda: client.chat.completions.create(
            model="m", messages=messages + [{"role": "user", "content": "x" * (8 << 20)}]))
        # A message that fits, tokenised while the honest agent finishes its episode (it waits for that).
        messages.append({"role": "user", "content": CountingTokenizer.HOLD})
        reply = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        seen["4kb"] = status_of(lambda: client.chat.completions.create(
            model="m", messages=messages + [{"role": "user", "content": "7" * 4000}]))
        return 1.0

    def honest(base_url, prompt, answer, meta):
        try:
            reward = tool_agent.run(base_url, prompt, answer, meta)
            injection_tried.wait(20)
            return reward
        finally:
            counting.release.set()

    def agent(base_url, prompt, answer, meta):
        return (honest if prompt == "37*43" else attacker)(base_url, prompt, answer, meta)

    loop = ScriptedLoop(tok, agent_that(agent), arithmetic_reply, workers=3)
    loop.runner.tokenizer = counting
    episodes = loop.run([Prompt("opens too long", ""), Prompt("floods", ""), Prompt("37*43", "1591")])
    opening, flood, honest_episode = sorted(episodes, key=lambda e: e.key)

    assert seen["opening"] == seen["4kb"] == (400, "context_length_exceeded")
    assert seen["8mb"] == (413, "request_too_large")
    assert seen["guessed"] == seen["random"] == ((404, "session_not_found"),) * 2
    assert counting.held_until_released  # other sessions and the loop went on while it tokenised
    assert max(counting.encoded_chars) < 4000  # neither over-context message was tokenised
    assert loop.runner.over_context == 2
    # Nothing over the context reaches the learner: what _finish_episode sends is prompt_ids + token_ids.
    for e in episodes:
        assert len(e.prompt_ids) + len(e.token_ids) <= MAX_SEQ_LEN
        assert len(e.versions) == len(e.logprobs) == len(e.token_ids)
    assert (opening.finish_reason, opening.reward, opening.prompt_ids, opening.token_ids) == ("length", 0.0, [], [])
    assert (flood.finish_reason, flood.reward, flood.turns) == ("length", 0.0, 2)
    assert "xxxx" not in tok.decode(flood.token_ids) and "7777" not in tok.decode(flood.token_ids)
    # The honest episode is exactly what it is alone (test_the_shipped_agent_trains_...): nothing injected.
    assert (honest_episode.reward, honest_episode.turns, honest_episode.error) == (1.0, 2, None)
    [(start, end)] = honest_episode.env_spans
    assert tok.decode(honest_episode.token_ids[start:end]) == \
        "\n<|im_start|>tool\n1591<|im_end|>\n<|im_start|>assistant\n"


def test_a_reward_with_parts_records_them_on_the_episode(tok):
    from megarl.rollout.rewards import Scored

    parts = {"correct": {"score": 1.0, "weight": 0.5}, "format": {"score": 0.5, "weight": 1.0}, "judge": None}

    def scored(base_url, prompt, answer, meta):
        openai.OpenAI(base_url=base_url, api_key="x", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompt}])
        return Scored(1.0, parts) if meta["parts"] else 1.0

    ended = ScriptedLoop(tok, agent_that(scored), ["1591", "1591"]).run(
        [Prompt("q", "a", {"parts": True}), Prompt("q", "a", {"parts": False})])
    with_parts, plain = sorted(ended, key=lambda e: e.key)
    assert (with_parts.error, with_parts.reward, with_parts.reward_parts) == (None, 1.0, parts)
    assert (plain.error, plain.reward, plain.reward_parts) == (None, 1.0, None)
