"""Weight publish: the learner broadcasts each new policy version to every sampler, in buckets.

Protocol (publish group rank 0 = learner source, ranks 1.. = samplers):
  1. once per run the source writes the *spec* (HF name, shape, dtype of every tensor, in
     broadcast order) to the store; receivers check it against their engine's weights.
  2. per publish (numbered 1, 2, ...) the source writes a header {version, checksum: bool, extra}
     under `publish/{n}`, then broadcasts each bucket (a flat buffer of whole tensors of one dtype, at most
     `bucket_mb`) over the group; with checksums on, it sums each bucket while it is on the wire and
     writes the sums under `publish/{n}/checksums` once the last bucket is sent.
  3. a receiver thread waits for the header, receives the buckets into a staging buffer set,
     sums each bucket as it lands, compares with the source's sums and hands the tensors (views into
     the staging buffers) to a callback;
     the engine swaps them in at its next step boundary, so decoding overlaps the transfer.
     With `destination` (an engine's `staging_buffers`), the receiver has no staging sets: it writes
     every tensor straight into the storage the engine will run the version from (a bucket of one
     tensor is received into it, packed buckets through a few bucket-sized scratch buffers), and hands
     over those same views.
     With `narrow` (a tensor-parallel engine under a learner of TP 1: megarl.distributed.topology's
     slices_on_arrival), whole tensors arrive and the receiver keeps `narrow(name, whole)` of each, its
     TP rank's slice (megarl.models.tp_shard), unpacked from the scratch buffers into the destination.
With publish.senders = k, k learner DP replicas publish, each over its own group (its own header,
spec and checksums): sender d sends buckets d, d + k, d + 2k, ... of the plan over the whole spec
(`sender_share`), so k broadcasts run at once; a receiver merges the parts (StagedReceiver).
Wire format options (publish.dtype, publish.delta): floating tensors may travel as bf16 (the learner
keeps its fp32 master weights; receivers cast into the engine's dtype), and with delta on, every
publish after the first sends per bucket only the words that changed since the previous publish, as
(int32 index, value) pairs, or a changed-word bitmap and the values, or the whole bucket, whichever is
smallest (`delta_payload`): a small int64 header (encoding, changed count) goes first. Both sides keep
the last words of every bucket (the source to diff against, receivers to patch), and the checksums
cover the rebuilt words, so a receiver checks it holds exactly the source's words.
Publishes are numbered separately from policy versions because a version may advance by more than
one between publishes (sync mode trains K steps, a skipped step advances none).
Receivers double-buffer: a new version lands in the buffer set that does not hold the newest one,
reused only once the engine has moved past the version that set last held. A version a receiver
already handed over, published again (a re-publish over a new membership epoch), is received but
not staged (WeightReceiver._receive_again says why).
Under fault.on_failure=replace the group changes with the live sampler set (membership epochs,
megarl.distributed.membership): a receiver's `follower` moves it to each epoch's group and first publish,
whose source resets its delta base, so that publish is whole.
"""
from __future__ import annotations

import collections
import json
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable

import torch

SPEC_KEY = "publish/spec"
HEADER_POLL_S = 0.002
SCRATCH_BUCKETS = 3  # packed buckets on their way into a `destination` at once (posted receives ahead)
CHECKSUM_CHUNK_WORDS = 8192  # 64 KiB: the granularity at which the second sum sees a misplaced chunk


def header_key(publish_index: int) -> str:
    return f"publish/{publish_index}"


def checksums_key(publish_index: int) -> str:
    return f"publish/{publish_index}/checksums"


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    offset: int  # elements from the start of the bucket
    numel: int


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    numel: int
    slots: tuple[TensorSlot, ...]


