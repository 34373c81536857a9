"""The wire format: round trips of every field kind (the ndarray kind MoE routes will use included), and
what decoding refuses."""
import dataclasses
import hashlib
import hmac
import math
import struct

import msgpack
import numpy as np
import pytest

from megarl.distributed import wire
from megarl.distributed.wire import (GROUP, HEADER, NDARRAY, SAMPLE_FIELDS, Field, WireError, decode_group, sample_problem,
                                     decode_plan, encode_group, encode_plan)
from megarl.protocols import GenerationRequest, Sample, SamplingParams

KEY = b"k" * 32
SESSION = b"s" * 8


def sample(**changes) -> Sample:
    base = Sample(group_id="s1-g1", prompt="2+2=", completion="4 é", prompt_ids=[1, 2, 3], token_ids=[4, 5, 6, 7],
                  logprobs=[-0.25, -1e-9, 0.0, -3.5], versions=[2, -1, -1, 3], reward=0.75, finish_reason="stop",
                  sampler_rank=3, reward_error=None, env_spans=[(1, 3)], turns=2)
    return dataclasses.replace(base, **changes)


def roundtrip(group, stats=None, key=KEY):
    return decode_group(encode_group(group, stats or {}, SESSION, 3, 0, KEY), key)


def test_a_group_and_its_stats_round_trip_exactly():
    group = [sample(source="gsm8k/é", reward_parts='{"exact": {"score": 1.0, "weight": 0.5}, "format": null}'),
             sample(reward_error="boom", env_spans=[], turns=1, token_ids=[], logprobs=[], versions=[])]
    envelope, back, stats = roundtrip(group, {"tokens_per_s": 12.5, "swaps": 3})
    assert back == group
    assert stats == {"tokens_per_s": 12.5, "swaps": 3.0}
    assert (envelope.kind, envelope.session, envelope.sender, envelope.sequence) == (GROUP, SESSION, 3, 0)
    assert isinstance(back[0].env_spans[0], tuple)


def test_every_sample_attribute_is_in_the_schema_table():
    assert {f.name for f in SAMPLE_FIELDS} == {f.name for f in dataclasses.fields(Sample)}


@dataclasses.dataclass
class Routed:
    routes: np.ndarray | None


@pytest.mark.parametrize("dtype", ["uint8", "int16", "int32"])
def test_ndarray_fields_keep_dtype_and_shape(dtype):
    fields = (Field("routes", NDARRAY, dtypes=("uint8", "int16", "int32"), ndim=3, optional=True),)
    routes = np.arange(5 * 4 * 2, dtype=dtype).reshape(5, 4, 2)
    arrays = wire._Arrays()
    raw = msgpack.unpackb(msgpack.packb(wire.encode_records([Routed(routes), Routed(None)], fields, arrays)))
    reader = wire._ArrayReader(memoryview(b"".join(arrays.buffers)))
    back = [r["routes"] for r in wire.decode_records(raw, fields, reader, "routed")]
    reader.finish()
    assert back[0].dtype == np.dtype(dtype) and back[0].shape == (5, 4, 2) and (back[0] == routes).all()
    assert back[1] is None
    with pytest.raises(WireError, match="not one of"):
        wire.encode_records([Routed(routes.astype("int64"))], fields, wire._Arrays())
    # A receiver refuses a dtype or rank outside the declaration.
    for bad in (["<i8", [5, 4, 2]], ["<i2", [40]]):
        with pytest.raises(WireError):
            wire.decode_records({"count": 1, "columns": {"routes": [bad]}}, fields,
                                wire._ArrayReader(memoryview(bytes(320))), "routed")


def test_a_group_carries_moe_routes_one_row_per_input_position():
    routes = np.arange(5 * 2 * 2, dtype="uint8").reshape(5, 2, 2)  # 2 prompt + 4 completion tokens: 5 inputs
    sample = Sample(group_id="s0-g0", prompt="p", completion="c", prompt_ids=[1, 2], token_ids=[3, 4, 5, 6],
                    logprobs=[-0.5] * 4, versions=[0] * 4, reward=1.0, finish_reason="stop", routes=routes)
    _, [back], _ = decode_group(encode_group([sample], {}, bytes(8), 0, 1, KEY), KEY)
    assert back.routes.dtype == np.uint8 and (back.routes == routes).all()
    short = dataclasses.replace(sample, routes=routes[:4])
    with pytest.raises(WireError, match="routes hold 4 positions, the sample has 5"):
        decode_group(encode_group([short], {}, bytes(8), 0, 1, KEY), KEY)


