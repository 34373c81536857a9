"""The wire format of every message megarl sends between its own processes (never pickle).

A message is

    header (32 bytes, little-endian)  | metadata (msgpack)  | array buffers  | tag (32 bytes)
    magic  b"MRL\\x00"        4 bytes
    format version  (u16)     FORMAT_VERSION; any other version is refused
    kind            (u8)      GROUP (a sample group + sampler stats) or PLAN (a TP engine's step plan)
    flags           (u8)      0
    session         (8 bytes) the receiver's nonce (the queue publishes it with its address): a message
                              recorded in another run, or another attempt of this one, is refused
    sender          (u32)     the claimed sender (sampler global rank; the TP lead: 0)
    sequence        (u64)     strictly increasing per (session, sender): a replayed message is refused
    metadata length (u32)
    metadata        msgpack map (str keys; no ext types); arrays appear in it as [dtype, shape]
    arrays          raw little-endian buffers, concatenated in the order their descriptors appear in the
                    metadata; their total size must equal what the descriptors declare
    tag             HMAC-SHA256(run secret, header + metadata + arrays)

The tag is checked before anything else is parsed, so nothing from a process without the run secret
reaches the msgpack parser. Records are encoded from a schema table: one `Field` per attribute (name,
kind, dtype set, ndim, whether it may be None). `SAMPLE_FIELDS` is Sample's table; a new Sample field
is one new line there. Decoding validates types, dtypes, shapes and the cross-field invariants
(`check_sample`); anything that fails raises `WireError` naming what failed.
"""
from __future__ import annotations

import hashlib
import hmac
import math
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from megarl.protocols import GenerationRequest, Sample, SamplingParams

MAGIC = b"MRL\x00"
FORMAT_VERSION = 1
GROUP, PLAN = 1, 2
KINDS = {GROUP: "sample group", PLAN: "TP step plan"}
HEADER = struct.Struct("<4sHBB8sIQI")
TAG_BYTES = 32

# Field kinds. List kinds travel as raw arrays of a fixed dtype and come back as Python lists (what
# Sample holds); NDARRAY fields come back as numpy arrays of one of their declared dtypes.
INT, FLOAT, STR, OPT_STR, INT_LIST, FLOAT_LIST, SPAN_LIST, NDARRAY = (
    "int", "float", "str", "optional str", "list[int]", "list[float]", "list[(int,int)]", "ndarray")
LIST_LAYOUT = {INT_LIST: ("<i8", 1), FLOAT_LIST: ("<f8", 1), SPAN_LIST: ("<i8", 2)}


class WireError(ValueError):
    """A message that is not a valid megarl message (unauthenticated, malformed, or inconsistent)."""


@dataclass(frozen=True)
class Field:
    name: str
    kind: str
    dtypes: tuple[str, ...] = ()  # NDARRAY only: the accepted dtypes (numpy names, sent little-endian)
    ndim: int = 0  # NDARRAY only
    optional: bool = False  # NDARRAY only: may be None (OPT_STR is always optional)


# Sample's schema: every attribute that travels, in one place (docs/security.md#the-wire-format).
SAMPLE_FIELDS: tuple[Field, ...] = (
    Field("group_id", STR),
    Field("prompt", STR),
    Field("completion", STR),
    Field("prompt_ids", INT_LIST),
    Field("token_ids", INT_LIST),
    Field("logprobs", FLOAT_LIST),
    Field("versions", INT_LIST),
    Field("reward", FLOAT),
    Field("finish_reason", STR),
    Field("sampler_rank", INT),
    Field("reward_error", OPT_STR),
    Field("env_spans", SPAN_LIST),
    Field("turns", INT),
)

SAMPLING_FIELDS: tuple[Field, ...] = (
    Field("temperature", FLOAT), Field("top_p", FLOAT), Field("top_k", INT), Field("max_new_tokens", INT))
REQUEST_FIELDS: tuple[Field, ...] = (
    Field("request_id", STR), Field("prompt_ids", INT_LIST), Field("stop_token_ids", INT_LIST))


