"""EpisodeRunner: model turns from an engine, environment turns from worker threads, every token accounted for.

The engine here is a script (each turn's tokens, log-probs and versions are chosen by the test) so that
version changes within and between turns, and every limit, are exact; tests/roles/test_multiturn_e2e.py
runs the same code with the real engine, learner and tool."""
import threading
import time
from dataclasses import dataclass

import pytest

from megarl.embedded.tiny_chat import IM_END, build_chat_tokenizer
from megarl.protocols import Completion, Prompt, SamplingParams
from megarl.rollout.environment import Observation
from megarl.rollout.episode import EpisodeLimits, EpisodeRunner


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


@dataclass
class ScriptedTask:
    """Each model turn is answered by `answers[turn]` (an Observation, an exception to raise, or a callable)."""

    answers: list

    def sample_prompts(self, rng, n):
        return [Prompt("q", "a")] * n

    def opening_messages(self, prompt):
        return [{"role": "user", "content": prompt.text}]

    def environment(self, prompt):
        task = self

        class Env:
            turn = 0

            def step(self, messages):
                answer = task.answers[min(self.turn, len(task.answers) - 1)]
                self.turn += 1
                if isinstance(answer, BaseException):
                    raise answer
                return answer() if callable(answer) else answer

        return Env()


def runner_for(tok, task, max_turns=4, max_episode_tokens=0, max_seq_len=256, env_timeout_s=5.0):
    requests = []
    runner = EpisodeRunner(task, tok, requests.append, SamplingParams(max_new_tokens=16),
                           EpisodeLimits(max_turns, max_episode_tokens, max_seq_len, 1, env_timeout_s),
                           stop_token_ids=(tok.convert_tokens_to_ids(IM_END),), workers=2)
    return runner, requests


def turn(tok, request, text, version, stop=True, versions=None):
    ids = tok.encode(text, add_special_tokens=False) + ([tok.convert_tokens_to_ids(IM_END)] if stop else [])
    return Completion(request.request_id, request.prompt_ids, ids, [-0.5] * len(ids),
                      versions or [version] * len(ids), "stop" if stop else "length")


