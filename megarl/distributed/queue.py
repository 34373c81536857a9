"""The sample queue: finished, scored groups travel from samplers to the learner over ZeroMQ.

The learner binds a PULL socket (address published in the rendezvous store under `queue/address`);
every sampler connects a PUSH socket. One message is one group (the G samples of one prompt), so
group advantages are computed from complete groups, plus the sender's running counters (engine
throughput, swaps, busy time), so sampler health reaches metrics.jsonl without another channel.
Every wait is bounded and its error says what it waited for.
"""
from __future__ import annotations

import pickle
import time
from datetime import timedelta
from typing import Callable

import zmq

from megarl.protocols import Sample

ADDRESS_KEY = "queue/address"
CLOSE_LINGER_MS = 2000


class QueueReceiver:
    """Learner side."""

    def __init__(self, store, host: str):
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        store.set(ADDRESS_KEY, self.address)

    def recv_group(self, timeout_s: float, on_wait: Callable[[], None] | None = None,
                   wait_slice_s: float = 1.0) -> tuple[list[Sample], dict[str, float]]:
        """The next group and its sampler's counters at the time it was sent.

        While waiting, `on_wait()` runs every `wait_slice_s` (the learner checks sampler heartbeats
        there, so a hung sampler is named long before `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while not self.socket.poll(int(min(wait_slice_s, max(deadline - time.monotonic(), 0)) * 1000)):
            if on_wait is not None:
                on_wait()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"sample queue: no group arrived at {self.address} within {timeout_s:.0f}s "
                                   f"(are the sampler ranks alive and generating?)")
        return pickle.loads(self.socket.recv())

    def close(self) -> None:
        self.socket.close()


class QueueSender:
    """Sampler side."""

    def __init__(self, store, timeout_s: float):
        try:
            store.wait([ADDRESS_KEY], timedelta(seconds=timeout_s))
        except Exception as exc:
            raise TimeoutError(f"sample queue: the learner did not publish its queue address within "
                               f"{timeout_s:.0f}s: {exc}") from exc
        self.address = store.get(ADDRESS_KEY).decode()
        self.timeout_s = timeout_s
        self.socket = zmq.Context.instance().socket(zmq.PUSH)
        # On close, give queued groups a moment to reach the learner instead of dropping them.
        self.socket.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        self.socket.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        self.socket.connect(self.address)

    def send_group(self, group: list[Sample], sampler_stats: dict[str, float] | None = None) -> None:
        try:
            self.socket.send(pickle.dumps((group, sampler_stats or {}), protocol=pickle.HIGHEST_PROTOCOL))
        except zmq.Again:
            raise TimeoutError(f"sample queue: the learner at {self.address} did not take a group within "
                               f"{self.timeout_s:.0f}s") from None

    def close(self) -> None:
        self.socket.close()
