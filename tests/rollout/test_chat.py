"""ChatTranscript: a conversation kept as messages and as the exact ids the engine saw and produced."""
import pytest

from megarl.embedded.tiny import build_tokenizer
from megarl.embedded.tiny_chat import IM_END, build_chat_tokenizer
from megarl.rollout.chat import ChatFormatError, ChatTranscript
from megarl.rollout.environment import PYTHON_TOOL_SCHEMA


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


def render(tok, messages, generation_prompt):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def test_the_opening_is_the_rendered_chat_with_the_generation_prompt(tok):
    chat = ChatTranscript(tok, [{"role": "user", "content": "37*43"}])
    assert chat.text == "<|im_start|>user\n37*43<|im_end|>\n<|im_start|>assistant\n"
    assert chat.ids == tok.encode(chat.text, add_special_tokens=False)


def test_the_tools_block_holds_each_tools_signature_whatever_else_its_declaration_says(tok):
    """The embedded template renders a tool as its name and parameter names, so megarl's own declaration of the python
    tool, an agent's with a description, and an MCP server's (verifiers: title, required) read alike to the model."""
    user = [{"role": "user", "content": "37*43"}]
    mcp = {"type": "function", "function": {"name": "python", "description": "Run Python code.", "parameters": {
        "type": "object", "properties": {"code": {"title": "Code", "type": "string"}}, "required": ["code"],
        "title": "pythonArguments"}}}
    bare = {"name": "now"}  # no "function" wrapper, no parameters
    rendered = [tok.apply_chat_template(user, tools=tools, tokenize=False, add_generation_prompt=True)
                for tools in ([PYTHON_TOOL_SCHEMA], [mcp], [mcp, bare])]
    assert rendered[0] == rendered[1] == ("<|im_start|>system\n# Tools\n<tools>\npython(code)\n</tools><|im_end|>\n"
                                          "<|im_start|>user\n37*43<|im_end|>\n<|im_start|>assistant\n")
    assert rendered[2].startswith("<|im_start|>system\n# Tools\n<tools>\npython(code)\nnow()\n</tools>")


def test_turns_extend_the_ids_and_the_whole_reads_as_the_template_renders_it(tok):
    im_end = tok.convert_tokens_to_ids(IM_END)
    chat = ChatTranscript(tok, [{"role": "user", "content": "37*43"}])
    opening = list(chat.ids)
    call = tok.encode(">>> 37*43", add_special_tokens=False) + [im_end]
    assert chat.add_model_turn(call, (im_end,)) == ">>> 37*43"
    added = chat.add_messages([{"role": "tool", "content": "1591"}])
    assert chat.ids == opening + call + added  # only ever appended to
    assert tok.decode(added) == "\n<|im_start|>tool\n1591<|im_end|>\n<|im_start|>assistant\n"
    assert chat.messages[-2:] == [{"role": "assistant", "content": ">>> 37*43"}, {"role": "tool", "content": "1591"}]
    assert tok.decode(chat.ids) == render(tok, chat.messages, True)


def test_model_tokens_are_kept_as_sampled_never_retokenised(tok):
    """A lone UTF-8 lead byte decodes to U+FFFD, which re-encodes as three other bytes: the ids must still be
    the ones sampled (their log-probs were recorded for exactly those)."""
    im_end = tok.convert_tokens_to_ids(IM_END)
    chat = ChatTranscript(tok, [{"role": "user", "content": "hi"}])
    start = len(chat.ids)
    turn = [0xE2, ord("x"), im_end]
    chat.add_model_turn(turn, (im_end,))
    assert tok.encode(chat.messages[-1]["content"], add_special_tokens=False) != turn[:2]
    chat.add_messages([{"role": "user", "content": "again"}])
    assert chat.ids[start:start + len(turn)] == turn


def test_a_turn_cut_before_its_end_marker_still_gets_the_template_s_framing(tok):
    chat = ChatTranscript(tok, [{"role": "user", "content": "hi"}])
    chat.add_model_turn(tok.encode("abc", add_special_tokens=False))  # no <|im_end|>: cut at a length limit
    added = chat.add_messages([{"role": "user", "content": "go on"}])
    assert tok.decode(added) == "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"


def test_without_a_chat_template_a_conversation_is_plain_text():
    tok = build_tokenizer()
    chat = ChatTranscript(tok, [{"role": "user", "content": "12+7="}])
    assert chat.ids == tok.encode("12+7=", add_special_tokens=False)
    chat.add_model_turn(tok.encode("19", add_special_tokens=False))
    assert tok.decode(chat.add_messages([{"role": "user", "content": " ok?"}])) == " ok?"


def test_extend_to_returns_the_new_messages_and_refuses_a_changed_history(tok):
    im_end = tok.convert_tokens_to_ids(IM_END)
    chat = ChatTranscript(tok, [{"role": "user", "content": "37*43"}])
    chat.add_model_turn(tok.encode(">>> 37*43", add_special_tokens=False) + [im_end], (im_end,))
    history = [{"role": "user", "content": "37*43"}, {"role": "assistant", "content": ">>> 37*43"}]
    new = [{"role": "tool", "content": "1591"}]
    assert chat.extend_to(history + new) == new
    with pytest.raises(ChatFormatError, match="message 1 differs"):
        chat.extend_to([history[0], {"role": "assistant", "content": "edited"}] + new)
    with pytest.raises(ChatFormatError, match="shorter"):
        chat.extend_to(history[:1])
    with pytest.raises(ChatFormatError, match=r"messages\[2\].content must be a string"):
        chat.extend_to(history + [{"role": "tool"}])