def finish_env(runner, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        ended = runner.poll()
        if ended or not runner.num_stepping:
            return ended
        assert time.monotonic() < deadline, "environment step did not finish"
        runner.ready.wait(0.05)


def test_an_episode_interleaves_model_turns_with_untrained_environment_tokens(tok):
    task = ScriptedTask([Observation(messages=[{"role": "tool", "content": "1591"}]), Observation(done=True, reward=1.0)])
    runner, requests = runner_for(tok, task)
    chat = runner.opening(Prompt("37*43", "1591"))
    opening = list(chat.ids)
    runner.start("g/0", Prompt("37*43", "1591"), chat)
    assert [r.request_id for r in requests] == ["g/0/0"] and requests[0].prompt_ids == opening
    # Turn 0 straddles an in-flight update (versions 3 then 4); turn 1 runs under version 5.
    assert runner.on_completion(turn(tok, requests[0], ">>> 37*43", None, versions=[3] * 5 + [4] * 5)) is None
    assert finish_env(runner) == []
    assert requests[1].request_id == "g/0/1" and requests[1].prompt_ids[:len(opening)] == opening
    assert runner.on_completion(turn(tok, requests[1], "1591", 5)) is None
    [episode] = finish_env(runner)
    assert episode.reward == 1.0 and episode.turns == 2 and episode.error is None
    assert episode.prompt_ids == opening
    tokens = episode.token_ids
    assert requests[1].prompt_ids == opening + tokens[:len(requests[1].prompt_ids) - len(opening)]  # token in, token out
    [(start, end)] = episode.env_spans
    assert start == 10 and tok.decode(tokens[start:end]) == "\n<|im_start|>tool\n1591<|im_end|>\n<|im_start|>assistant\n"
    assert episode.versions == [3] * 5 + [4] * 5 + [-1] * (end - start) + [5] * 5
    assert episode.logprobs == [-0.5] * 10 + [0.0] * (end - start) + [-0.5] * 5
    assert len(tokens) == len(episode.versions) == len(episode.logprobs)


def test_an_environment_that_raises_hangs_or_answers_malformed_fails_only_its_episode(tok):
    hang = threading.Event()
    cases = {"raises": RuntimeError("tool crashed"), "malformed": lambda: "not an observation",
             "no reward": Observation(done=True), "hangs": lambda: hang.wait(30) and None}
    runner, requests = runner_for(tok, None, env_timeout_s=0.5)
    for i, (name, answer) in enumerate(cases.items()):
        runner.task = ScriptedTask([answer])
        runner.start(f"g/{i}", Prompt("q", "a"), runner.opening(Prompt("q", "a")))
    for request in list(requests):
        runner.on_completion(turn(tok, request, "x", 0))
    ended = {}
    while len(ended) < len(cases):
        for e in finish_env(runner):
            ended[list(cases)[int(e.key.split("/")[1])]] = e
    hang.set()
    assert all(e.done and e.reward == 0.0 for e in ended.values())
    assert "RuntimeError: tool crashed" in ended["raises"].error
    assert "must return an Observation" in ended["malformed"].error
    assert "real-valued reward" in ended["no reward"].error
    assert "timed out after 0.5s (task.env_timeout_s)" in ended["hangs"].error
    assert runner.env_failures == 4
    runner.close()


def test_limits_end_an_episode_as_truncated(tok):
    tool = Observation(messages=[{"role": "tool", "content": "1591"}])
    # max_turns: the environment still answers the last turn; not done -> truncated, reward 0.
    runner, requests = runner_for(tok, ScriptedTask([tool]), max_turns=1)
    runner.start("g/0", Prompt("q", "a"), runner.opening(Prompt("q", "a")))
    runner.on_completion(turn(tok, requests[0], ">>> 1", 0))
    [e] = finish_env(runner)
    assert (e.finish_reason, e.reward, e.turns, len(requests)) == ("length", 0.0, 1, 1)
    # A turn cut at its token limit ends the episode at once (nothing to answer).
    runner, requests = runner_for(tok, ScriptedTask([tool]))
    runner.start("g/0", Prompt("q", "a"), runner.opening(Prompt("q", "a")))
    e = runner.on_completion(turn(tok, requests[0], ">>> 1", 0, stop=False))
    assert e is not None and e.finish_reason == "length" and not runner.num_stepping
    # The episode budget caps each turn's max_new_tokens and ends the episode when spent.
    runner, requests = runner_for(tok, ScriptedTask([tool]), max_episode_tokens=40)
    runner.start("g/0", Prompt("q", "a"), runner.opening(Prompt("q", "a")))
    assert requests[0].sampling.max_new_tokens == 16
    runner.on_completion(turn(tok, requests[0], ">>> 1", 0))
    assert finish_env(runner) == []
    used = len(requests[1].prompt_ids) - len(requests[0].prompt_ids)
    assert requests[1].sampling.max_new_tokens == min(16, 40 - used)


def test_an_environment_turn_over_the_context_is_not_added_and_the_episode_ends_truncated(tok):
    # 5,000 characters of tool output in a 256-token context: the episode ends truncated without them, so the
    # sample the learner gets stays within the context (before: the tokens were appended, 5,000+ in all).
    flood = Observation(messages=[{"role": "tool", "content": "9" * 5000}])
    runner, requests = runner_for(tok, ScriptedTask([flood]))
    runner.start("g/0", Prompt("q", "a"), runner.opening(Prompt("q", "a")))
    runner.on_completion(turn(tok, requests[0], ">>> 1", 0))
    [e] = finish_env(runner)
    assert (e.finish_reason, e.reward, e.turns, e.env_spans, runner.over_context) == ("length", 0.0, 1, [], 1)
    assert len(e.prompt_ids) + len(e.token_ids) <= 256 and len(e.versions) == len(e.token_ids)
    runner.close()
