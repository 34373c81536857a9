"""OpenAI tool calling and streaming on the agent endpoint, driven by the real `openai` client (the shipped
tools= agent, docs/examples/agent/tools_agent.py) against a scripted engine (tests/rollout/test_agent.py's
ScriptedLoop): the replies' tokens, versions and log-probs are the test's, so what is trained is checked exactly."""
import json

import openai
import pytest

from megarl.embedded.tiny_chat import IM_END
from megarl.protocols import Prompt
from tests.rollout.test_agent import ScriptedLoop, agent_that, tok  # noqa: F401  (tok: the fixture)

import tools_agent  # noqa: E402  (on sys.path via tests.rollout.test_agent) the tools= agent shipped with the docs

# A call as the model may write it: compact JSON, keys in its own order. The template re-renders the parsed call as
# '<tool_call>\n{"name": "python", "arguments": {"code": "37*43"}}\n</tool_call>': the text differs, the ids trained
# must be these.
COMPACT_CALL = '<tool_call>{"arguments":{"code":"37*43"},"name":"python"}</tool_call>'
SEQ = 512


class DistinctLogprobs(ScriptedLoop):
    def logprobs(self, ids):
        return [-(len(self.requests) + i / 100) for i in range(len(ids))]


def test_tools_agent_gets_tool_calls_and_trains_on_the_sampled_ids_not_a_rerendering(tok):
    loop = DistinctLogprobs(tok, "tools_agent:run", [COMPACT_CALL, "1591"], max_seq_len=SEQ, max_new_tokens=72)
    [episode] = loop.run(Prompt("37*43", "1591"))
    assert (episode.error, episode.reward, episode.turns) == (None, 1.0, 2)
    first, second = loop.requests
    # The agent's declaration of the python tool (with a description and `required`) as the template renders it.
    assert tok.decode(first.prompt_ids).startswith(
        "<|im_start|>system\n# Tools\n<tools>\npython(code)\n</tools><|im_end|>\n<|im_start|>user\n37*43")
    im_end = tok.convert_tokens_to_ids(IM_END)
    call_ids = tok.encode(COMPACT_CALL, add_special_tokens=False) + [im_end]
    [(start, end)] = episode.env_spans
    assert episode.token_ids[:start] == call_ids  # as sampled, not as the template re-renders the call
    assert tok.decode(episode.token_ids[start:end]) == "<|im_start|>tool\n1591<|im_end|>\n<|im_start|>assistant\n"
    assert episode.versions == [1] * start + [-1] * (end - start) + [2] * (len(episode.token_ids) - end)
    assert episode.logprobs[:start] == [-(1 + i / 100) for i in range(start)]
    assert episode.logprobs[start:end] == [0.0] * (end - start)
    assert second.prompt_ids == episode.prompt_ids + episode.token_ids[:end]
    call = episode.chat.messages[1]["tool_calls"][0]
    assert call["function"] == {"name": "python", "arguments": {"code": "37*43"}}
    assert episode.chat.messages[2] == {"role": "tool", "content": "1591", "tool_call_id": call["id"]}


