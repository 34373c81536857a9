"""Episodes driven by agent programs through the sampler's OpenAI-compatible endpoint.

With `task.agent = "package.module:function"` every episode of a prompt group is one call, on a worker
thread, of

    function(base_url, prompt, answer, meta) -> reward

where base_url is that episode's own session of megarl's /v1/chat/completions
(megarl/rollout/agent_endpoint.py): an agent written against the `openai` client
(`openai.OpenAI(base_url=base_url, api_key="megarl")`) talks to it like to any server, runs its own
tools, and returns the episode's reward. Prompts come from the configured task (task.name; with task.env, a verifiers
or OpenEnv environment's tasks, its episodes run by its adapter's agent function, megarl/rollout/env_adapters.py). The URL
holds the session's secret token: only the agent handed it can reach the session.

Server side, each request of a session is turned into tokens exactly as the engine will see them
(megarl.rollout.chat.ChatTranscript): the first request's messages are the episode's prompt; every later
request must resend that history unchanged, replies included, and the messages it adds become
environment tokens (version -1, not trained). Generation runs on the sampler loop's engine like any
other request (the HTTP thread hands it over and waits), so in-flight updates, versions and behaviour
log-probs are those of every other rollout. The episode ends when the function returns.

OpenAI tool calling: a request's `tools` are rendered by the model's chat template (fixed for the session), and
its reply is parsed by the template family's parser (megarl/rollout/tool_calls.py, task.tool_parser) into
`tool_calls`; the trained tokens are the sampled ones whatever the parse. A reply whose call does not parse is
returned as content and counted (`tool_call_parse_failures`).

`stream=true` answers with server-sent events as the engine produces tokens: after every step the loop reads each
streamed request's new tokens (`progress`, BuiltinEngine.progress; without it the turn is sent once complete) and
hands them to the request's HTTP thread, which sends the settled content (tool_calls.settled_content) with the
tokens' log-probs; the turn is recorded from the completion, as unstreamed. A stream holds its session's lock until
it ends. An agent that closes a stream before its end ends its episode (failed, counted in `stream_disconnects`);
its request runs to its end on the engine and is dropped, so every engine's requests stay as submitted.

Limits answer the agent with an error (code "context_length_exceeded") and end the episode as truncated (reward 0,
finish_reason "length", whether the agent then returns or raises): task.max_turns, task.max_episode_tokens, the
context. Messages that do not fit are refused
before they join the episode -- by their byte length where that proves it, without tokenising -- so an
episode's tokens never exceed sampler.max_seq_len (counted in `over_context`, printed at most every
30 s). A request's messages are rendered and tokenised on its HTTP thread holding only its own
session's lock; the lock the sessions share with the sampler loop guards just the appending.

An agent that raises, returns a non-number, made no request, or runs past task.agent_timeout_s fails its
episode (counted, the run goes on); a thread stuck in a hung agent is abandoned and occupies one of
task.env_workers.
"""
from __future__ import annotations

import concurrent.futures
import numbers
import queue
import threading
import time
from dataclasses import replace
from http import HTTPStatus
from typing import Callable, NoReturn

from megarl.protocols import Completion, GenerationRequest, Prompt, SamplingParams
from megarl.ratelimit import RateLimitedLine
from megarl.rollout.agent_endpoint import (ChatCompletionsEndpoint, ChatRequest, EndpointError, EventStream, chunk,
                                           check_request, closing_chunks, completion_response, logprob_entries,
                                           max_request_bytes_for, new_session_token)
from megarl.rollout.chat import ChatFormatError, ChatTranscript, OverContextError
from megarl.rollout.tool_calls import ToolMessageError, check_history, parser_for, settled_content
from megarl.rollout.episode import Episode, EpisodeLimits, environment_room, turn_room
from megarl.rollout.rewards import bad_reward_value
from megarl.rollout.sandbox import load_function


class _Session:
    def __init__(self, episode: Episode):
        self.episode = episode
        self.lock = threading.Lock()  # one request at a time per session
        self.closed = False
        self.truncated = False
        self.streaming = False  # a streamed reply is being sent (it holds the lock)
        self.disconnected = False  # its agent went away mid-stream: the loop ends the episode


