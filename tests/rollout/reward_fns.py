"""User reward functions for the reward and sandbox tests, as a user would write them:
fn(prompt, completion, answer, meta) -> float, referred to as "tests.rollout.reward_fns:NAME"."""
import os
import socket
import time
from pathlib import Path


def exact(prompt, completion, answer, meta):
    return float(completion.strip() == answer)


def hang_on_nine(prompt, completion, answer, meta):
    """Hangs for the prompts that contain a 9 (a bug on some inputs only), exact match otherwise."""
    if "9" in prompt:
        time.sleep(3600)
    return exact(prompt, completion, answer, meta)


def raises(prompt, completion, answer, meta):
    raise ValueError(f"cannot score {completion!r}")


def not_a_number(prompt, completion, answer, meta):
    return "1.0"


def crash(prompt, completion, answer, meta):
    os._exit(3)


def pid(prompt, completion, answer, meta):
    return float(os.getpid())


def where_am_i(prompt, completion, answer, meta):
    """1.0 iff it runs in a process other than meta["parent_pid"], with the working directory as HOME."""
    return float(os.getpid() != meta["parent_pid"] and os.environ["HOME"] == os.getcwd())


def write_outside(prompt, completion, answer, meta):
    Path(meta["target"]).write_text("escaped")
    return 1.0


def fork_bomb(prompt, completion, answer, meta):
    while True:
        os.fork()


def allocate_10gb(prompt, completion, answer, meta):
    return float(len(bytearray(10 << 30)))


def sleep_forever(prompt, completion, answer, meta):
    while True:
        time.sleep(1)


def connect(prompt, completion, answer, meta):
    socket.create_connection(("127.0.0.1", meta["port"]), timeout=2).close()
    return 1.0


def wrong_signature(prompt, completion):
    """A reward written for (prompt, completion) only: a wrong signature."""
    return 1.0


def returns_none(prompt, completion, answer, meta):
    return None


def returns_nan(prompt, completion, answer, meta):
    return float("nan")


def parse_float(prompt, completion, answer, meta):
    """Right on its answers, raises on any completion that is not a number (most of a young policy's)."""
    return float(float(completion.strip()) == float(answer))


def numpy_scalar(prompt, completion, answer, meta):
    """Rewards computed with numpy return numpy scalars, not floats."""
    import numpy

    return numpy.float32(completion.strip() == answer) + numpy.float32(0.5)  # float32: not a float subclass


def varies_on_one_prompt_in_eight(prompt, completion, answer, meta):
    """Zero-variance groups for 7 prompts in 8 (reward 0 whatever the completion); the rest score the
    completion's length parity, which varies within a group."""
    import zlib

    return float(len(completion) % 2) if zlib.crc32(prompt.encode()) % 8 == 0 else 0.0


def run_untrusted(prompt, completion, answer, meta):
    """A grader that runs the completion as a program in a child process, inheriting what it can
    (close_fds=False, as os.system would), and scores 1.0 iff the program exits with status 7: the
    attack program of tests/rollout/test_sandbox_attacks.py exits 7 when it reached the result channel."""
    import subprocess
    import sys

    return float(subprocess.run([sys.executable, "-c", completion], close_fds=False, timeout=10).returncode == 7)


def spawns_children(prompt, completion, answer, meta):
    """A (trusted) reward that starts a helper process per call and leaves it running, appending its pid
    to meta["pid_file"]."""
    import subprocess

    child = subprocess.Popen(["sleep", "120"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(meta["pid_file"], "a") as f:
        f.write(f"{child.pid}\n")
    return 1.0
