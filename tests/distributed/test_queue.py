"""The sample queue over real ZeroMQ sockets between processes, and its bounded waits."""
import multiprocessing as mp
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from megarl.distributed.queue import QueueReceiver, QueueSender
from megarl.protocols import Sample


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sample(i: int, versions: list[int]) -> Sample:
    return Sample(group_id=f"g{i}", prompt="1+1=", completion="2", prompt_ids=[1, 2, 3, 4], token_ids=[5, 6],
                  logprobs=[-0.5, -0.1], versions=versions, reward=1.0, finish_reason="stop", sampler_rank=1)


def _send(port: int, n: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
    sender = QueueSender(store, timeout_s=20)
    for i in range(n):
        sender.send_group([sample(i, [i, i + 1]), sample(i, [i])], {"tokens_decoded": float(i)})
    sender.close()


def test_groups_arrive_whole_and_in_order_from_another_process():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=20))
    receiver = QueueReceiver(store, "127.0.0.1")
    proc = mp.get_context("spawn").Process(target=_send, args=(port, 5))
    proc.start()
    messages = [receiver.recv_group(timeout_s=30) for _ in range(5)]
    proc.join(30)
    assert proc.exitcode == 0
    groups = [g for g, _ in messages]
    assert [stats["tokens_decoded"] for _, stats in messages] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [g[0].group_id for g in groups] == [f"g{i}" for i in range(5)]
    assert groups[3][0].versions == [3, 4] and groups[3][1].logprobs == [-0.5, -0.1]
    receiver.close()


def test_receive_timeout_names_the_address():
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=5))
    receiver = QueueReceiver(store, "127.0.0.1")
    with pytest.raises(TimeoutError, match=f"no group arrived at {receiver.address} within 0s"):
        receiver.recv_group(timeout_s=0.2)
    receiver.close()


def test_sender_without_a_learner_fails_within_its_timeout():
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=5))
    with pytest.raises(TimeoutError, match="did not publish its queue address within 1s"):
        QueueSender(store, timeout_s=1)