class _Deltas:
    """A streamed request's output as the engine produces it: Progress items (engine.progress), then None once
    its completion is set (or the runner closed)."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()
        self.seen = 0  # completion tokens handed over so far


class AgentRunner:
    """Episodes run by an agent function (see the module docstring); the EpisodeRunner interface."""

    def __init__(self, agent: str, tokenizer, submit: Callable[[GenerationRequest], None], sampling: SamplingParams,
                 limits: EpisodeLimits, stop_token_ids: tuple[int, ...], workers: int, timeout_s: float,
                 model_name: str, max_request_bytes: int = 0, port: int = 0, tool_parser: str = "auto",
                 progress: Callable[[dict[str, int]], dict] | None = None):
        self.agent_path, self.agent = agent, load_function(agent)
        # How replies become tool_calls when a request has `tools` (megarl/rollout/tool_calls.py; task.tool_parser).
        self.tool_parser, self.parse = parser_for(tokenizer, tool_parser)
        self.tokenizer, self.submit, self.sampling = tokenizer, submit, sampling
        self.limits, self.stop_token_ids, self.timeout_s = limits, stop_token_ids, timeout_s
        self.model_name = model_name
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="megarl-agent")
        self.sessions: dict[str, _Session] = {}  # secret session token -> session, while its agent runs
        self.running: dict[str, concurrent.futures.Future] = {}  # session token -> the agent call
        self.started_at: dict[str, float] = {}
        self.inbox: queue.Queue = queue.Queue()  # (request, future, deltas or None) from HTTP threads, for the loop
        self.waiting: dict[str, concurrent.futures.Future] = {}  # request id -> its completion, on the engine
        # Streamed requests on the engine -> their output so far. `progress` (BuiltinEngine.progress: request id ->
        # tokens seen -> what is new) is read after every step; without it a stream gets the turn once it is complete.
        self.streams: dict[str, _Deltas] = {}
        self.progress = progress
        self.stream_disconnects = 0  # episodes ended because their agent closed a stream before its end
        self.env_failures = 0
        self.env_s = 0.0  # wall time of finished agent calls, summed
        self.over_context_line = RateLimitedLine()  # requests refused for the context: counted and printed
        self.unparsed_line = RateLimitedLine()  # replies with a tool-call marker that did not parse: sent as content
        self.ready = threading.Event()  # a request arrived or an agent returned: poll() has work
        self._lock = threading.Lock()
        self.endpoint = ChatCompletionsEndpoint(self._handle, self._is_open, model_name,
                                                max_request_bytes or max_request_bytes_for(limits.max_seq_len),
                                                port).start()

    @property
    def over_context(self) -> int:
        return self.over_context_line.count

    @property
    def tool_call_parse_failures(self) -> int:
        return self.unparsed_line.count

    # ---- sampler loop thread -------------------------------------------------------------------------
    def opening(self, prompt: Prompt) -> None:
        return None  # the agent writes the opening messages; the endpoint checks each request's length

    def start(self, key: str, prompt: Prompt, chat: None = None) -> None:
        token = new_session_token()
        self.sessions[token] = _Session(Episode(key, prompt, None, 0))
        self.started_at[token] = time.monotonic()
        self.running[token] = self.pool.submit(self._call_agent, token, prompt)

    def _call_agent(self, token: str, prompt: Prompt):
        with self._lock:
            self.started_at[token] = time.monotonic()  # the timeout counts from here, not from the queue
        try:
            return self.agent(self.endpoint.base_url(token), prompt.text, prompt.answer, dict(prompt.meta))
        finally:
            with self._lock:
                self.env_s += time.monotonic() - self.started_at[token]
            self.ready.set()

    def on_completion(self, completion: Completion) -> None:
        self.waiting.pop(completion.request_id).set_result(completion)  # the HTTP thread answers the agent
        if (deltas := self.streams.pop(completion.request_id, None)) is not None:
            deltas.queue.put(None)  # after the result: the stream reads it once woken
        return None

    def poll(self) -> list[Episode]:
        self.ready.clear()
        while True:
            try:
                request, future, deltas = self.inbox.get_nowait()
            except queue.Empty:
                break
            self.waiting[request.request_id] = future
            if deltas is not None:
                self.streams[request.request_id] = deltas
            self.submit(request)
        self._hand_over_progress()
        ended, now = [], time.monotonic()
        for token, future in list(self.running.items()):
            with self._lock:
                started = self.started_at[token]
            session = self.sessions[token]
            if future.done() and session.streaming:
                continue  # the agent returned while its stream ends: whether it read the end decides how it ended
            if not future.done() and now - started < self.timeout_s and not session.disconnected:
                continue
            del self.sessions[token], self.running[token]
            with self._lock:  # from here on no request of the session changes its episode
                session.closed = True
            ended.append(self._end(session, future))
        return ended

    def _hand_over_progress(self) -> None:
        """Each streamed request's tokens since the last step, to its HTTP thread (the engine's between-step read:
        only the new tokens are gathered)."""
        if self.progress is None or not self.streams:
            return
        for request_id, update in self.progress({rid: d.seen for rid, d in self.streams.items()}).items():
            if update.token_ids:
                deltas = self.streams[request_id]
                deltas.seen = update.start + len(update.token_ids)
                deltas.queue.put(update)

    def _end(self, session: _Session, future: concurrent.futures.Future) -> Episode:
        episode = session.episode
        if session.disconnected:
            # Its request may still be on the engine: it runs to its end and is dropped (on_completion), which keeps
            # every engine's requests (a tensor-parallel group's included) as they were submitted.
            self.stream_disconnects += 1
            return self._fail(episode, f"agent {self.agent_path}: closed a streamed reply before its end (the client "
                                       f"disconnected); the episode ends there")
        if not future.done():
            return self._fail(episode, f"agent {self.agent_path}: timed out after {self.timeout_s:g}s "
                                       f"(task.agent_timeout_s); its thread is abandoned")
        if session.truncated:  # also an episode whose opening did not fit: it ends with no tokens at all
            # Whatever the agent did after the refusal: most agent frameworks raise on a 400, and the error
            # told it the episode ended truncated, so that raise is no failure of the agent.
            episode.end(0.0, "length")
            return episode
        try:
            reward = future.result()
        except Exception as exc:  # noqa: BLE001 - an agent's failure fails its episode only
            return self._fail(episode, f"agent {self.agent_path}: {type(exc).__name__}: {exc}")
        if episode.turns == 0:
            return self._fail(episode, f"agent {self.agent_path}: returned without a chat completion request")
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or bad_reward_value(float(reward)):
            return self._fail(episode, f"agent {self.agent_path}: must return a finite number (the reward; within "
                                       f"float32's range), got {type(reward).__name__} {reward!r:.80}")
        episode.end(float(reward))
        episode.reward_parts = getattr(reward, "parts", None)  # an environment's rubric parts (rewards.Scored)
        return episode

    def _fail(self, episode: Episode, error: str) -> Episode:
        self.env_failures += 1
        episode.end(0.0, error=error)
        return episode

    @property
    def num_stepping(self) -> int:
        return len(self.running)

    def close(self) -> None:
        self.endpoint.close()
        for future in self.waiting.values():
            future.set_exception(RuntimeError("the sampler stopped"))
        for deltas in self.streams.values():
            deltas.queue.put(None)
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- HTTP threads ------------------------------------------------------------------------------------
    def _is_open(self, token: str) -> bool:
        session = self.sessions.get(token)
        return session is not None and not session.closed

    def _handle(self, token: str, body: dict) -> dict | EventStream:
        session = self.sessions.get(token)
        if session is None or session.closed:
            raise EndpointError(HTTPStatus.NOT_FOUND, "no open session at this URL (its episode ended)",
                                code="session_not_found")
        request = check_request(body)
        if request.tools is not None and self.parse is None:
            raise EndpointError(HTTPStatus.BAD_REQUEST, "tools are not supported with this model: its chat template "
                                "renders no tools in a format megarl parses (<tool_call> JSON, Llama 3 JSON, harmony); "
                                "set task.tool_parser=hermes|llama3|harmony if it uses one of them",
                                code="unsupported_parameter")
        try:
            check_history(request.messages)
        except ToolMessageError as exc:
            raise EndpointError(HTTPStatus.BAD_REQUEST, str(exc), code="invalid_messages") from None
        if not session.lock.acquire(blocking=False):
            raise EndpointError(HTTPStatus.CONFLICT, "the episode's session already has a request in progress: an episode's "
                                                     "turns come one after another", code="concurrent_request")
        stream = None
        try:
            generation, prompt_tokens = self._prepare_turn(session, request, body)
            deltas = _Deltas() if request.stream else None
            future: concurrent.futures.Future = concurrent.futures.Future()
            self.inbox.put((generation, future, deltas))
            self.ready.set()
            if deltas is None:
                return self._finish_turn(session, request, self._completion(future), prompt_tokens)

            def close(disconnected: bool) -> None:  # a stream holds its session's lock until it ends
                session.disconnected |= disconnected
                session.streaming = False
                session.lock.release()
                self.ready.set()

            stream = EventStream(self._stream(session, request, future, deltas, prompt_tokens), close)
            session.streaming = True
            return stream
        finally:
            if stream is None:
                session.lock.release()

    def _open(self, session: _Session) -> None:
        """Called holding self._lock before changing the episode: a session the loop has ended stays as it was."""
        if session.closed:
            raise EndpointError(HTTPStatus.NOT_FOUND, f"episode {session.episode.key} ended", code="session_not_found")

    def _no_room(self, session: _Session, why: str) -> NoReturn:
        session.truncated = True
        raise EndpointError(HTTPStatus.BAD_REQUEST, f"{why}: the episode has no room for another model turn "
                            f"(task.max_turns={self.limits.max_turns}, task.max_episode_tokens="
                            f"{self.limits.max_episode_tokens}, context {self.limits.max_seq_len} tokens); "
                            f"it ends truncated", code="context_length_exceeded")

    def _prepare_turn(self, session: _Session, request: ChatRequest, body: dict) -> tuple[GenerationRequest, int]:
        """The request's messages joined to the episode, and the generation of its next model turn (with the
        episode's length before it); EndpointError for what is refused."""
        episode, messages = session.episode, request.messages
        if episode.turns >= self.limits.max_turns:
            self._no_room(session, f"{episode.turns} model turns")
        # Rendered and tokenised holding only the episode's own session lock (other sessions and the loop go on), and
        # refused before tokenising when the text's size proves it cannot fit.
        try:
            if episode.chat is None:
                room = environment_room(episode, self.limits)
                opening = ChatTranscript(self.tokenizer, messages, max_ids=room, tools=request.tools)
                addition = None
            else:
                if (request.tools or None) != episode.chat.tools:  # the tools render before the first message
                    raise EndpointError(HTTPStatus.BAD_REQUEST, "tools differ from the session's first request: "
                                        "an episode's tools are fixed (they are rendered at its start)",
                                        code="invalid_tools")
                new = episode.chat.extend_to(messages)
                if not new:
                    raise EndpointError(HTTPStatus.BAD_REQUEST, "no message after the session's history: add "
                                        "the next user or tool message", code="invalid_messages")
                addition = episode.chat.prepare(new, max_ids=environment_room(episode, self.limits))
        except OverContextError as exc:
            self.over_context_line(f"agent endpoint: a request's messages did not fit its episode ({exc}); "
                                   f"the episode ends truncated without them")
            self._no_room(session, f"refused: {exc}")
        except ChatFormatError as exc:
            raise EndpointError(HTTPStatus.BAD_REQUEST, str(exc), code="invalid_messages") from exc
        with self._lock:
            self._open(session)
            if addition is None:
                episode.chat, episode.prompt_len = opening, len(opening.ids)
            else:
                episode.add_environment_turn(addition)
        room = turn_room(episode, self.limits)
        if room is None:  # environment_room leaves min_new_tokens of context; task.max_episode_tokens may not
            self._no_room(session, "no tokens left")
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or self.sampling.max_new_tokens
        if not isinstance(asked, int) or asked < 1:
            raise EndpointError(HTTPStatus.BAD_REQUEST, f"max_tokens must be a positive integer, got {asked!r}")
        sampling = replace(self.sampling, max_new_tokens=min(asked, self.sampling.max_new_tokens, room))
        prompt_tokens = len(episode.chat.ids)
        generation = GenerationRequest(f"{episode.key}/{episode.turns}", list(episode.chat.ids), sampling,
                                       stop_token_ids=self.stop_token_ids)
        return generation, prompt_tokens

    def _completion(self, future: concurrent.futures.Future) -> Completion:
        """The engine's completion of a submitted turn, waited for at most task.agent_timeout_s."""
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError as exc:
            raise EndpointError(HTTPStatus.GATEWAY_TIMEOUT, f"no completion within {self.timeout_s:g}s "
                                f"(task.agent_timeout_s)", kind="server_error") from exc
        except RuntimeError as exc:
            raise EndpointError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), kind="server_error") from exc

    def _finish_turn(self, session: _Session, request: ChatRequest, completion: Completion,
                     prompt_tokens: int) -> dict:
        """The model turn recorded in the episode as sampled, and its chat.completion."""
        episode = session.episode
        with self._lock:
            self._open(session)
            episode.add_model_turn(completion, self.stop_token_ids, self.parse if request.parse_calls else None)
        if episode.chat.unparsed is not None:
            self.unparsed_line(f"agent endpoint: a reply's tool call did not parse ({episode.chat.unparsed}); it is "
                               f"returned as content ({self.tool_parser} parser)")
        if completion.finish_reason != "stop":
            session.truncated = True  # cut at its token limit: the episode cannot go on in order
        logprobs = logprob_entries(self.tokenizer, completion.token_ids, completion.logprobs) \
            if request.logprobs else None
        return completion_response(episode.key, episode.turns, self.model_name, episode.chat.messages[-1],
                                   completion.finish_reason, prompt_tokens, len(completion.token_ids), logprobs)

    def _stream(self, session: _Session, request: ChatRequest, future: concurrent.futures.Future, deltas: _Deltas,
                prompt_tokens: int):
        """A streamed turn's chunks: the role, then content deltas as the engine produces tokens (each chunk with
        its tokens' log-probs when asked; content only as far as it is settled, `settled_content`), then from the
        completion the rest of the content, the tool calls, the finish reason and the usage. The turn is recorded
        from the completion, so what is trained is the sampled tokens whatever was sent."""
        episode = session.episode
        head = {"id": f"chatcmpl-{episode.key.replace('/', '.')}-{episode.turns + 1}", "created": 0,
                "model": self.model_name}
        yield chunk(head, {"role": "assistant", "content": ""})
        parser = self.tool_parser if request.parse_calls else None
        tokens: list[int] = []
        sent, frozen = "", False  # frozen: with a parser, content is settled no further once a marker may start
        deadline = time.monotonic() + self.timeout_s
        done = False
        while not done:
            try:
                updates = [deltas.queue.get(timeout=max(0.0, deadline - time.monotonic()))]
            except queue.Empty:
                raise EndpointError(HTTPStatus.GATEWAY_TIMEOUT, f"no completion within {self.timeout_s:g}s "
                                    f"(task.agent_timeout_s)", kind="server_error") from None
            while updates[-1] is not None and not deltas.queue.empty():  # steps it fell behind on: one chunk
                updates.append(deltas.queue.get_nowait())
            done = updates[-1] is None
            new, new_logprobs = [], []
            for update in filter(None, updates):
                skip = len(tokens) + len(new) - update.start  # of this update, tokens already taken (none: `seen`)
                new += update.token_ids[skip:]
                new_logprobs += update.logprobs[skip:]
            tokens += new
            delta = {}
            if new and not frozen:
                # The whole reply decoded again: a token's text may depend on its neighbours (multi-byte characters)
                text = self.tokenizer.decode(tokens, skip_special_tokens=parser is None)
                frozen = parser is not None and "<" in text
                settled = settled_content(parser, text)
                if settled.startswith(sent) and len(settled) > len(sent):
                    delta, sent = {"content": settled[len(sent):]}, settled
            logprobs = logprob_entries(self.tokenizer, new, new_logprobs) if request.logprobs and new else None
            if delta or logprobs:
                yield chunk(head, delta, logprobs=logprobs)
        response = self._finish_turn(session, request, self._completion(future), prompt_tokens)
        [choice] = response["choices"]
        content = choice["message"]["content"] or ""
        rest = content[len(sent):] if content.startswith(sent) else ""  # content is settled: it extends `sent`
        logprobs = choice["logprobs"]["content"][len(tokens):] if choice["logprobs"] is not None else None
        if rest or logprobs:
            yield chunk(head, {"content": rest} if rest else {}, logprobs=logprobs)
        yield from closing_chunks(response, request.include_usage)
