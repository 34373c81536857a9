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
    metadata        msgpack map (str keys; no ext types); records travel as columns (encode_records),
                    arrays appear in it as [dtype, shape] descriptors
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
import itertools
import math
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from megarl.protocols import GenerationRequest, Sample, SamplingParams, sample_shape_problem
from megarl.rollout.position import parse_group_id

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
    min_value: int | None = None  # INT, INT_LIST: the smallest value accepted
    finite: bool = True  # FLOAT_LIST: refuse NaN and infinities


# Sample's schema: every attribute that travels, in one place (docs/security.md#the-wire-format).
SAMPLE_FIELDS: tuple[Field, ...] = (
    Field("group_id", STR),
    Field("prompt", STR),
    Field("completion", STR),
    Field("prompt_ids", INT_LIST, min_value=0),
    Field("token_ids", INT_LIST, min_value=0),
    # A diverged policy samples NaN log-probs; they must reach the learner, whose non-finite step rule stops the
    # run naming the cause (learner.max_nonfinite_in_row): dropped here, the learner would wait for groups forever.
    Field("logprobs", FLOAT_LIST, finite=False),
    Field("versions", INT_LIST, min_value=-1),  # -1: an environment token
    Field("reward", FLOAT),
    Field("finish_reason", STR),
    Field("sampler_rank", INT, min_value=0),
    Field("reward_error", OPT_STR),
    Field("env_spans", SPAN_LIST),
    Field("turns", INT, min_value=1),
    Field("source", STR),
    Field("reward_parts", OPT_STR),  # JSON; its content is checked by sample_problem (reward_parts_problem)
    # MoE: [positions, moe_layers, top_k] expert indices (megarl.rollout.routes checks the shape against the model)
    Field("routes", NDARRAY, dtypes=("uint8", "int16"), ndim=3, optional=True),
)

SAMPLING_FIELDS: tuple[Field, ...] = (
    Field("temperature", FLOAT), Field("top_p", FLOAT), Field("top_k", INT), Field("max_new_tokens", INT))
REQUEST_FIELDS: tuple[Field, ...] = (
    Field("request_id", STR), Field("prompt_ids", INT_LIST, min_value=0), Field("stop_token_ids", INT_LIST, min_value=0))


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


def encode_records(objs: list, fields: tuple[Field, ...], arrays: _Arrays) -> dict:
    """Records as columns: {"count": n, "columns": {field: column}}. A scalar column is the list of the n
    values; a list column is {"lengths": [n ints], "data": one array of every record's items}; an ndarray
    column is the n arrays' descriptors (None where absent). One array per list field and group, not per
    record, keeps a group's cost near pickle's."""
    columns: dict[str, Any] = {}
    for f in fields:
        values = [getattr(obj, f.name) for obj in objs]
        if f.kind == INT:
            columns[f.name] = [int(v) for v in values]
        elif f.kind == FLOAT:
            columns[f.name] = [float(v) for v in values]
        elif f.kind in (STR, OPT_STR):
            columns[f.name] = values
        elif f.kind in LIST_LAYOUT:
            dtype, ndim = LIST_LAYOUT[f.kind]
            lengths = [len(v) for v in values]
            if ndim == 1:
                data = np.fromiter(itertools.chain.from_iterable(values), dtype=dtype, count=sum(lengths))
            else:
                data = np.asarray([pair for v in values for pair in v], dtype=dtype).reshape(-1, 2)
            columns[f.name] = {"lengths": lengths, "data": arrays.add(data)}
        elif f.kind == NDARRAY:
            column = []
            for v in values:
                if v is None and f.optional:
                    column.append(None)
                    continue
                if v.dtype.name not in f.dtypes or v.ndim != f.ndim:
                    raise WireError(f"{f.name}: {v.dtype.name}[{v.ndim}d] is not one of {list(f.dtypes)} "
                                    f"with {f.ndim} dimensions")
                column.append(arrays.add(v))
            columns[f.name] = column
        else:
            raise AssertionError(f"unknown field kind {f.kind}")
    return {"count": len(objs), "columns": columns}


