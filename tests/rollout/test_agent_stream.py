"""Token-by-token streaming on the agent endpoint: the real `openai` client's streaming API against the endpoint's
HTTP server, on a real BuiltinEngine (a random tiny Qwen2 with the embedded chat tokenizer) stepped by the test.

That chunks arrive before the turn is complete is shown without timing: once the engine has produced tokens of the
streamed request the loop stops stepping and waits for the agent to read a chunk carrying them; the request is then
still running (old behaviour: no chunk comes until the turn is complete, and the wait runs out)."""
import threading
import time

import openai
import pytest

from megarl.embedded.tiny_chat import IM_END, build_chat_tokenizer
from megarl.protocols import Prompt, SamplingParams
from megarl.rollout.agent import AgentRunner
from megarl.rollout.episode import EpisodeLimits
from megarl.sampler.engine import BuiltinEngine
from tests.helpers import save_tiny_qwen2
from tests.rollout.test_agent import agent_that

MAX_NEW = 12
HOLD_S = 60.0  # how long the held loop waits for the agent's read (only a broken stream ever waits this long)


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = save_tiny_qwen2(tmp_path_factory.mktemp("tiny"), tie_word_embeddings=True, vocab_size=264)
    return BuiltinEngine.from_pretrained(str(model), max_running=2, max_seq_len=128, seed=0)


class EngineLoop:
    """The sampler loop's part on a real engine: step, hand completions to the runner, poll it. With `hold` it stops
    stepping once the engine has sampled tokens of a request (and the runner has polled them), until the agent sets
    `hold` (bounded)."""

    def __init__(self, tok, engine, agent):
        self.engine, self.completions = engine, []
        self.runner = AgentRunner(agent_that(agent), tok, engine.add_request, SamplingParams(1.0, 1.0, 0, MAX_NEW),
                                  EpisodeLimits(2, 0, 128, 1, 10.0), (tok.convert_tokens_to_ids(IM_END),),
                                  workers=1, timeout_s=120.0, model_name="tiny", progress=engine.progress)
        self.unfinished_at_read: int | None = None

    def run(self, prompt: Prompt, key: str, seed: int, hold: threading.Event | None = None):
        self.engine.reseed(seed)
        self.runner.start(key, prompt)
        ended, deadline = [], time.monotonic() + 120
        while not ended or self.engine.num_unfinished:  # an abandoned request runs to its end
            assert time.monotonic() < deadline, "the episode did not end"
            for completion in self.engine.step():
                self.completions.append(completion)
                self.runner.on_completion(completion)
            ended += self.runner.poll()
            if hold is not None and self.unfinished_at_read is None and \
                    any(p.token_ids for p in self.engine.progress().values()):  # tokens sampled, turn running
                assert hold.wait(HOLD_S), "no chunk reached the agent while its request ran on the engine"
                self.unfinished_at_read = self.engine.num_unfinished
            if self.engine.num_unfinished == 0:
                self.runner.ready.wait(0.02)
        return ended


def chat(base_url: str, **kwargs):
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "37*43"}],
                                          logprobs=True, **kwargs)