def test_a_streamed_turn_returns_the_tokens_and_logprobs_of_a_non_streamed_one(tok):
    seen = {}

    def both(base_url, prompt, answer, meta):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        kwargs = dict(model="m", tools=tools_agent.TOOLS, logprobs=True)
        messages = [{"role": "user", "content": prompt}]
        if meta["stream"]:
            chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                         stream_options={"include_usage": True}, **kwargs))
            seen["chunks"] = chunks
            return 0.0
        seen["plain"] = client.chat.completions.create(messages=messages, **kwargs)
        return 0.0

    # Each agent makes one turn; the engine gives both the same tokens and log-probs.
    plain_loop = DistinctLogprobs(tok, agent_that(both), [COMPACT_CALL], max_seq_len=SEQ, max_new_tokens=72)
    [plain_episode] = plain_loop.run(Prompt("37*43", "1591", {"stream": False}))
    assert plain_episode.error is None
    plain = seen["plain"].choices[0]
    assert plain.finish_reason == "tool_calls" and plain.message.content is None
    assert [c.function.name for c in plain.message.tool_calls] == ["python"]
    assert json.loads(plain.message.tool_calls[0].function.arguments) == {"code": "37*43"}
    tokens = [(t.token, t.logprob) for t in plain.logprobs.content]
    assert "".join(t for t, _ in tokens) == COMPACT_CALL + IM_END
    assert [lp for _, lp in tokens] == plain_episode.logprobs

    stream_loop = DistinctLogprobs(tok, agent_that(both), [COMPACT_CALL], max_seq_len=SEQ, max_new_tokens=72)
    [stream_episode] = stream_loop.run(Prompt("37*43", "1591", {"stream": True}))
    chunks = seen["chunks"]
    assert chunks[-1].usage.completion_tokens == len(tokens) and chunks[-1].choices == []
    streamed = [(t.token, t.logprob) for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert streamed == tokens
    [calls] = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert (calls[0].index, calls[0].id, calls[0].function.name, calls[0].function.arguments) == (
        0, plain.message.tool_calls[0].id, "python", plain.message.tool_calls[0].function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert (stream_episode.token_ids, stream_episode.logprobs, stream_episode.versions) == \
        (plain_episode.token_ids, plain_episode.logprobs, plain_episode.versions)


def test_the_streaming_tools_agent_trains_exactly_as_the_plain_one(tok):
    episodes = []
    for agent in ("tools_agent:run", "tools_agent:run_streamed"):
        loop = DistinctLogprobs(tok, agent, [COMPACT_CALL, "1591"], max_seq_len=SEQ, max_new_tokens=72)
        episodes += loop.run(Prompt("37*43", "1591"))
    plain, streamed = episodes
    assert plain.reward == streamed.reward == 1.0
    assert (plain.token_ids, plain.logprobs, plain.versions, plain.env_spans) == \
        (streamed.token_ids, streamed.logprobs, streamed.versions, streamed.env_spans)


def test_a_reply_whose_tool_call_does_not_parse_is_content_and_counted(tok):
    broken = '<tool_call>{"name": "python", "arguments": {"code": </tool_call>'
    loop = ScriptedLoop(tok, "tools_agent:run", [broken], max_seq_len=SEQ, max_new_tokens=72)
    [episode] = loop.run(Prompt("37*43", "1591"))
    assert (episode.error, episode.reward, episode.turns) == (None, 0.0, 1)  # the agent took it as its answer
    assert episode.chat.messages[-1] == {"role": "assistant", "content": broken}
    assert loop.runner.tool_call_parse_failures == 1


def test_bad_tool_calling_input_is_a_400_naming_what_is_wrong(tok):
    seen = {}

    def bad(base_url, prompt, answer, meta):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        user = {"role": "user", "content": prompt}
        call = {"id": "call_9", "type": "function", "function": {"name": "python", "arguments": '{"code": "1+'}}
        cases = {
            "malformed": [user, {"role": "assistant", "content": None, "tool_calls": [call]}],
            "unmatched": [user, {"role": "assistant", "content": "hi"},
                          {"role": "tool", "tool_call_id": "call_7", "content": "2"}],
        }
        for name, messages in cases.items():
            try:
                client.chat.completions.create(model="m", messages=messages, tools=tools_agent.TOOLS)
            except openai.BadRequestError as exc:
                seen[name] = (exc.code, exc.message)
        for name, tools in (("no name", [{"type": "function", "function": {"parameters": {}}}]),
                            ("not a list", {"python": {}})):
            try:
                client.chat.completions.create(model="m", messages=[user], tools=tools)
            except openai.BadRequestError as exc:
                seen[name] = (exc.code, exc.message)
        reply = client.chat.completions.create(model="m", messages=[user], tools=tools_agent.TOOLS).choices[0].message
        try:  # a later request's tools must be the session's
            client.chat.completions.create(model="m", messages=[user, reply.model_dump(exclude_none=True),
                                                                {"role": "user", "content": "more"}])
        except openai.BadRequestError as exc:
            seen["tools changed"] = (exc.code, exc.message)
        return 0.0

    [episode] = ScriptedLoop(tok, agent_that(bad), ["7"], max_seq_len=SEQ).run(Prompt("q", "a"))
    assert episode.error is None and episode.turns == 1
    assert seen["malformed"][0] == "invalid_messages" and \
        "messages[1].tool_calls[0].function.arguments are malformed JSON" in seen["malformed"][1]
    assert seen["unmatched"][0] == "invalid_messages" and "messages[2] (role tool) answers tool_call_id 'call_7', " \
        "which matches no unanswered call" in seen["unmatched"][1]
    assert seen["no name"][0] == "invalid_tools" and "tools[0].function.name must be a non-empty string" in seen["no name"][1]
    assert seen["not a list"][0] == "invalid_tools"
    assert seen["tools changed"][0] == "invalid_tools"


def test_a_template_that_renders_no_tools_or_fails_on_them_refuses_tools_with_a_400(tok):
    from transformers import PreTrainedTokenizerFast

    seen = {}

    def asks_with_tools(base_url, prompt, answer, meta):
        try:
            openai.OpenAI(base_url=base_url, api_key="x", max_retries=0).chat.completions.create(
                model="m", messages=[{"role": "user", "content": prompt}], tools=tools_agent.TOOLS)
        except openai.BadRequestError as exc:
            seen[meta["case"]] = (exc.code, exc.message)
        return 0.0

    plain = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token=IM_END)
    plain.chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    failing = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token=IM_END)
    failing.chat_template = tok.chat_template.replace("{% if tools %}", "{% if tools %}{{ raise_exception("
                                                      "'tools need a description') }}")
    for case, tokenizer in (("plain", plain), ("failing", failing)):
        ScriptedLoop(tokenizer, agent_that(asks_with_tools), []).run(Prompt("q", "a", {"case": case}))
    assert seen["plain"][0] == "unsupported_parameter" and "renders no tools" in seen["plain"][1]
    assert seen["failing"][0] == "invalid_messages" and \
        "chat template cannot render these tools and messages" in seen["failing"][1] and \
        "tools need a description" in seen["failing"][1]