# ---------------------------------------------------------------------------------------------- records
class _Arrays:
    """Collects the array buffers of one message while its metadata is built (encode side)."""

    def __init__(self):
        self.buffers: list[bytes] = []

    def add(self, array: np.ndarray) -> list:
        array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        self.buffers.append(array.tobytes())
        return [array.dtype.str, list(array.shape)]


class _ArrayReader:
    """Hands out the array buffers of one message in descriptor order, checking every descriptor (decode side)."""

    def __init__(self, body: memoryview):
        self.body, self.offset = body, 0

    def take(self, descriptor: Any, dtypes: tuple[str, ...], ndim: int, what: str) -> np.ndarray:
        if not (isinstance(descriptor, list) and len(descriptor) == 2 and isinstance(descriptor[0], str)
                and isinstance(descriptor[1], list) and all(type(n) is int and n >= 0 for n in descriptor[1])):
            raise WireError(f"{what}: not an array descriptor [dtype, shape]")
        dtype_name, shape = descriptor
        if dtype_name not in dtypes:
            raise WireError(f"{what}: dtype {dtype_name!r} is not one of {list(dtypes)}")
        if len(shape) != ndim:
            raise WireError(f"{what}: {len(shape)} dimensions, expected {ndim}")
        dtype = np.dtype(dtype_name)
        count = math.prod(shape)
        size = count * dtype.itemsize
        if self.offset + size > len(self.body):
            raise WireError(f"{what}: declares {size} bytes, the message holds {len(self.body) - self.offset} more")
        array = np.frombuffer(self.body, dtype=dtype, count=count, offset=self.offset).reshape(shape)
        self.offset += size
        return array

    def finish(self) -> None:
        if self.offset != len(self.body):
            raise WireError(f"{len(self.body) - self.offset} bytes after the last declared array")


def _little(dtype: str) -> str:
    """numpy's name of `dtype` little-endian (the wire order): "int16" -> "<i2", "uint8" -> "|u1"."""
    return np.dtype(dtype).newbyteorder("<").str


def encode_record(obj: Any, fields: tuple[Field, ...], arrays: _Arrays) -> dict:
    """obj's declared attributes as a msgpack-ready dict (array fields as descriptors, buffers into `arrays`)."""
    out: dict[str, Any] = {}
    for f in fields:
        value = getattr(obj, f.name)
        if f.kind == INT:
            out[f.name] = int(value)
        elif f.kind == FLOAT:
            out[f.name] = float(value)
        elif f.kind in (STR, OPT_STR):
            out[f.name] = value
        elif f.kind in LIST_LAYOUT:
            dtype, ndim = LIST_LAYOUT[f.kind]
            array = np.asarray(value, dtype=dtype)
            out[f.name] = arrays.add(array.reshape(-1, 2) if ndim == 2 else array)
        elif f.kind == NDARRAY:
            if value is None and f.optional:
                out[f.name] = None
            else:
                if value.dtype.name not in f.dtypes or value.ndim != f.ndim:
                    raise WireError(f"{f.name}: {value.dtype.name}[{value.ndim}d] is not one of {list(f.dtypes)} "
                                    f"with {f.ndim} dimensions")
                out[f.name] = arrays.add(value)
        else:
            raise AssertionError(f"unknown field kind {f.kind}")
    return out


def decode_record(raw: Any, fields: tuple[Field, ...], reader: _ArrayReader, what: str) -> dict:
    """The validated attribute values of one record (keyword arguments for its class)."""
    if not isinstance(raw, dict):
        raise WireError(f"{what}: not a map")
    names = {f.name for f in fields}
    if set(raw) != names:
        missing, extra = sorted(names - set(raw)), sorted(set(raw) - names)
        raise WireError(f"{what}: fields differ from the schema (missing {missing}, unknown {extra})")
    values: dict[str, Any] = {}
    for f in fields:
        value, where = raw[f.name], f"{what}.{f.name}"
        if f.kind == INT:
            if type(value) is not int:
                raise WireError(f"{where}: expected an int, got {type(value).__name__}")
        elif f.kind == FLOAT:
            if type(value) not in (int, float) or not math.isfinite(value):
                raise WireError(f"{where}: expected a finite float, got {value!r}"[:200])
            value = float(value)
        elif f.kind == STR or (f.kind == OPT_STR and value is not None):
            if type(value) is not str:
                raise WireError(f"{where}: expected a str, got {type(value).__name__}")
        elif f.kind in LIST_LAYOUT:
            dtype, ndim = LIST_LAYOUT[f.kind]
            array = reader.take(value, (dtype,), ndim, where)
            if ndim == 2 and array.shape[1] != 2:
                raise WireError(f"{where}: shape {list(array.shape)}, expected [n, 2]")
            if f.kind == FLOAT_LIST and not np.isfinite(array).all():
                raise WireError(f"{where}: holds a non-finite value")
            value = [tuple(pair) for pair in array.tolist()] if ndim == 2 else array.tolist()
        elif f.kind == NDARRAY:
            if not (value is None and f.optional):
                value = reader.take(value, tuple(_little(d) for d in f.dtypes), f.ndim, where).copy()
        values[f.name] = value
    return values


