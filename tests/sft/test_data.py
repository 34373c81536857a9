"""SFT records -> token ids and loss masks (pure): both formats, the chat template's assistant spans, every
refusal naming FILE:LINE, skipping and counting, the held-out split and the batch order."""
import json

import pytest

from megarl.embedded.tiny import EOS_ID, build_tokenizer
from megarl.sft.data import (BadRecord, SFTDataError, batch_order, collate, load_records, num_steps,
                             render_messages, render_prompt_completion, split_heldout)

# A Qwen-style template on the embedded tokenizer's spare specials: <|reserved_0|> opens a turn, the EOS
# closes it, a newline follows.
TEMPLATE = ("{% for m in messages %}<|reserved_0|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|reserved_0|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    t = build_tokenizer()
    t.chat_template = TEMPLATE
    return t


def trained_text(tokenizer, ids, mask) -> list[str]:
    """The trained runs of tokens, decoded (special tokens written out)."""
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]


def write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_prompt_completion_trains_the_completion_and_eos_encoded_as_the_sampler_does(tok):
    ids, mask = render_prompt_completion(tok, "kqzd<", "dzqk")
    prompt = tok.encode("kqzd<", add_special_tokens=False)
    assert ids == prompt + tok.encode("dzqk", add_special_tokens=False) + [EOS_ID]
    assert mask == [0] * len(prompt) + [1] * 5
    assert trained_text(tok, ids, mask) == ["dzqk<|endoftext|>"]


def test_messages_train_each_assistant_turn_through_its_eos_and_nothing_else(chat_tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "a last turn trains nothing"}]
    ids, mask = render_messages(chat_tok, messages)
    assert trained_text(chat_tok, ids, mask) == ["yo<|endoftext|>", "4<|endoftext|>"]
    # The ids are the template's text, span by span, and end with the last trained token (the trailing user
    # turn and the newline after the last EOS are dropped).
    text = chat_tok.apply_chat_template(messages[:5], tokenize=False)
    assert chat_tok.decode(ids, skip_special_tokens=False) == text.removesuffix("\n")
    # Each generation prompt ("<|reserved_0|>assistant\n") and the newline after an EOS are context.
    first = chat_tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert mask[:len(chat_tok.encode(first))] == [0] * len(chat_tok.encode(first))
    assert ids[mask.index(1) + 2] == EOS_ID and mask[mask.index(1) + 3] == 0


def test_messages_without_a_chat_template_name_the_directory_files_and_key(tok, tmp_path):
    with pytest.raises(SFTDataError) as err:
        render_messages(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tmp_path)
    msg = str(err.value)
    assert str(tmp_path / "chat_template.jinja") in msg and str(tmp_path / "tokenizer_config.json") in msg
    assert "'chat_template' key" in msg


def test_a_template_whose_assistant_turn_lacks_the_eos_is_refused_as_a_whole(tmp_path):
    t = build_tokenizer()
    t.chat_template = TEMPLATE.replace("<|endoftext|>", "<|reserved_1|>")
    path = write(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "yo"}]}])
    with pytest.raises(SFTDataError, match=r"chat\.jsonl:1: the chat template ends an assistant turn without the "
                                           r"tokenizer's eos_token \('<\|endoftext\|>'\)"):
        load_records(path, t, 128, on_bad_row="skip")  # not a bad row: skipping cannot help


def test_a_template_that_rewrites_earlier_turns_is_a_bad_record(tmp_path):
    t = build_tokenizer()  # drops every assistant turn but the last, as thinking templates drop old reasoning
    t.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|reserved_0|>"
                       "{{ m['content'] }}<|endoftext|>{% endif %}{% endfor %}"
                       "{% if add_generation_prompt %}<|reserved_0|>{% endif %}")
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(BadRecord, match="does not render this conversation as a prefix of itself at message 1"):
        render_messages(t, messages)


BAD_LINES = [
    ("", "empty line"),
    ("{not json", "not valid JSON"),
    ('{"prompt": "ab<\\udfff", "completion": "ba"}', "holds a lone surrogate"),
    ("[" * 100_000 + "]" * 100_000, "nested too deep to read"),
    ("[1, 2]", "expected a JSON object with 'prompt' and 'completion', or 'messages'; got list"),
    ({"prompt": "ab<", "answer": "ba"}, "missing key 'completion': expected 'prompt' and 'completion', or 'messages' "
                                        "(the record has ['answer', 'prompt'])"),
    ({"text": "x"}, "missing key 'completion' and 'prompt'"),
    ({"prompt": "ab<", "completion": 7}, "'completion' must be a non-empty string, got int 7"),
    ({"prompt": "", "completion": "ba"}, "'prompt' must be a non-empty string"),
    ({"messages": [], "prompt": "x"}, "has both 'messages' and 'prompt'"),
    ({"messages": "hi"}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, "message 0 must be an object with string 'role' and 'content'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message: nothing to train"),
]