def plan_buckets(spec: list[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int) -> list[Bucket]:
    """Greedy packing in spec order; a tensor larger than a bucket gets a bucket of its own."""
    buckets: list[Bucket] = []
    slots: list[TensorSlot] = []
    used, dtype = 0, None

    def close():
        if slots:
            buckets.append(Bucket(dtype, used, tuple(slots)))

    for name, shape, dt in spec:
        numel = 1
        for d in shape:
            numel *= d
        if slots and (dt != dtype or (used + numel) * dt.itemsize > bucket_bytes):
            close()
            slots, used = [], 0
        dtype = dt
        slots.append(TensorSlot(name, tuple(shape), used, numel))
        used += numel
    close()
    return buckets


def sender_share(spec: list[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int, senders: int,
                 sender: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The part of `spec` publish sender `sender` of `senders` sends: the tensors of buckets sender,
    sender + senders, ... of the plan over the whole spec. Round robin rather than contiguous halves, so
    the senders' sends interleave in the order a ZeRO-3 learner gathers (the gather of bucket i + 1,
    collective over every rank, overlaps the send of bucket i by another rank)."""
    share = set()
    for i, bucket in enumerate(plan_buckets(spec, bucket_bytes)):
        if i % senders == sender:
            share.update(slot.name for slot in bucket.slots)
    return [entry for entry in spec if entry[0] in share]


_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bit-pattern views by item size


def words(flat: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a flat tensor (comparing floats as floats would call NaN changed, -0 == 0 same)."""
    return flat.view(_WORD[flat.element_size()])


WHOLE, PAIRS, BITMAP = 0, 1, 2  # how a bucket of a delta publish travels (the first word of its delta header)
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def delta_size(encoding: int, count: int, numel: int, item_size: int) -> int:
    """Payload bytes of a bucket of `numel` words with `count` changed: (int32 index, value) pairs, or a
    changed-word bitmap (padded to 8 bytes, so the values after it stay aligned) then the values (smaller
    once more than ~1 word in 32 changed), or the words whole."""
    return {PAIRS: count * (4 + item_size), BITMAP: (numel + 63) // 64 * 8 + count * item_size,
            WHOLE: numel * item_size}[encoding]


def delta_payload(new: torch.Tensor, old: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(encoding, changed count, payload) that turns the flat bucket `old` into `new`, the smallest of
    PAIRS, BITMAP and WHOLE (then the payload is `new` itself)."""
    changed = words(new) != words(old)
    # count_nonzero, not sum(): a bool sum widens every word to int64 first (~25x slower on CPU, measured).
    count, numel, size = int(changed.count_nonzero()), new.numel(), new.element_size()
    encoding = min((PAIRS, BITMAP, WHOLE), key=lambda e: delta_size(e, count, numel, size))
    if encoding == WHOLE:
        return WHOLE, count, new
    payload = torch.empty(delta_size(encoding, count, numel, size), dtype=torch.uint8, device=new.device)
    head = payload.numel() - count * size  # indices or bitmap; the values follow, aligned (head % 4 == 0)
    if encoding == PAIRS:
        payload[:head].view(torch.int32).copy_(changed.nonzero().view(-1))
    else:
        bits = torch.zeros(head * 8, dtype=torch.uint8, device=new.device)
        bits[:numel] = changed
        payload[:head] = (bits.view(-1, 8) * _BIT_WEIGHTS.to(new.device)).sum(dim=1, dtype=torch.uint8)
    payload[head:].view(new.dtype).copy_(new[changed])
    return encoding, count, payload


def apply_delta(words_to_patch: torch.Tensor, encoding: int, count: int, payload: torch.Tensor) -> None:
    """Write a PAIRS or BITMAP `delta_payload` into the previous version's flat bucket, in place."""
    head = payload.numel() - count * words_to_patch.element_size()
    values = payload[head:].view(words_to_patch.dtype)
    if encoding == PAIRS:
        words_to_patch[payload[:head].view(torch.int32).long()] = values
    else:
        bits = (payload[:head].unsqueeze(1) & _BIT_WEIGHTS.to(payload.device)) != 0
        words_to_patch[bits.view(-1)[:words_to_patch.numel()]] = values


def bucket_checksum(buffer: torch.Tensor) -> list[int]:
    """Two wrapping 64-bit sums over a bucket's bytes: of its 8-byte words (plus trailing bytes), and of
    its 64 KiB chunk sums weighted by chunk position.

    Why not CRC32: zlib.crc32 runs at ~2 GB/s on one core, slower than the broadcast it guards, and on
    GPU it would need the whole bucket copied to the host. These sums are torch reductions, so they run
    where the bucket lives (HBM bandwidth on GPU, ~8 GB/s on one CPU core: measured in
    docs/benchmarks.md). Integer addition modulo 2**64 is order-independent, so every device and thread
    count gets the same value. What they catch: any single flipped bit or byte, a bucket left stale or
    zeroed, a torn bucket, chunks out of place; not adversarial edits (this guards a transport).
    """
    raw = buffer.reshape(-1).view(torch.uint8)
    if raw.storage_offset() % 8:  # a tensor sent as is may sit anywhere in its storage: words need alignment
        raw = raw.clone()
    num_words = raw.numel() // 8
    words = raw[:num_words * 8].view(torch.int64)
    whole = num_words // CHECKSUM_CHUNK_WORDS * CHECKSUM_CHUNK_WORDS
    chunk_sums = words[:whole].view(-1, CHECKSUM_CHUNK_WORDS).sum(dim=1)
    rest = words[whole:].sum() + raw[num_words * 8:].to(torch.int64).sum()
    positions = torch.arange(1, chunk_sums.numel() + 1, device=raw.device, dtype=torch.int64)
    sums = torch.stack([chunk_sums.sum() + rest, (chunk_sums * positions).sum() + rest * (chunk_sums.numel() + 1)])
    return sums.tolist()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Broadcast:
    """A broadcast from group rank 0, started (asynchronously) on construction; `wait()` raises a
    TimeoutError naming `what` when it fails or times out. Holds the buffer until it is sent."""

    def __init__(self, group, buffer: torch.Tensor, timeout: timedelta, what: str):
        self.buffer, self.timeout, self.what = buffer, timeout, what
        self.work = group.broadcast(buffer, 0, timeout)

    def wait(self) -> None:
        try:
            self.work.wait()
        except RuntimeError as exc:
            raise TimeoutError(f"weight publish: {self.what} failed or timed out after "
                               f"{self.timeout.total_seconds():.0f}s (a sampler or the learner may have died): "
                               f"{exc}") from exc
        self.buffer = None


Spec = list[tuple[str, tuple[int, ...], torch.dtype]]


class WeightPublisher:
    """Learner side: `publish(version, named_tensors, spec=...)` after every optimizer step.

    The tensors stream: bucket i is packed as its tensors arrive and sent at once, while the learner
    produces (gathers, converts) the next bucket's tensors, and at most `IN_FLIGHT` buckets are on the
    wire, so the source holds about two buckets of weights beyond the model, never a second copy of it
    (a ZeRO-3 learner gathers bucket by bucket for the same reason). The header goes first; the sums
    travel after the buckets, not in the header, so nothing waits for them. A bucket holding one
    contiguous tensor sends that tensor as is (no copy); packed buckets use `IN_FLIGHT` reused buffers.

    `sender`/`senders`: one of several publishing DP replicas, each given the whole stream (its
    production may be collective, as ZeRO-3 gathers are) and sending its `sender_share` of it.
    """

    IN_FLIGHT = 2

    def __init__(self, group, store, bucket_mb: float, timeout_s: float, checksum: bool, sender: int = 0,
                 senders: int = 1, wire_dtype: torch.dtype | None = None, delta: bool = False):
        self.group, self.store = group, store
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.timeout = timedelta(seconds=timeout_s)
        self.checksum = checksum
        self.sender, self.senders = sender, senders
        self.wire_dtype, self.delta = wire_dtype, delta  # floating tensors travel as wire_dtype (None: as they are)
        self.spec: Spec | None = None  # the whole spec the first publish fixed (the learner's dtypes)
        self.source_dtypes: dict[str, torch.dtype] = {}
        self.own: set[str] = set()  # the names of this sender's share
        self.last_sent: list[torch.Tensor] = []  # with delta: every bucket's words as the last publish sent them
        self.buckets: list[Bucket] | None = None
        # Packing buffers: slot i % IN_FLIGHT, per (dtype, device), as large as the largest bucket of that dtype.
        self.ring: list[dict[tuple[torch.dtype, torch.device], torch.Tensor]] = [{} for _ in range(self.IN_FLIGHT)]
        self.published = 0

    def publish(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]], extra: dict | None = None,
                spec: Spec | None = None) -> dict:
        """Broadcast one version; returns {bytes, seconds}. `extra` travels in the header (small JSON).

        `spec`: the (name, shape, dtype) of each tensor `tensors` will yield, in that order (a learner's
        `publish_spec`), so the tensors can stream. Without it they are collected first (callers that
        hold them all anyway)."""
        start = time.perf_counter()
        if spec is None:
            named = dict(tensors)
            spec, tensors = [(n, tuple(t.shape), t.dtype) for n, t in named.items()], named.items()
        spec = [(n, tuple(shape), dtype) for n, shape, dtype in spec]
        if self.buckets is None:
            wire = [(n, s, self._wire(d)) for n, s, d in sender_share(spec, self.bucket_bytes, self.senders, self.sender)]
            self.store.set(SPEC_KEY, json.dumps({"bucket_bytes": self.bucket_bytes, "delta": self.delta,
                                                 "tensors": [[n, list(s), _dtype_name(d)] for n, s, d in wire]}))
            self.spec, self.own, self.buckets = spec, {n for n, _, _ in wire}, plan_buckets(wire, self.bucket_bytes)
            self.source_dtypes = {n: d for n, _, d in spec}
        self._check(spec)
        self.published += 1
        delta = self.delta and bool(self.last_sent)  # the first publish has nothing to diff against
        self.store.set(header_key(self.published), json.dumps(
            {"version": version, "checksum": self.checksum, "delta": delta, "extra": extra or {}}))
        stream = self._own(tensors)
        in_flight: collections.deque[list[_Broadcast]] = collections.deque()
        sums, sent = [], 0
        for i, bucket in enumerate(self.buckets):
            if len(in_flight) == self.IN_FLIGHT:  # frees ring slot i % IN_FLIGHT (bucket i - IN_FLIGHT used it)
                for send in in_flight.popleft():
                    send.wait()
            flat = self._flat(i, bucket, stream)
            what = f"version {version} bucket {i + 1}/{len(self.buckets)}"
            body = flat
            sends = []
            if delta:
                encoding, count, body = delta_payload(flat, self.last_sent[i])
                sends.append(_Broadcast(self.group, torch.tensor([encoding, count], dtype=torch.int64), self.timeout,
                                        f"{what} (its delta header)"))
                sent += 16
            sends.append(_Broadcast(self.group, body, self.timeout, what))
            sent += body.numel() * body.element_size()
            in_flight.append(sends)
            if self.checksum:  # while the bucket is on the wire: the broadcast only reads it
                sums.append(bucket_checksum(flat))
            if self.delta:  # what the receivers hold once this bucket landed
                if len(self.last_sent) <= i:
                    self.last_sent.append(flat.clone())
                else:
                    self.last_sent[i].copy_(flat)
        if self.checksum:
            self.store.set(checksums_key(self.published), json.dumps(sums))
        for sends in in_flight:
            for send in sends:
                send.wait()
        surplus = next(stream, None)  # also runs the rest of a collective stream: the other senders need it
        if surplus is not None:
            raise RuntimeError(f"weight publish: the learner yielded {surplus[0]} beyond its publish spec")
        full = sum(b.numel * b.dtype.itemsize for b in self.buckets)
        return {"bytes": sent, "full_bytes": full, "seconds": time.perf_counter() - start}

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        return self.wire_dtype if self.wire_dtype is not None and dtype.is_floating_point else dtype

    def _own(self, tensors: Iterable[tuple[str, torch.Tensor]]):
        """The stream's tensors of this sender's share (all of them for a lone sender)."""
        known = {name for name, _, _ in self.spec}
        for name, tensor in tensors:
            if name in self.own:
                yield name, tensor
            elif name not in known:
                raise RuntimeError(f"weight publish: the learner yielded {name} beyond its publish spec")

    def _check(self, spec: Spec) -> None:
        """Every version must match the spec the first publish fixed; checked before the header is written,
        so a bad version never leaves the receivers waiting for buckets that will not come."""
        fixed = {name: (shape, dtype) for name, shape, dtype in self.spec}
        given = {name: (shape, dtype) for name, shape, dtype in spec}
        for name, (shape, dtype) in fixed.items():
            if given.get(name) != (shape, dtype):
                got = "missing" if name not in given else f"{list(given[name][0])} {given[name][1]}"
                raise ValueError(f"weight publish: {name} is {got}, but the first publish fixed it "
                                 f"as {list(shape)} {dtype}")
        unknown = set(given) - set(fixed)
        if unknown:
            raise ValueError(f"weight publish: tensors not in the first publish's spec: {sorted(unknown)[:5]}")
        if [name for name, _, _ in spec] != [name for name, _, _ in self.spec]:
            raise ValueError("weight publish: the tensors come in another order than the first publish's")

    def _flat(self, index: int, bucket: Bucket, stream) -> torch.Tensor:
        """The flat tensor bucket `index` sends, built from the next tensors of the stream: its lone tensor
        itself if contiguous, else packed into ring slot index % IN_FLIGHT."""
        parts = []
        for slot in bucket.slots:
            name, tensor = next(stream, (None, None))
            dtype = self.source_dtypes.get(slot.name)
            if name != slot.name or tuple(tensor.shape) != slot.shape or tensor.dtype != dtype:
                got = "nothing" if name is None else f"{name} {list(tensor.shape)} {tensor.dtype}"
                raise RuntimeError(f"weight publish: the learner yielded {got} where its publish spec has "
                                   f"{slot.name} {list(slot.shape)} {dtype}")
            parts.append(tensor)
        if len(parts) == 1 and parts[0].is_contiguous() and parts[0].dtype == bucket.dtype:
            return parts[0].view(-1)
        key = (bucket.dtype, parts[0].device)
        slot_buffers = self.ring[index % self.IN_FLIGHT]
        if key not in slot_buffers:
            largest = max(b.numel for b in self.buckets if b.dtype == bucket.dtype)
            slot_buffers[key] = torch.empty(largest, dtype=bucket.dtype, device=parts[0].device)
        buffer = slot_buffers[key][:bucket.numel]
        for slot, tensor in zip(bucket.slots, parts):
            buffer[slot.offset:slot.offset + slot.numel].copy_(tensor.reshape(-1))  # casts to the wire dtype
        return buffer


class WeightReceiver:
    """Sampler side: a thread that receives every published version and hands it to `on_version`.

    `on_version(version, tensors, extra)` is called on the receiver thread; `current_version()` tells
    which version the engine runs, so a staging buffer set is reused only when it is free.
    All of a version's bucket receives are posted at once, and bucket i is checksummed while the later
    ones arrive. When the wire carries another dtype than the engine's (publish.dtype) or deltas
    (publish.delta), buckets land in one set of wire buffers that keeps the last version's words (the
    base a delta patches), are checked there, and are cast into the engine's staging set.
    `destination(version)`, when given, replaces the staging sets: HF name -> the writable view the
    version's tensor must land in (the engine's `staging_buffers`; the same views reach `on_version`).
    `narrow(name, tensor)`, when given, is the part of each arriving tensor the engine keeps (`expected`
    then names the arriving, whole shapes; the destination holds the narrowed ones).
    `follower` (fault.on_failure=replace: a membership.EpochFollower) moves the receiver to each new membership
    epoch's group and first publish; a publish that fails is then dropped (its version never handed over) and
    the receiver waits for the next epoch, whose first publish is whole, instead of failing. That publish may
    be a version this receiver already handed over (the learner sends a version again when its publish failed
    with every sampler alive): the receiver is idempotent per version (`_receive_again`).
    """

    def __init__(self, group, store, expected: dict[str, tuple[torch.Size, torch.dtype]], device: torch.device,
                 on_version: Callable[[int, dict[str, torch.Tensor], dict], None],
                 current_version: Callable[[], int], should_stop: Callable[[], bool], timeout_s: float,
                 partial: bool = False, destination: Callable[[int], dict[str, torch.Tensor]] | None = None,
                 narrow: Callable[[str, torch.Tensor], torch.Tensor] | None = None, follower=None,
                 abandoned: Callable[[int], bool] | None = None):
        self.group, self.store = group, store
        self.follower = follower
        # One part of several (StagedReceiver): says whether a version this part handed over will never be whole
        self.abandoned = abandoned
        self.began: int | None = None  # the newest version this receiver began to receive (StagedReceiver reads it)
        self.on_version, self.current_version, self.should_stop = on_version, current_version, should_stop
        self.timeout = timedelta(seconds=timeout_s)
        self.next_index = 1
        self.held_versions: list[int | None] = [None, None]  # version each staging set last received
        self.newest: int | None = None  # the newest version handed to on_version
        self.error: BaseException | None = None
        self._expected, self._device = expected, device
        self.partial = partial  # one stage of several (StagedReceiver): the spec covers part of `expected`
        self.destination, self.narrow = destination, narrow or _whole
        self.narrows = narrow is not None
        self.scratch: list[torch.Tensor] = []  # with a destination: SCRATCH_BUCKETS byte buffers for packed buckets
        self.buckets: list[Bucket] | None = None
        self.buffer_sets: list[list[torch.Tensor]] = []
        self.wire: list[torch.Tensor] | None = None  # the last version's words as sent (see the class docstring)
        self.thread = threading.Thread(target=self._run, name="megarl-weight-receiver", daemon=True)

    def start(self) -> "WeightReceiver":
        self.thread.start()
        return self

    def _load_spec(self) -> None:
        self._wait_key(SPEC_KEY)
        raw = json.loads(self.store.get(SPEC_KEY))
        spec = [(n, tuple(s), getattr(torch, d)) for n, s, d in raw["tensors"]]
        check_spec(spec, self._expected, partial=self.partial)
        self.buckets = plan_buckets(spec, raw["bucket_bytes"])
        engine_dtypes = [self._expected[b.slots[0].name][1] for b in self.buckets]
        if raw.get("delta") or any(self._expected[slot.name][1] != b.dtype for b in self.buckets for slot in b.slots):
            self.wire = [torch.zeros(b.numel, dtype=b.dtype, device=self._device) for b in self.buckets]
        if self.destination is not None:  # tensors are copied (cast) one by one into their destinations
            if self.wire is None:
                # A narrowed tensor is unpacked (sliced) from the scratch like a packed bucket.
                packed = [b.numel * b.dtype.itemsize for b in self.buckets if len(b.slots) > 1 or self.narrows]
                self.scratch = [torch.empty(max(packed), dtype=torch.uint8, device=self._device)
                                for _ in range(SCRATCH_BUCKETS)] if packed else []
            return
        for bucket, dtype in zip(self.buckets, engine_dtypes):
            mixed = [slot.name for slot in bucket.slots if self._expected[slot.name][1] != dtype]
            if mixed:  # a staging bucket is one flat tensor: one dtype
                raise ValueError(f"weight publish: the engine holds {mixed[:3]} in another dtype than "
                                 f"{bucket.slots[0].name} ({dtype}), but they travel in one bucket")
        self.buffer_sets = [[torch.empty(b.numel, dtype=d, device=self._device)
                             for b, d in zip(self.buckets, engine_dtypes)] for _ in range(2)]

    def _wait_key(self, key: str) -> None:
        """Poll until the key exists, noticing a stop request; no overall limit (a learner step may be
        slow). `check` rather than a timed `wait`: the latter logs a warning on every timeout."""
        while not self.store.check([key]):
            if self.should_stop():
                raise _Stopped()
            time.sleep(HEADER_POLL_S)

    def _run(self) -> None:
        try:
            self._load_spec()
            if self.follower is not None and self.follower.group is None:  # a replacement: wait to be admitted
                self._join(self.follower.wait_for_epoch(self.should_stop, None))
            while True:
                self._wait_header()
                header = json.loads(self.store.get(header_key(self.next_index)))
                try:
                    self._receive(self.next_index, header)
                except (TimeoutError, RuntimeError) as exc:
                    if self.follower is None:
                        raise
                    # A member died during this publish: its version is dropped, the next epoch's publish is whole.
                    self._join(self.follower.wait_for_epoch(self.should_stop, self.follower.rejoin_timeout_s, exc))
                    continue
                self.next_index += 1
        except _Stopped:
            pass
        except BaseException as exc:  # surfaced to the sampler loop through `error`
            self.error = exc

    def _join(self, first_publish: int | None) -> None:
        """Receive over the follower's new group from `first_publish` on (None: the run stops)."""
        if first_publish is None:
            raise _Stopped()
        self.group, self.next_index = self.follower.group, first_publish

    def _wait_header(self) -> None:
        """Until the next publish's header exists; with a follower, moving to a newer epoch meanwhile (the learner
        records an epoch before it builds its group and writes the epoch's first header)."""
        key = header_key(self.next_index)
        while True:
            if self.follower is not None:
                first = self.follower.follow()
                if first is not None:
                    self._join(first)
                    key = header_key(self.next_index)
            # Between epochs (the last one's group did not form) nothing is received: the learner records the next.
            if (self.follower is None or self.follower.group is not None) and self.store.check([key]):
                return
            if self.should_stop():
                raise _Stopped()
            time.sleep(HEADER_POLL_S if self.follower is None else 0.01)

    def _receive(self, index: int, header: dict) -> None:
        version = header["version"]
        deadline = time.monotonic() + self.timeout.total_seconds()
        if self.newest is not None and version <= self.newest:
            self._check_sums(index, version, header, self._receive_again(version, header), deadline)
            return
        self.began = version
        # The engine may still run on, or not yet have applied, the weights this set last received (a
        # staged version is views into its buffers, and a TP engine applies exactly the version its
        # lead plans, not always the newest); the set is free once the engine has moved past it.  With a
        # destination the same wait keeps the engine at two versions' storage: the one it runs and the
        # one arriving (the storage of the version it moved past is what `destination` hands out).
        held = self.held_versions[self.next_set]
        while held is not None and self.current_version() <= held:
            if self.abandoned is not None and self.abandoned(self.newest):
                self._forget_newest()  # its set is the next one now, and holds nothing
                break
            if self.should_stop():
                raise _Stopped()
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight receive: the engine did not move past version {held} within "
                                   f"{self.timeout.total_seconds():.0f}s (its staging buffers are needed for "
                                   f"version {version})")
            time.sleep(0.001)
        set_index = self.next_set
        self.held_versions[set_index] = version
        try:
            if self.destination is not None:
                dest = self.destination(version)
                got = self._receive_into(version, dest, header) if self.wire is None else \
                    self._receive_wire(version, header,
                                       lambda i, wire: _unpack(wire, self.buckets[i], dest, self.narrow))
                tensors = {slot.name: dest[slot.name] for bucket in self.buckets for slot in bucket.slots}
            else:
                buffers = self.buffer_sets[set_index]
                got = self._receive_buckets(version, buffers, header) if self.wire is None else \
                    self._receive_wire(version, header, lambda i, wire: buffers[i].copy_(wire))
                tensors = {slot.name: self.narrow(slot.name,
                                                  buffer[slot.offset:slot.offset + slot.numel].view(slot.shape))
                           for bucket, buffer in zip(self.buckets, buffers) for slot in bucket.slots}
            self._check_sums(index, version, header, got, deadline)
            self.on_version(version, tensors, header.get("extra", {}))
        except BaseException:
            # Part-written, or not taken: the set holds no version, and the next new version lands in it again.
            self.held_versions[set_index] = None
            raise
        self.newest = version

    def _forget_newest(self) -> None:
        """The newest version handed over will never be applied (another part never got it and has moved past it):
        its staging set is free, and the version the other set holds is the newest again. Without this, a survivor
        that got some parts of a version and missed another (fault.on_failure=replace) would have the engine run the
        version before it from the one set left, and the next version's part would wait on it for ever."""
        index = self.held_versions.index(self.newest)
        self.held_versions[index] = None
        self.newest = self.held_versions[1 - index]

    @property
    def next_set(self) -> int:
        """The staging set the next new version lands in: the one not holding the newest (a set whose receive
        failed holds nothing, and it is that one, so the next version lands in it again)."""
        return 0 if self.newest is None else 1 - self.held_versions.index(self.newest)

    def _receive_again(self, version: int, header: dict) -> list[list[int]]:
        """A version this receiver already handed over (staged or applied), published again: the learner sends a
        version again at once over a new membership epoch when its publish failed with every sampler alive, and
        the members it reached got it then. The broadcast is collective, so the bytes are taken (and checked), but
        the duplicate is discarded, never staged: a second staging would fill the other staging set with the same
        version, and the next version, needing the first set back, would wait for the engine to move past the
        version it runs (until publish.timeout_s failed that publish too); vLLM refuses a version that is not
        newer. The wire buffers take it where there are some (they are the delta base, which must be the source's
        words: this publish is whole, the source's new base); otherwise one buffer of the largest bucket, bucket
        by bucket (never the engine's staging storage, which the engine may run from). Its checksums."""
        if self.wire is not None:
            return self._receive_wire(version, header, lambda i, wire: None)
        # (a sender's share of a small model may hold no bucket: then there is nothing to take)
        sink = torch.empty(max((b.numel * b.dtype.itemsize for b in self.buckets), default=0), dtype=torch.uint8,
                           device=self._device)
        got = []
        for i, bucket in enumerate(self.buckets):
            target = sink[:bucket.numel * bucket.dtype.itemsize].view(bucket.dtype)
            _Broadcast(self.group, target, self.timeout,
                       f"receive version {version} again (held already) bucket {i + 1}/{len(self.buckets)}").wait()
            if header["checksum"]:
                got.append(bucket_checksum(target))
        return got

    def _check_sums(self, index: int, version: int, header: dict, got: list[list[int]], deadline: float) -> None:
        """With checksums on, the received buckets' sums must be the source's."""
        if header["checksum"]:
            sent = self._sent_checksums(index, deadline)
            if got != sent:
                bad = [i for i, (a, b) in enumerate(zip(got, sent)) if a != b]
                raise RuntimeError(f"weight publish: checksum mismatch for version {version} in buckets {bad}")

    def _receive_buckets(self, version: int, buffers: list[torch.Tensor], header: dict) -> list[list[int]]:
        """Every bucket straight into the staging set (wire = engine dtype, no deltas); their checksums."""
        receives = [_Broadcast(self.group, buffer, self.timeout, f"receive version {version} bucket {i + 1}/{len(buffers)}")
                    for i, buffer in enumerate(buffers)]
        got = []
        for receive, buffer in zip(receives, buffers):
            receive.wait()
            if header["checksum"]:  # sum bucket i while the later ones are still arriving
                got.append(bucket_checksum(buffer))
        return got

    def _receive_into(self, version: int, dest: dict[str, torch.Tensor], header: dict) -> list[list[int]]:
        """Every bucket into `dest` (wire = engine dtype, no deltas): a bucket of one tensor whose
        destination is contiguous is received straight into it, the others into the scratch ring and
        unpacked while the later ones arrive (receives are posted as far ahead as buffers allow, in
        bucket order: the order the source sends); their checksums."""
        count, free = len(self.buckets), list(self.scratch)
        direct = [len(b.slots) == 1 and not self.narrows and dest[b.slots[0].name].is_contiguous()
                  for b in self.buckets]
        posted: collections.deque = collections.deque()
        got, ahead = [], 0
        for i, bucket in enumerate(self.buckets):
            while ahead < count:
                later = self.buckets[ahead]
                nbytes = later.numel * later.dtype.itemsize
                fits = bool(free) and free[-1].numel() >= nbytes
                if direct[ahead]:
                    target, scratch = dest[later.slots[0].name].view(-1), None
                elif fits or not posted:
                    # A lone non-contiguous tensor larger than the scratch gets a buffer of its own, one at a time.
                    scratch = free.pop() if fits else None
                    target = (scratch if fits else torch.empty(nbytes, dtype=torch.uint8, device=self._device))
                    target = target[:nbytes].view(later.dtype)
                else:
                    break  # no buffer free: unpack the oldest first
                posted.append((target, scratch, _Broadcast(self.group, target, self.timeout,
                                                            f"receive version {version} bucket {ahead + 1}/{count}")))
                ahead += 1
            target, scratch, receive = posted.popleft()
            receive.wait()
            if header["checksum"]:
                got.append(bucket_checksum(target))
            if not direct[i]:
                _unpack(target, bucket, dest, self.narrow)
            if scratch is not None:
                free.append(scratch)
        return got

    def _receive_wire(self, version: int, header: dict, deliver: Callable[[int, torch.Tensor], None]) -> list[list[int]]:
        """Every bucket into the wire buffers (whole, or a delta patching the previous version's words),
        checksummed there and handed to `deliver(bucket index, words)` (which casts them into the staging
        set or the destination); their checksums."""
        got = []
        for i, wire in enumerate(self.wire):
            what = f"receive version {version} bucket {i + 1}/{len(self.wire)}"
            encoding, count = WHOLE, 0
            if header.get("delta"):
                delta_header = torch.empty(2, dtype=torch.int64)
                _Broadcast(self.group, delta_header, self.timeout, f"{what} (its delta header)").wait()
                encoding, count = delta_header.tolist()
            if encoding == WHOLE:
                _Broadcast(self.group, wire, self.timeout, what).wait()
            else:
                payload = torch.empty(delta_size(encoding, count, wire.numel(), wire.element_size()),
                                      dtype=torch.uint8, device=wire.device)
                _Broadcast(self.group, payload, self.timeout, what).wait()
                apply_delta(wire, encoding, count, payload)
            if header["checksum"]:
                got.append(bucket_checksum(wire))
            deliver(i, wire)
        return got

    def _sent_checksums(self, index: int, deadline: float) -> list[list[int]]:
        """The source's sums of publish `index`: written right after its last bucket was sent, so normally
        already there once every bucket arrived."""
        key = checksums_key(index)
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight receive: every bucket of publish {index} arrived but its checksums "
                                   f"({key}) were not in the store within {self.timeout.total_seconds():.0f}s")
            time.sleep(HEADER_POLL_S)
        return json.loads(self.store.get(key))