def check_sample(s: Sample, what: str) -> None:
    """The invariants the learner relies on: per-token lists of equal length, spans inside token_ids."""
    n = len(s.token_ids)
    if len(s.logprobs) != n or len(s.versions) != n:
        raise WireError(f"{what}: token_ids, logprobs and versions differ in length "
                        f"({n}, {len(s.logprobs)}, {len(s.versions)})")
    if min(s.token_ids, default=0) < 0 or min(s.prompt_ids, default=0) < 0:
        raise WireError(f"{what}: a negative token id")
    if min(s.versions, default=-1) < -1:
        raise WireError(f"{what}: a version below -1")
    end = 0
    for start, stop in s.env_spans:
        if not end <= start < stop <= n:
            raise WireError(f"{what}: env_spans {s.env_spans} are not ordered, non-empty spans within "
                            f"the {n} tokens")
        end = stop
    if s.turns < 1:
        raise WireError(f"{what}: turns={s.turns}")


# --------------------------------------------------------------------------------------------- framing
@dataclass(frozen=True)
class Envelope:
    kind: int
    session: bytes
    sender: int
    sequence: int


def seal(envelope: Envelope, meta: dict, arrays: _Arrays, key: bytes) -> bytes:
    """One message: header, msgpack metadata, array buffers, HMAC tag."""
    packed = msgpack.packb(meta, use_bin_type=True)
    if len(envelope.session) != 8:
        raise ValueError(f"a session is 8 bytes, got {len(envelope.session)}")
    header = HEADER.pack(MAGIC, FORMAT_VERSION, envelope.kind, 0, envelope.session, envelope.sender,
                         envelope.sequence, len(packed))
    message = b"".join([header, packed, *arrays.buffers])
    return message + hmac.new(key, message, hashlib.sha256).digest()


