"""The tool-call parsers per template family, the family picked from a template, and the history checks."""
import pytest

from megarl.rollout.tool_calls import (ParsedReply, ToolCall, ToolCallParseError, ToolMessageError, check_history,
                                       family_of, parse_harmony, parse_hermes, parse_llama3, parser_for,
                                       settled_content)


def test_hermes_reads_calls_and_the_text_before_them():
    text = 'Let me run it.\n<tool_call>\n{"name": "python", "arguments": {"code": "1+1"}}\n</tool_call>\n' \
           '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert parse_hermes(text) == ParsedReply("Let me run it.", (ToolCall("python", {"code": "1+1"}),
                                                                 ToolCall("f", {"x": 1})))
    assert parse_hermes("1591") is None
    for bad, why in (('<tool_call>{"name": "f", "arguments": {</tool_call>', "does not parse"),
                     ('<tool_call>{"name": "f"', "without its </tool_call>"),
                     ('<tool_call>{"arguments": {}}</tool_call>', "string 'name'"),
                     ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "must be a JSON object")):
        with pytest.raises(ToolCallParseError, match=why):
            parse_hermes(bad)


def test_llama3_reads_json_calls_with_or_without_the_python_tag():
    assert parse_llama3('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}') == \
        ParsedReply("", (ToolCall("f", {"a": 1}), ToolCall("g", {})))
    assert parse_llama3('{"name": "f", "parameters": {"a": 1}}').calls == (ToolCall("f", {"a": 1}),)
    assert parse_llama3("The answer is 4.") is None
    with pytest.raises(ToolCallParseError):
        parse_llama3('<|python_tag|>{"name": "f", "parameters": ')


def test_harmony_reads_messages_addressed_to_functions():
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
    assert parse_harmony(text) == ParsedReply("", (ToolCall("get_weather", {"city": "Paris"}),))
    assert parse_harmony("<|channel|>final<|message|>Sunny.<|return|>") is None
    with pytest.raises(ToolCallParseError):
        parse_harmony("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops<|call|>")


def test_the_family_comes_from_the_template_and_config_overrides_it():
    assert family_of("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert family_of("{% if tools %}<|python_tag|>{% endif %}") == "llama3"
    assert family_of("{% if tools %}<|channel|>{% endif %}") == "harmony"
    assert family_of("{{ messages }}") is None and family_of(None) is None

    class Tok:
        chat_template = "{{ messages }}"

    assert parser_for(Tok(), "auto") == (None, None)
    assert parser_for(Tok(), "hermes")[0] == "hermes" and parser_for(Tok(), "none") == (None, None)
    with pytest.raises(ValueError, match="task.tool_parser"):
        parser_for(Tok(), "qwen")


def test_history_checks_name_the_message_that_is_wrong():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    user, calls = {"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [call]}
    check_history([user, calls, {"role": "tool", "tool_call_id": "c1", "content": "ok"}])
    check_history([user, {"role": "assistant", "content": ">>> 1+1"}, {"role": "tool", "content": "2"}])  # text
    for messages, why in (
            ([user, calls, {"role": "tool", "tool_call_id": "c2", "content": "x"}], r"messages\[2\].*'c2'"),
            ([user, calls, {"role": "tool", "content": "x"}], r"messages\[2\].*no tool_call_id"),
            ([user, calls, {"role": "tool", "tool_call_id": "c1", "content": "x"},
              {"role": "tool", "tool_call_id": "c1", "content": "x"}], r"messages\[3\].*no unanswered"),
            ([user, dict(calls, tool_calls=[dict(call, function={"name": "f", "arguments": "{"})])],
             r"messages\[1\].tool_calls\[0\].function.arguments are malformed JSON")):
        with pytest.raises(ToolMessageError, match=why):
            check_history(messages)


@pytest.mark.parametrize("parser, text, settled", [
    (None, "The answer is 1591.\n", "The answer is 1591."),  # trailing whitespace waits for what follows
    (None, "caf\ufffd", "caf"),  # an incomplete UTF-8 character waits
    (None, "a <b> c", "a <b> c"),  # without tool parsing every character is content
    ("hermes", "Let me compute. <tool", "Let me compute."),  # a possible marker and what follows wait
    ("hermes", "  \n", ""),  # leading whitespace waits for text
    ("harmony", "<|channel|>final<|message|>1591", ""),  # every harmony reply starts with a marker
    ("llama3", ' {"name": "python"', ""),  # may be a call
    ("llama3", "It is 1591", "It is 1591"),
])
def test_settled_content_is_what_no_later_token_can_take_back(parser, text, settled):
    assert settled_content(parser, text) == settled