def decode_records(raw: Any, fields: tuple[Field, ...], reader: _ArrayReader, what: str) -> list[dict]:
    """The validated attribute values of each record (keyword arguments for its class), from encode_records'
    columns."""
    if not (isinstance(raw, dict) and set(raw) == {"count", "columns"} and type(raw["count"]) is int
            and raw["count"] >= 0 and isinstance(raw["columns"], dict)):
        raise WireError(f"{what}: not {{count, columns}}")
    n, columns = raw["count"], raw["columns"]
    names = [f.name for f in fields]
    if set(columns) != set(names):
        missing, extra = sorted(set(names) - set(columns)), sorted(set(columns) - set(names))
        raise WireError(f"{what}: fields differ from the schema (missing {missing}, unknown {extra})")
    # Every column is checked against `n` before any per-record storage exists: `n` is a number the sender
    # declares (a ~200-byte message may claim 2**63 records), the columns are what the message holds.
    by_field: dict[str, list] = {}
    for f in fields:
        column, where = columns[f.name], f"{what}.{f.name}"
        if f.kind in LIST_LAYOUT:
            values = _split_list_column(column, f, n, reader, where)
        elif not isinstance(column, list) or len(column) != n:
            raise WireError(f"{where}: expected a list of {n} values")
        elif f.kind == NDARRAY:
            dtypes = tuple(_little(d) for d in f.dtypes)
            values = [None if v is None and f.optional else reader.take(v, dtypes, f.ndim, where).copy()
                      for v in column]
        else:
            values = [_check_scalar(f, v, where) for v in column]
        by_field[f.name] = values
    return [dict(zip(names, row)) for row in zip(*(by_field[name] for name in names))]


def _check_scalar(f: Field, value: Any, where: str) -> Any:
    if f.kind == INT:
        if type(value) is not int:
            raise WireError(f"{where}: expected an int, got {type(value).__name__}")
        if f.min_value is not None and value < f.min_value:
            raise WireError(f"{where}: {value}, below {f.min_value}")
    elif f.kind == FLOAT:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise WireError(f"{where}: expected a finite float, got {value!r}"[:200])
        value = float(value)
    elif f.kind == STR or (f.kind == OPT_STR and value is not None):
        if type(value) is not str:
            raise WireError(f"{where}: expected a str, got {type(value).__name__}")
    return value


def _split_list_column(column: Any, f: Field, n: int, reader: _ArrayReader, where: str) -> list[list]:
    kind = f.kind
    dtype, ndim = LIST_LAYOUT[kind]
    if not (isinstance(column, dict) and set(column) == {"lengths", "data"} and isinstance(column["lengths"], list)
            and len(column["lengths"]) == n and all(type(k) is int and k >= 0 for k in column["lengths"])):
        raise WireError(f"{where}: expected {{lengths: [{n} ints >= 0], data}}")
    data = reader.take(column["data"], (dtype,), ndim, where)
    if ndim == 2 and data.shape[1] != 2:
        raise WireError(f"{where}: shape {list(data.shape)}, expected [n, 2]")
    if len(data) != sum(column["lengths"]):
        raise WireError(f"{where}: lengths sum to {sum(column['lengths'])}, the data holds {len(data)}")
    if kind == FLOAT_LIST and f.finite and not np.isfinite(data).all():
        raise WireError(f"{where}: holds a non-finite value")
    if f.min_value is not None and len(data) and data.min() < f.min_value:
        raise WireError(f"{where}: holds {data.min()}, below {f.min_value}")
    items = [tuple(pair) for pair in data.tolist()] if ndim == 2 else data.tolist()
    out, offset = [], 0
    for length in column["lengths"]:
        out.append(items[offset:offset + length])
        offset += length
    return out