def test_a_tp_plan_round_trips():
    requests = [GenerationRequest("r1", [1, 2, 3], SamplingParams(0.7, 0.9, 5, 16), (0, 2)),
                GenerationRequest("r2", [], SamplingParams())]
    envelope, back, version, stop = decode_plan(encode_plan(requests, 4, False, 7, KEY), KEY)
    assert back == requests and version == 4 and not stop and envelope.sequence == 7
    assert decode_plan(encode_plan([], None, True, 8, KEY), KEY)[1:] == ([], None, True)


def reseal(message: bytes, meta=None, body: bytes | None = None, version: int | None = None) -> bytes:
    """`message` with its metadata / arrays / version replaced, tagged with the right key (a peer that has the
    secret but sends nonsense)."""
    fields = list(HEADER.unpack_from(message))
    old_meta = message[HEADER.size:HEADER.size + fields[-1]]
    old_body = message[HEADER.size + fields[-1]:-32]
    packed = msgpack.packb(meta) if meta is not None else old_meta
    fields[-1] = len(packed)
    if version is not None:
        fields[1] = version
    out = HEADER.pack(*fields) + packed + (old_body if body is None else body)
    return out + hmac.new(KEY, out, hashlib.sha256).digest()


def meta_of(message: bytes) -> dict:
    return msgpack.unpackb(message[HEADER.size:HEADER.size + HEADER.unpack_from(message)[-1]])


def column(m: dict, name: str):
    return m["samples"]["columns"][name]


@pytest.mark.parametrize("change, error", [
    (lambda m: column(m, "reward").__setitem__(0, math.nan), "finite float"),
    (lambda m: column(m, "reward").__setitem__(0, "1.0"), "finite float"),
    (lambda m: column(m, "turns").__setitem__(0, 1.5), "expected an int"),
    (lambda m: column(m, "prompt").__setitem__(0, b"bytes"), "expected a str"),
    (lambda m: m["samples"]["columns"].pop("turns"), "missing \\['turns'\\]"),
    (lambda m: m["samples"]["columns"].update(extra=[1]), "unknown \\['extra'\\]"),
    (lambda m: m["samples"].update(count=2), "expected a list of 2 values"),
    (lambda m: column(m, "token_ids").update(data=["<i8", [50]]), "declares 400 bytes"),
    (lambda m: column(m, "token_ids").update(lengths=[3]), "lengths sum to 3, the data holds 4"),
    (lambda m: column(m, "token_ids").update(lengths=[-1]), "ints >= 0"),
    (lambda m: column(m, "logprobs").update(data=["<f4", [4]]), "dtype '<f4'"),
    (lambda m: m.update(stats={"x": "y"}), "finite numbers"),
    (lambda m: m.update(extra=1), "metadata keys"),
])
def test_malformed_metadata_from_a_peer_with_the_secret_is_refused(change, error):
    message = encode_group([sample()], {}, SESSION, 3, 0, KEY)
    meta = meta_of(message)
    change(meta)
    with pytest.raises(WireError, match=error):
        decode_group(reseal(message, meta), KEY)


@pytest.mark.parametrize("changes, error", [
    (dict(versions=[1, 2, 3]), "differ in length"),
    (dict(env_spans=[(3, 5)]), "env_spans"),
    (dict(env_spans=[(2, 2)]), "env_spans"),
    (dict(env_spans=[(2, 3), (0, 1)]), "env_spans"),
    (dict(token_ids=[4, -5, 6, 7]), "token_ids: holds -5, below 0"),
    (dict(prompt_ids=[-1]), "prompt_ids: holds -1, below 0"),
    (dict(versions=[2, -2, -1, 3]), "holds -2, below -1"),
    (dict(turns=0), "turns: 0, below 1"),
    (dict(reward_parts='{"exact": 1.0}'), "reward_parts: expected an object"),
    (dict(reward_parts='{"exact": {"score": NaN, "weight": 1}}'), "reward_parts: not JSON"),
    (dict(reward_parts='{"exact": {"score": 1, "weight": 1, "x": 2}}'), "reward_parts: expected an object"),
    (dict(reward_parts='[1]'), "reward_parts: expected an object"),
    (dict(reward_parts="{" * 20000), "reward_parts: 20000 characters"),
])
def test_inconsistent_samples_are_refused(changes, error):
    with pytest.raises(WireError, match=error):
        roundtrip([sample(**changes)])
    # The sender's check is the receiver's: the sampler drops what the learner would refuse, naming the same thing.
    assert error in sample_problem(sample(**changes))