@pytest.mark.parametrize("line, message", BAD_LINES, ids=[m[:30] for _, m in BAD_LINES])
def test_a_bad_line_is_named_by_file_and_line(line, message, chat_tok, tmp_path):
    path = write(tmp_path / "d.jsonl", [{"prompt": "ab<", "completion": "ba"}, line])
    with pytest.raises(BadRecord) as err:
        load_records(path, chat_tok, 128)
    assert str(err.value).startswith(f"{path}:2: ") and message in str(err.value)
    assert str(err.value).endswith("(sft.on_bad_row=skip skips such lines)")


def test_bad_lines_and_overlong_records_can_be_skipped_and_are_counted(tok, tmp_path):
    (tmp_path / "d.jsonl").write_bytes(b'{"prompt": "ab<", "completion": "ba"}\n\xff\xfe\n\n'
                                       b'{"prompt": "abcdefgh<", "completion": "hgfedcba"}\n{"prompt": "x"}\n')
    records = load_records(tmp_path / "d.jsonl", tok, 12, on_bad_row="skip", on_overlong="skip")
    assert [e.where for e in records.examples] == [f"{tmp_path / 'd.jsonl'}:1"]
    assert (records.bad_rows, records.overlong) == (3, 1)
    assert records.first_bad_row.startswith(f"{tmp_path / 'd.jsonl'}:2: not UTF-8")
    assert records.first_overlong == f"{tmp_path / 'd.jsonl'}:4: 18 tokens, longer than the context of 12 (sft.max_seq_len)"
    summary = records.summary()
    assert "1 records (1 prompt/completion), 3 trained tokens; 3 bad lines skipped (first: " in summary
    assert "; 1 overlong records skipped (first: " in summary


def test_an_overlong_record_is_refused_naming_the_key_by_default(tok, tmp_path):
    path = write(tmp_path / "d.jsonl", [{"prompt": "abcdefgh<", "completion": "hgfedcba"}])
    with pytest.raises(BadRecord, match=r"d\.jsonl:1: 18 tokens, longer than the context of 12 \(sft\.max_seq_len\) "
                                        r"\(sft\.on_overlong=skip skips such records\)"):
        load_records(path, tok, 12)


def test_a_missing_empty_or_wholly_skipped_file_is_an_error(tok, tmp_path):
    with pytest.raises(SFTDataError, match="nope.jsonl: file not found"):
        load_records(tmp_path / "nope.jsonl", tok, 128)
    with pytest.raises(SFTDataError, match=r"empty.jsonl: no usable records \(the file is empty\)"):
        load_records(write(tmp_path / "empty.jsonl", []), tok, 128)
    with pytest.raises(SFTDataError, match=r"no usable records: 1 bad lines \(first: .*bad.jsonl:1: not valid JSON"):
        load_records(write(tmp_path / "bad.jsonl", ["{"]), tok, 128, on_bad_row="skip")


def test_heldout_split_order_and_batches(tok):
    examples = [type("E", (), {"i": i})() for i in range(20)]
    train, held = split_heldout(examples, 0.1, seed=3)
    assert len(held) == 2 and len(train) == 18 and {e.i for e in train} | {e.i for e in held} == set(range(20))
    assert [e.i for e in split_heldout(examples, 0.1, seed=3)[1]] == [e.i for e in held]  # the seed decides
    assert split_heldout(examples, 0.0, 0) == (examples, []) and len(split_heldout(examples[:3], 0.01, 0)[1]) == 1
    assert num_steps(20, 8, 2.0, 0) == 5 and num_steps(20, 8, 2.0, 7) == 7
    order = batch_order(20, 8, 5, seed=0)
    flat = [i for b in order for i in b]
    assert all(len(b) == 8 for b in order) and sorted(flat[:20]) == list(range(20)) == sorted(flat[20:40])
    assert flat[:20] != flat[20:40]  # each epoch its own permutation


def test_collate_pads_and_masks(tok):
    from megarl.sft.data import Example

    batch = collate([Example([1, 2, 3], [0, 1, 1], "a:1"), Example([4, 5], [0, 1], "a:2")], pad_id=9, learner_version=3)
    assert batch.input_ids.tolist() == [[1, 2, 3], [4, 5, 9]]
    assert batch.loss_mask.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert batch.versions.tolist() == [[-1, 3, 3], [-1, 3, -1]] and batch.learner_version == 3
    assert batch.advantages.abs().sum() == 0 and batch.behaviour_logprobs.abs().sum() == 0