def sample_problem(s: Sample, ranges: bool = True) -> str | None:
    """What makes `s` not a valid sample, or None: the one check sender and receiver share. The sampler applies it
    before sending (a sample failing it is dropped and counted there: megarl.roles.sampler_main), the learner on
    receipt (decode_group) and before batching. It covers the schema's value ranges (`min_value`, finite floats;
    `ranges=False` where decode_records checked them already, on whole columns at once: ~0.1 ms per 1,000 tokens
    here) and the invariants across fields the learner relies on: per-token lists of equal length, env spans
    ordered inside token_ids, MoE routes one row per input position (their layers, top_k and expert range depend
    on the model: megarl.rollout.routes checks those)."""
    for f in SAMPLE_FIELDS if ranges else ():
        value = getattr(s, f.name)
        if f.kind == INT and f.min_value is not None and value < f.min_value:
            return f"{f.name}: {value}, below {f.min_value}"  # e.g. turns 0: an episode that made no model turn
        if f.kind == INT_LIST and f.min_value is not None and value and min(value) < f.min_value:
            return f"{f.name}: holds {min(value)}, below {f.min_value}"
        if f.kind == FLOAT and not math.isfinite(value):
            return f"{f.name}: {value!r}, not finite"
    return sample_shape_problem(s)


def check_sample(s: Sample, what: str, ranges: bool = True) -> None:
    """WireError naming `what` and the problem when `s` is not a valid sample (sample_problem)."""
    if (problem := sample_problem(s, ranges)) is not None:
        raise WireError(f"{what}: {problem}")


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
    meta = {"samples": encode_records(group, SAMPLE_FIELDS, arrays),
            "stats": {str(k): float(v) for k, v in stats.items()}}
    return seal(envelope, meta, arrays, key)


def decode_group(message: bytes | memoryview, key: bytes,
                 vocab_size: int | None = None) -> tuple[Envelope, list[Sample], dict[str, float]]:
    """A validated group: every sample checked (check_sample, with `vocab_size`), one group id and sampler rank;
    stats a map of finite floats."""
    envelope, meta, reader = open_message(message, key, GROUP)
    if set(meta) != {"samples", "stats"}:
        raise WireError(f"group metadata keys {sorted(meta)}, expected ['samples', 'stats']")
    group = [Sample(**values) for values in decode_records(meta["samples"], SAMPLE_FIELDS, reader, "samples")]
    reader.finish()
    if not group:
        raise WireError("a group must hold at least one sample")
    stats = meta["stats"]
    try:  # what the learner's data position will parse (megarl.rollout.position)
        parse_group_id(group[0].group_id)
    except ValueError as exc:
        raise WireError(f"sample 0: {exc}"[:300]) from None
    for i, s in enumerate(group):
        check_sample(s, f"sample {i}", ranges=False)  # decode_records checked the schema's ranges
        if vocab_size is not None:  # (the learner's embedding lookup fails on any other id)
            for name in ("prompt_ids", "token_ids"):
                if max(getattr(s, name), default=-1) >= vocab_size:
                    raise WireError(f"sample {i}: {name} holds {max(getattr(s, name))}, not below the model's "
                                    f"vocab_size {vocab_size}")
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
    meta = {"version": version, "stop": stop, "requests": encode_records(requests, REQUEST_FIELDS, arrays),
            "sampling": encode_records([r.sampling for r in requests], SAMPLING_FIELDS, arrays)}
    return seal(envelope, meta, arrays, key)


def decode_plan(message: bytes | memoryview, key: bytes) -> tuple[Envelope, list[GenerationRequest], int | None, bool]:
    envelope, meta, reader = open_message(message, key, PLAN)
    if set(meta) != {"version", "stop", "requests", "sampling"} or type(meta["stop"]) is not bool \
            or not (meta["version"] is None or type(meta["version"]) is int):
        raise WireError("plan metadata is not {version: int|None, stop: bool, requests, sampling}")
    fields = decode_records(meta["requests"], REQUEST_FIELDS, reader, "requests")
    sampling = decode_records(meta["sampling"], SAMPLING_FIELDS, reader, "sampling")
    reader.finish()
    if len(sampling) != len(fields):
        raise WireError(f"{len(fields)} requests but {len(sampling)} sampling parameter sets")
    requests = [GenerationRequest(f["request_id"], f["prompt_ids"], SamplingParams(**p), tuple(f["stop_token_ids"]))
                for f, p in zip(fields, sampling)]
    return envelope, requests, meta["version"], meta["stop"]