def test_the_sender_check_passes_what_the_receiver_accepts_and_names_an_agent_episode_without_turns():
    assert sample_problem(sample()) is None
    roundtrip([sample()])
    failed = sample(prompt_ids=[], token_ids=[], logprobs=[], versions=[], turns=0, reward=0.0,
                    reward_error="agent x:run: RuntimeError: boom")  # raised before its first request
    assert sample_problem(failed) == "turns: 0, below 1"
    assert "not finite" in sample_problem(sample(reward=math.inf))


def test_a_diverged_policys_nan_logprobs_reach_the_learner_whose_nonfinite_rule_stops_the_run():
    _, [back], _ = roundtrip([sample(logprobs=[-0.1, math.nan, -math.inf, 0.0])])
    assert math.isnan(back.logprobs[1]) and back.logprobs[2] == -math.inf


def test_an_empty_group_is_refused():
    with pytest.raises(WireError, match="at least one sample"):
        roundtrip([])


def test_a_group_mixing_groups_or_samplers_is_refused():
    with pytest.raises(WireError, match="differ from the first sample"):
        roundtrip([sample(), sample(group_id="s1-g2")])
    with pytest.raises(WireError, match="differ from the first sample"):
        roundtrip([sample(), sample(sampler_rank=4)])


def test_framing_errors():
    message = encode_group([sample()], {}, SESSION, 3, 0, KEY)
    with pytest.raises(WireError, match="authentication failed"):
        decode_group(message, b"another key")
    with pytest.raises(WireError, match="not a megarl message"):
        decode_group(b"\x80\x05" + message[2:], KEY)
    with pytest.raises(WireError, match="version 2, this megarl speaks 1"):
        decode_group(reseal(message, version=2), KEY)
    with pytest.raises(WireError, match="shorter than a header"):
        decode_group(b"MRL\x00", KEY)
    with pytest.raises(WireError, match="after the last declared array"):
        decode_group(reseal(message, body=message[HEADER.size + HEADER.unpack_from(message)[-1]:-32] + b"x"), KEY)
    with pytest.raises(WireError, match="expected 2"):  # a group is not a plan
        decode_plan(message, KEY)
    with pytest.raises(WireError, match="extension type"):
        decode_group(reseal(message, meta=msgpack.ExtType(1, b"x")), KEY)
    with pytest.raises(WireError, match="not valid msgpack"):
        fields = list(HEADER.unpack_from(message))
        fields[-1] = 1
        broken = HEADER.pack(*fields) + b"\xc1"
        decode_group(broken + hmac.new(KEY, broken, hashlib.sha256).digest(), KEY)
    assert struct.calcsize("<4sHBB8sIQI") == HEADER.size == 32


@pytest.mark.parametrize("count", [2**63, 30_000_000])
def test_a_declared_record_count_is_checked_against_the_message_before_any_allocation(count):
    import tracemalloc
    message = encode_group([sample()], {}, SESSION, 3, 0, KEY)
    meta = meta_of(message)
    meta["samples"]["count"] = count
    forged = reseal(message, meta)
    assert len(forged) < 1000
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match=f"expected a list of {count} values"):
            decode_group(forged, KEY)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000  # a record dict per declared count would be gigabytes


@pytest.mark.parametrize("changes, error", [
    (dict(group_id="rt"), "not a megarl group id: 'rt'"),
    (dict(group_id="s1-g"), "not a megarl group id"),
    (dict(sampler_rank=-3), "sampler_rank: -3, below 0"),
])
def test_fields_the_learner_parses_are_validated_on_the_wire(changes, error):
    with pytest.raises(WireError, match=error):
        roundtrip([sample(**changes)])



def test_token_ids_beyond_the_models_vocabulary_are_refused_when_the_receiver_knows_it():
    message = encode_group([sample(token_ids=[4, 5, 6, 700])], {}, SESSION, 3, 0, KEY)
    assert decode_group(message, KEY)[1][0].token_ids == [4, 5, 6, 700]  # no model given: no bound
    with pytest.raises(WireError, match="token_ids holds 700, not below the model's vocab_size 700"):
        decode_group(message, KEY, vocab_size=700)
    with pytest.raises(WireError, match="prompt_ids holds 3, not below the model's vocab_size 3"):
        decode_group(encode_group([sample(token_ids=[1, 2, 0, 1])], {}, SESSION, 3, 0, KEY), KEY, vocab_size=3)
    assert decode_group(message, KEY, vocab_size=701)[1][0].token_ids[-1] == 700