def open_message(message: bytes | memoryview, key: bytes, kind: int) -> tuple[Envelope, dict, _ArrayReader]:
    """Authenticate and parse a message of `kind`: its envelope, metadata and array reader. WireError on any
    failure; the tag is checked before the metadata is parsed."""
    view = memoryview(message)
    if len(view) < HEADER.size + TAG_BYTES:
        raise WireError(f"{len(view)} bytes: shorter than a header and tag")
    magic, version, got_kind, _flags, session, sender, sequence, meta_len = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise WireError(f"not a megarl message (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise WireError(f"wire format version {version}, this megarl speaks {FORMAT_VERSION}")
    body, tag = view[:-TAG_BYTES], view[-TAG_BYTES:]
    if not hmac.compare_digest(hmac.new(key, body, hashlib.sha256).digest(), tag):
        raise WireError("authentication failed: the HMAC tag does not match the run secret")
    if got_kind != kind:
        raise WireError(f"message kind {got_kind}, expected {kind} ({KINDS[kind]})")
    if HEADER.size + meta_len > len(body):
        raise WireError(f"metadata length {meta_len} exceeds the message")
    try:
        meta = msgpack.unpackb(body[HEADER.size:HEADER.size + meta_len], raw=False, strict_map_key=True,
                               ext_hook=_refuse_ext, use_list=True)
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several types for malformed input
        raise WireError(f"metadata is not valid msgpack: {type(exc).__name__}: {exc}"[:300]) from None
    if not isinstance(meta, dict):
        raise WireError("metadata is not a map")
    return Envelope(got_kind, bytes(session), sender, sequence), meta, _ArrayReader(body[HEADER.size + meta_len:])


def _refuse_ext(code: int, data: bytes):
    raise WireError(f"msgpack extension type {code} is not part of the format")


# ----------------------------------------------------------------------------------------- sample groups
def encode_group(group: list[Sample], stats: dict[str, float], session: bytes, sender: int, sequence: int,
                 key: bytes) -> bytes:
    envelope, arrays = Envelope(GROUP, session, sender, sequence), _Arrays()
    meta = {"samples": [encode_record(s, SAMPLE_FIELDS, arrays) for s in group],
            "stats": {str(k): float(v) for k, v in stats.items()}}
    return seal(envelope, meta, arrays, key)


def decode_group(message: bytes | memoryview, key: bytes) -> tuple[Envelope, list[Sample], dict[str, float]]:
    """A validated group: every sample checked (check_sample), one group id and sampler rank; stats a map
    of finite floats."""
    envelope, meta, reader = open_message(message, key, GROUP)
    if set(meta) != {"samples", "stats"}:
        raise WireError(f"group metadata keys {sorted(meta)}, expected ['samples', 'stats']")
    raw_samples, stats = meta["samples"], meta["stats"]
    if not isinstance(raw_samples, list) or not raw_samples:
        raise WireError("a group must hold at least one sample")
    group = [Sample(**decode_record(raw, SAMPLE_FIELDS, reader, f"sample {i}")) for i, raw in enumerate(raw_samples)]
    reader.finish()
    for i, s in enumerate(group):
        check_sample(s, f"sample {i}")
        if s.group_id != group[0].group_id or s.sampler_rank != group[0].sampler_rank:
            raise WireError(f"sample {i}: group {s.group_id!r} / sampler rank {s.sampler_rank} differ from the "
                            f"first sample's {group[0].group_id!r} / {group[0].sampler_rank}")
    if not isinstance(stats, dict) or not all(type(k) is str and type(v) in (int, float) and math.isfinite(v)
                                              for k, v in stats.items()):
        raise WireError("sampler stats must map names to finite numbers")
    return envelope, group, {k: float(v) for k, v in stats.items()}


# ----------------------------------------------------------------------------------------- TP step plans
def encode_plan(requests: list[GenerationRequest], version: int | None, stop: bool, sequence: int,
                key: bytes) -> bytes:
    """A TP lead's plan; the session is unused (the group's members share one process group), the
    sequence numbers the plans so a follower notices one out of order."""
    envelope, arrays = Envelope(PLAN, bytes(8), 0, sequence), _Arrays()
    meta = {"version": version, "stop": stop,
            "requests": [{**encode_record(r, REQUEST_FIELDS, arrays),
                          "sampling": encode_record(r.sampling, SAMPLING_FIELDS, arrays)} for r in requests]}
    return seal(envelope, meta, arrays, key)


def decode_plan(message: bytes | memoryview, key: bytes) -> tuple[Envelope, list[GenerationRequest], int | None, bool]:
    envelope, meta, reader = open_message(message, key, PLAN)
    if set(meta) != {"version", "stop", "requests"} or not isinstance(meta["requests"], list) \
            or type(meta["stop"]) is not bool or not (meta["version"] is None or type(meta["version"]) is int):
        raise WireError("plan metadata is not {version: int|None, stop: bool, requests: [...]}")
    requests = []
    for i, raw in enumerate(meta["requests"]):
        if not isinstance(raw, dict) or "sampling" not in raw:
            raise WireError(f"request {i}: no sampling parameters")
        fields = decode_record({k: v for k, v in raw.items() if k != "sampling"}, REQUEST_FIELDS, reader,
                               f"request {i}")
        sampling = SamplingParams(**decode_record(raw["sampling"], SAMPLING_FIELDS, reader, f"request {i}.sampling"))
        requests.append(GenerationRequest(fields["request_id"], fields["prompt_ids"], sampling,
                                          tuple(fields["stop_token_ids"])))
    reader.finish()
    return envelope, requests, meta["version"], meta["stop"]