class _Stopped(Exception):
    pass


def _whole(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _unpack(flat: torch.Tensor, bucket: Bucket, dest: dict[str, torch.Tensor],
            narrow: Callable[[str, torch.Tensor], torch.Tensor] = _whole) -> None:
    """Copy (cast) each tensor of a received flat bucket (its `narrow`ed part) into its destination view."""
    for slot in bucket.slots:
        dest[slot.name].copy_(narrow(slot.name, flat[slot.offset:slot.offset + slot.numel].view(slot.shape)))


def check_spec(spec: list[tuple[str, tuple[int, ...], torch.dtype]],
               expected: dict[str, tuple[torch.Size, torch.dtype]], partial: bool = False) -> None:
    """The learner's tensors must be exactly the engine's: same names and shapes, and the same dtypes
    or both floating point (publish.dtype: cast on arrival); with `partial`, a subset: one pipeline
    stage's share."""
    names = {n for n, _, _ in spec}
    missing, unexpected = [] if partial else sorted(set(expected) - names), sorted(names - set(expected))
    if missing or unexpected:
        raise ValueError(f"weight publish: learner and sampler disagree on tensor names; "
                         f"missing on the learner: {missing[:5]}, unknown to the sampler: {unexpected[:5]}")
    for name, shape, dtype in spec:
        ref_shape, ref_dtype = expected[name]
        castable = dtype.is_floating_point and ref_dtype.is_floating_point  # publish.dtype: cast on arrival
        if tuple(ref_shape) != shape or (ref_dtype != dtype and not castable):
            raise ValueError(f"weight publish: {name} is {list(shape)} {dtype} on the learner but "
                             f"{list(ref_shape)} {ref_dtype} on the sampler")


class StagedReceiver:
    """Sampler side: one WeightReceiver per publish part (a learner pipeline stage's layers, or one
    sender's share of them), each receiving its part's tensors; a version reaches `on_version` once
    every part delivered it.

    `stages` is [(group, store)] in part order (megarl.distributed.topology.publish_groups and
    publish_stage_store); `extra` comes from part 0, the publisher that owns the run's bookkeeping.
    `followers` (fault.on_failure=replace): one membership.EpochFollower per part, in part order; every part follows
    the same epoch records, each over its own group.
    """

    def __init__(self, stages: list, expected: dict[str, tuple[torch.Size, torch.dtype]], device: torch.device,
                 on_version: Callable[[int, dict[str, torch.Tensor], dict], None],
                 current_version: Callable[[], int], should_stop: Callable[[], bool], timeout_s: float,
                 destination: Callable[[int], dict[str, torch.Tensor]] | None = None,
                 narrow: Callable[[str, torch.Tensor], torch.Tensor] | None = None, followers: list | None = None):
        self.expected, self.on_version = expected, on_version
        self.parts: dict[int, dict[int, tuple[dict, dict]]] = {}  # version -> stage -> (tensors, extra)
        self.lock = threading.Lock()
        self.merge_error: BaseException | None = None
        self.receivers = [
            WeightReceiver(group, store, expected, device,
                           on_version=lambda v, t, e, stage=stage: self._on_part(stage, v, t, e),
                           current_version=current_version, should_stop=should_stop, timeout_s=timeout_s,
                           partial=True, destination=destination, narrow=narrow,
                           follower=None if followers is None else followers[stage], abandoned=self._abandoned)
            for stage, (group, store) in enumerate(stages)]

    def start(self) -> "StagedReceiver":
        for receiver in self.receivers:
            receiver.start()
        return self

    @property
    def error(self) -> BaseException | None:
        return self.merge_error or next((r.error for r in self.receivers if r.error is not None), None)

    def join(self, timeout_s: float) -> None:
        for receiver in self.receivers:
            receiver.thread.join(timeout_s)

    def _abandoned(self, version: int) -> bool:
        """Will `version` never be whole? True (and its parts are dropped) once every part that lacks it has begun a
        later version: its receive of it failed (fault.on_failure=replace) and the learner went on without it."""
        with self.lock:
            parts = self.parts.get(version)
            if parts is None or not all(stage in parts or (receiver.began is not None and receiver.began > version)
                                        for stage, receiver in enumerate(self.receivers)):
                return False
            del self.parts[version]
            return True

    def _on_part(self, stage: int, version: int, tensors: dict, extra: dict) -> None:
        with self.lock:
            parts = self.parts.setdefault(version, {})
            parts[stage] = (tensors, extra)
            if len(parts) < len(self.receivers):
                return
            del self.parts[version]
        merged = {}
        for stage in range(len(self.receivers)):
            merged.update(parts[stage][0])
        if set(merged) != set(self.expected):
            self.merge_error = ValueError(
                f"weight publish: the pipeline stages of version {version} together miss "
                f"{sorted(set(self.expected) - set(merged))[:5]}")
            raise self.merge_error
        self.on_version(version, merged, parts[0][1])
