"""The sample queue over real ZeroMQ sockets between processes, its bounded waits, and what it does with
messages from a process outside the run (tests/distributed/queue_attacker.py)."""
import multiprocessing as mp
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from megarl.distributed.queue import QueueReceiver, QueueSender, max_message_bytes
from megarl.distributed.signed_store import SignedStore
from megarl.distributed.wire import encode_group
from megarl.protocols import Sample
from tests.helpers import REPO

KEY = b"the run secret of these tests...".hex().encode()
ATTACKER = Path(__file__).with_name("queue_attacker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sample(i: int, versions: list[int]) -> Sample:
    return Sample(group_id=f"s0-g{i}", prompt="1+1=", completion="2", prompt_ids=[1, 2, 3, 4], token_ids=[5, 6],
                  logprobs=[-0.5, -0.1], versions=versions, reward=1.0, finish_reason="stop", sampler_rank=1)


def _send(port: int, n: int) -> None:
    store = SignedStore(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20)), KEY)
    sender = QueueSender(store, timeout_s=20, key=KEY, sender=1)
    for i in range(n):
        sender.send_group([sample(i, [i, i + 1]), sample(i, [i, i])], {"tokens_decoded": float(i)})
    sender.close()


def test_groups_arrive_whole_and_in_order_from_another_process():
    port = free_port()
    store = SignedStore(dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=20)), KEY)
    receiver = QueueReceiver(store, "127.0.0.1", KEY, max_bytes=1 << 20)
    proc = mp.get_context("spawn").Process(target=_send, args=(port, 5))
    proc.start()
    messages = [receiver.recv_group(timeout_s=30) for _ in range(5)]
    proc.join(30)
    assert proc.exitcode == 0
    groups = [g for g, _ in messages]
    assert [stats["tokens_decoded"] for _, stats in messages] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [g[0].group_id for g in groups] == [f"s0-g{i}" for i in range(5)]
    assert groups[3][0].versions == [3, 4] and groups[3][1].logprobs == [-0.5, -0.1]
    receiver.close()


def test_receive_timeout_names_the_address():
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=5))
    receiver = QueueReceiver(store, "127.0.0.1", KEY, max_bytes=1 << 20)
    with pytest.raises(TimeoutError, match=f"no group arrived at {receiver.address} within 0s"):
        receiver.recv_group(timeout_s=0.2)
    receiver.close()


def test_sender_without_a_learner_fails_within_its_timeout():
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=5))
    with pytest.raises(TimeoutError, match="did not publish its queue address within 1s"):
        QueueSender(store, timeout_s=1, key=KEY, sender=1)


def attack(mode: str, receiver: QueueReceiver, *args: str) -> None:
    """Run the attacker as its own process (it knows the queue's address, not the run secret)."""
    proc = subprocess.run([sys.executable, str(ATTACKER), mode, receiver.address, *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]


def receive_after_attack(receiver: QueueReceiver, store, expect_rejected: int, seen=None) -> list[Sample]:
    """A genuine sampler's group still arrives after the attack; the attack's messages are drained and counted:
    the receiver reads until it has seen them all (`expect_rejected` refused, and `seen()` where given), however
    late a loaded machine delivers them -- never a group from them."""
    sender = QueueSender(store, timeout_s=20, key=KEY, sender=1)
    sender.send_group([sample(7, [0, 0])])
    group, _ = receiver.recv_group(timeout_s=30)
    deadline = time.monotonic() + 60
    while receiver.rejected < expect_rejected or (seen is not None and not seen()):
        assert time.monotonic() < deadline, f"the attack was not seen within 60 s ({receiver.rejected} rejected)"
        with pytest.raises(TimeoutError):  # whatever the attacker sent and was not read yet is read here
            receiver.recv_group(timeout_s=0.2)
    with pytest.raises(TimeoutError):  # ... and nothing more arrives
        receiver.recv_group(timeout_s=0.5)
    sender.close()
    assert receiver.rejected == expect_rejected
    return group


@pytest.fixture
def queue():
    port = free_port()
    store = SignedStore(dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=20)), KEY)
    receiver = QueueReceiver(store, "127.0.0.1", KEY, max_bytes=max_message_bytes(0, 8, 64))
    yield port, store, receiver
    receiver.close()


def test_a_pickle_from_outside_the_run_runs_nothing_and_is_reported(queue, tmp_path, capsys):
    _, store, receiver = queue
    marker = tmp_path / "pwned"
    attack("pickle", receiver, str(marker))
    group = receive_after_attack(receiver, store, expect_rejected=1)
    assert not marker.exists()
    assert group[0].group_id == "s0-g7"
    out = capsys.readouterr().out
    assert "dropped a message from 127.0.0.1" in out and "not a megarl message" in out


def test_a_forged_group_without_the_secret_is_not_delivered(queue, tmp_path, capsys):
    _, store, receiver = queue
    # The format is public: megarl's own encoder with a key that is not the run's, and a tag with one bit flipped.
    forged = [sample(9, [0, 0])]
    wrong_key = tmp_path / "wrong_key"
    wrong_key.write_bytes(encode_group(forged, {}, receiver.session, 1, 10**6, b"not the run secret" * 4))
    flipped = bytearray(encode_group(forged, {}, receiver.session, 1, 10**6 + 1, KEY))
    flipped[-1] ^= 1
    (tmp_path / "flipped").write_bytes(bytes(flipped))
    attack("send", receiver, str(wrong_key), str(tmp_path / "flipped"))
    group = receive_after_attack(receiver, store, expect_rejected=2)
    assert [s.group_id for s in group] == ["s0-g7"]
    assert receiver.counters()["queue/rejected"] == 2.0
    assert "authentication failed" in capsys.readouterr().out


def _peak_rss_kb() -> int:
    return int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("VmHWM")).split()[1])


def test_a_100mb_message_is_refused_unread_and_the_next_group_arrives(queue):
    _, store, receiver = queue
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets the peak RSS (VmHWM) to the current RSS
    except OSError:
        pytest.skip("cannot reset the peak RSS here")
    before = _peak_rss_kb()
    attack("huge", receiver)
    # libzmq drops the connection that carried it
    group = receive_after_attack(receiver, store, expect_rejected=0, seen=lambda: receiver.disconnects >= 1)
    assert group[0].group_id == "s0-g7"
    assert _peak_rss_kb() - before < 30_000, "the receiver held the 100 MB message"


def test_a_replayed_group_is_refused(queue):
    _, store, receiver = queue
    sender = QueueSender(store, timeout_s=20, key=KEY, sender=1)
    sender.send_group([sample(1, [0, 0])])
    sender.sequence = 0  # the same sequence number again: what a recorded message carries
    sender.send_group([sample(2, [0, 0])])
    sender.send_group([sample(3, [0, 0])])
    assert [receiver.recv_group(timeout_s=20)[0][0].group_id for _ in range(2)] == ["s0-g1", "s0-g3"]
    assert receiver.rejected == 1
    sender.close()
