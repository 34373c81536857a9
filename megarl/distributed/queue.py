"""The sample queue: finished, scored groups travel from samplers to the learner over ZeroMQ.

The learner binds a PULL socket and publishes its address and a per-queue session nonce in the
rendezvous store under `queue/address` (a signed record: megarl.distributed.signed_store); every
sampler connects a PUSH socket. One message is one group (the G samples of one prompt), so group
advantages are computed from complete groups, plus the sender's running counters (engine
throughput, swaps, busy time), so sampler health reaches metrics.jsonl without another channel.

Messages are megarl.distributed.wire GROUP messages, never pickle: HMAC-authenticated with the run
secret, bound to this queue's session, sequence-numbered per sender (a replay is refused), and
validated field by field. A message that fails is dropped and counted (`rejected`), and reported
in a console line naming its origin (peer address, claimed sender), at most every REPORT_S; the run
goes on. A message over `max_message_bytes` never reaches the learner whole: ZMQ_MAXMSGSIZE makes
libzmq drop it, and its connection, while it is still arriving; a dropped connection is counted
(`disconnects`). Every wait is bounded and its error says what it waited for.
"""
from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from megarl.distributed.wire import Envelope, WireError, decode_group, encode_group
from megarl.protocols import Sample
from megarl.ratelimit import RateLimitedLine

ADDRESS_KEY = "queue/address"
CLOSE_LINGER_MS = 2000
REPORT_S = 10.0
# queue.max_message_mb = 0: a limit from the run's shapes. Per token: three 8-byte arrays (ids, log-probs,
# versions) and up to 100 bytes of decoded text (prompt and completion; a token decodes to a few bytes);
# plus 1 MiB for the fixed part (headers, stats, reward errors). MoE models add their routes per position.
BYTES_PER_TOKEN = 128
FIXED_BYTES = 1 << 20


def max_message_bytes(max_message_mb: float, group_size: int, max_seq_len: int, route_bytes_per_token: int = 0) -> int:
    """The queue's message size limit: queue.max_message_mb, or (0) derived from the group's shapes
    (`route_bytes_per_token`: an MoE model's routes, layers x top_k x the index's bytes)."""
    if max_message_mb > 0:
        return int(max_message_mb * (1 << 20))
    return group_size * max_seq_len * (BYTES_PER_TOKEN + route_bytes_per_token) + FIXED_BYTES


class QueueReceiver:
    """Learner side."""

    def __init__(self, store, host: str, key: bytes, max_bytes: int, vocab_size: int | None = None):
        # vocab_size: the model's; a token id at or above it is refused like any malformed message
        self.key, self.max_bytes, self.vocab_size = key, max_bytes, vocab_size
        self.session = os.urandom(8)
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        # libzmq refuses a longer message while reading its length prefix, and drops the connection.
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.last_sequence: dict[int, int] = {}
        self._rejected_line, self._disconnect_line = RateLimitedLine(REPORT_S), RateLimitedLine(REPORT_S)
        store.set(ADDRESS_KEY, json.dumps({"address": self.address, "session": self.session.hex()}))

    @property
    def rejected(self) -> int:
        return self._rejected_line.count

    @property
    def disconnects(self) -> int:
        return self._disconnect_line.count

    def counters(self) -> dict[str, float]:
        """Run totals for metrics.jsonl."""
        return {"queue/rejected": float(self.rejected), "queue/disconnects": float(self.disconnects)}

    def recv_group(self, timeout_s: float, on_wait: Callable[[], None] | None = None,
                   wait_slice_s: float = 1.0) -> tuple[list[Sample], dict[str, float]]:
        """The next valid group and its sampler's counters at the time it was sent (invalid messages are
        dropped, counted and reported on the way).

        While waiting, `on_wait()` runs every `wait_slice_s` (the learner checks sampler heartbeats
        there, so a hung sampler is named long before `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            events = dict(self.poller.poll(int(min(wait_slice_s, max(remaining, 0)) * 1000)))
            if self.monitor in events:
                self._drain_monitor()
            if self.socket in events:
                frame = self.socket.recv(copy=False)
                try:
                    envelope, group, stats = decode_group(frame.buffer, self.key, self.vocab_size)
                    self._check_envelope(envelope)
                    return group, stats
                except WireError as exc:
                    self._reject(f"from {frame.get('Peer-Address')} ({len(frame)} bytes): {exc}")
                continue
            if on_wait is not None:
                on_wait()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"sample queue: no group arrived at {self.address} within {timeout_s:.0f}s "
                                   f"(are the sampler ranks alive and generating?)")

    def _check_envelope(self, envelope: Envelope) -> None:
        if envelope.session != self.session:
            raise WireError(f"claimed sender {envelope.sender}: addressed to another queue session (a replay?)")
        last = self.last_sequence.get(envelope.sender, -1)
        if envelope.sequence <= last:
            raise WireError(f"claimed sender {envelope.sender}: sequence {envelope.sequence} after {last} (a replay?)")
        self.last_sequence[envelope.sender] = envelope.sequence

    def _drain_monitor(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._disconnect_line(f"sample queue at {self.address}: a sender's connection closed: a sampler that "
                                      f"exits, or a message over the limit of {self.max_bytes} bytes "
                                      f"(queue.max_message_mb), which is dropped unread with its connection")

    def _reject(self, why: str) -> None:
        self._rejected_line(f"sample queue at {self.address}: dropped a message {why}"[:800])

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close()
        self.socket.close()


class QueueSender:
    """Sampler side: `sender` is this sampler's global rank (its samples' sampler_rank)."""

    def __init__(self, store, timeout_s: float, key: bytes, sender: int, first_sequence: int = 0):
        # first_sequence: a replacement sampler numbers its groups above its predecessor's (membership.SHIFT)
        try:
            store.wait([ADDRESS_KEY], timedelta(seconds=timeout_s))
        except Exception as exc:
            raise TimeoutError(f"sample queue: the learner did not publish its queue address within "
                               f"{timeout_s:.0f}s: {exc}") from exc
        published = json.loads(store.get(ADDRESS_KEY))
        self.address, self.session = published["address"], bytes.fromhex(published["session"])
        self.key, self.sender, self.sequence = key, sender, first_sequence
        self.timeout_s = timeout_s
        self.socket = zmq.Context.instance().socket(zmq.PUSH)
        # On close, give queued groups a moment to reach the learner instead of dropping them.
        self.socket.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        self.socket.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        self.socket.connect(self.address)

    def send_group(self, group: list[Sample], sampler_stats: dict[str, float] | None = None) -> None:
        message = encode_group(group, sampler_stats or {}, self.session, self.sender, self.sequence, self.key)
        self.sequence += 1
        try:
            self.socket.send(message, copy=False)
        except zmq.Again:
            raise TimeoutError(f"sample queue: the learner at {self.address} did not take a group within "
                               f"{self.timeout_s:.0f}s") from None

    def close(self) -> None:
        self.socket.close()