def test_a_stream_sends_tokens_as_they_are_sampled_and_adds_up_to_the_plain_reply(tok, engine):
    seen, hold = {}, threading.Event()

    def agent(base_url, prompt, answer, meta):
        if not meta["stream"]:
            seen["plain"] = chat(base_url)
            return 0.0
        chunks = []
        for c in chat(base_url, stream=True, stream_options={"include_usage": True}):
            chunks.append(c)
            if c.choices and c.choices[0].logprobs:
                hold.set()  # the loop holds the engine until here: this chunk came before the turn ended
        seen["chunks"] = chunks
        return 0.0

    loop = EngineLoop(tok, engine, agent)
    [plain_episode] = loop.run(Prompt("q", "a", {"stream": False}), "s0-g0/0", seed=7)
    [stream_episode] = loop.run(Prompt("q", "a", {"stream": True}), "s0-g1/0", seed=7, hold=hold)
    loop.runner.close()
    assert loop.unfinished_at_read == 1
    plain, chunks = seen["plain"].choices[0], seen["chunks"]
    sampled, streamed_sampled = loop.completions
    assert len(sampled.token_ids) > 2  # several decode steps, so several chunks
    # Token by token: more than one chunk carries tokens; together they are the plain reply's tokens and log-probs.
    with_tokens = [c.choices[0].logprobs.content for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(with_tokens) > 1
    assert [(t.token, t.logprob) for entries in with_tokens for t in entries] == \
        [(t.token, t.logprob) for t in plain.logprobs.content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(sampled.token_ids)
    # Trained: exactly the sampled tokens, the same for both.
    for episode, completion in ((plain_episode, sampled), (stream_episode, streamed_sampled)):
        assert episode.error is None
        assert (episode.token_ids, episode.logprobs, episode.versions) == \
            (completion.token_ids, completion.logprobs, completion.versions)
    assert streamed_sampled.token_ids == sampled.token_ids


def test_a_client_that_disconnects_mid_stream_ends_its_episode_and_the_sampler_goes_on(tok, engine):
    hold = threading.Event()

    def agent(base_url, prompt, answer, meta):
        if meta["leave"]:
            stream = chat(base_url, stream=True)
            for c in stream:
                if c.choices and c.choices[0].logprobs:
                    stream.close()  # mid-stream: the request is still on the engine (the loop holds it)
                    break
            hold.set()
            return 1.0
        chat(base_url)
        return 1.0

    loop = EngineLoop(tok, engine, agent)
    [left] = loop.run(Prompt("q", "a", {"leave": True}), "s0-g0/0", seed=7, hold=hold)
    assert loop.unfinished_at_read == 1
    assert left.error is not None and "closed a streamed reply before its end" in left.error
    assert (loop.runner.stream_disconnects, loop.runner.env_failures) == (1, 1)
    # Nothing leaks: the request ran to its end and was dropped, the session is gone.
    assert (loop.runner.waiting, loop.runner.streams, loop.runner.sessions) == ({}, {}, {})
    [after] = loop.run(Prompt("q", "a", {"leave": False}), "s0-g1/0", seed=7)
    loop.runner.close()
    assert (after.error, after.turns, after.token_ids) == (None, 1, loop.completions[-1].token_ids)


class TokenByToken:
    """A scripted engine that reveals a reply one token at a time through `progress`, as BuiltinEngine.progress
    reports a running request, then completes it: the reply's tokens, log-probs and versions are the test's. The next
    token is revealed once the agent has read the last (`received`: tokens it got), so each chunk holds one token."""

    def __init__(self, tok, agent, reply: str, received):
        from megarl.sampler.engine import Progress

        self.tok, self.Progress, self.requests = tok, Progress, []
        self.ids = tok.encode(reply, add_special_tokens=False) + [tok.convert_tokens_to_ids(IM_END)]
        self.logprobs = [-(i + 1) / 8 for i in range(len(self.ids))]
        self.shown, self.received = 0, received
        self.runner = AgentRunner(agent_that(agent), tok, self.requests.append, SamplingParams(max_new_tokens=96),
                                  EpisodeLimits(2, 0, 512, 1, 10.0), (tok.convert_tokens_to_ids(IM_END),),
                                  workers=1, timeout_s=60.0, model_name="tiny", progress=self.progress)

    def progress(self, since):
        return {rid: self.Progress(start, self.ids[start:self.shown], self.logprobs[start:self.shown],
                                   [1] * (self.shown - start)) for rid, start in since.items()}

    def run(self, prompt: Prompt):
        from megarl.protocols import Completion

        self.runner.start("s0-g0/0", prompt)
        ended, deadline = [], time.monotonic() + 180  # ~90 agent round trips; only a broken stream runs out
        while not ended:
            assert time.monotonic() < deadline, "the episode did not end"
            if self.requests and self.shown < len(self.ids) and self.received() >= self.shown:
                self.shown += 1
                if self.shown == len(self.ids):
                    request = self.requests[0]
                    self.runner.on_completion(Completion(request.request_id, request.prompt_ids, self.ids,
                                                         self.logprobs, [1] * len(self.ids), "stop"))
            ended += self.runner.poll()
            time.sleep(0.005)
        self.runner.close()
        return ended


def test_with_tools_a_stream_sends_the_text_before_a_call_and_the_call_as_tool_calls_at_the_end(tok):
    import tools_agent  # on sys.path via tests.rollout.test_agent

    call = '<tool_call>\n{"name": "python", "arguments": {"code": "37*43"}}\n</tool_call>'
    seen = {"chunks": [], "tokens": 0}

    def agent(base_url, prompt, answer, meta):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        for c in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                tools=tools_agent.TOOLS, logprobs=True, stream=True):
            seen["chunks"].append(c)
            if c.choices and c.choices[0].logprobs:
                seen["tokens"] += len(c.choices[0].logprobs.content)
        return 0.0

    loop = TokenByToken(tok, agent, "Let me compute. " + call, lambda: seen["tokens"])
    [episode] = loop.run(Prompt("37*43", "1591"))
    chunks = [c.choices[0] for c in seen["chunks"] if c.choices]
    contents = [c.delta.content for c in chunks if c.delta.content]
    # The text before the call went out while the reply was sampled (one token a chunk), none of the call's text.
    assert "".join(contents) == "Let me compute." and len(contents) > 1
    assert len([c for c in chunks if c.logprobs]) == len(loop.ids)  # each token in its own chunk
    [calls] = [c.delta.tool_calls for c in chunks if c.delta.tool_calls]
    assert (calls[0].function.name, calls[0].function.arguments) == ("python", '{"code": "37*43"}')
    assert chunks[-1].finish_reason == "tool_calls"
    assert [t.logprob for c in chunks if c.logprobs for t in c.logprobs.content] == loop.logprobs
    assert (episode.token_ids, episode.logprobs) == (loop.ids, loop.logprobs)  # trained: the sampled tokens
