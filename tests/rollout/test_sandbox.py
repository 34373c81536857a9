"""The sandbox: model-written code runs in a throw-away, limited process, and whatever it tries --
writing outside its directory, a fork bomb, sleeping forever, 10 GB, a socket -- is contained and
reported as an error string, never raised into (or hanging) the caller."""
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from megarl.config.schema import SandboxConfig
from megarl.rollout.sandbox import FunctionWorker, SandboxError, call, probe, run_python
from tests.helpers import REPO

FNS = "tests.rollout.reward_fns"
FAST = SandboxConfig(cpu_s=2, memory_mb=256)
ALL_LAYERS = ("process", "namespaces", "readonly-fs", "tmpfs-workdir", "pid-namespace", "net-namespace",
              "rlimits", "seccomp")


def userns_available() -> bool:
    """Asked independently of megarl (util-linux), so a broken sandbox cannot skip its own tests."""
    return subprocess.run(["unshare", "--user", "--map-root-user", "true"], capture_output=True).returncode == 0


needs_userns = pytest.mark.skipif(not userns_available(), reason="this kernel refuses unprivileged user namespaces")


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """Sandbox work directories go under tmp_path, so the test can see that they are removed."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@needs_userns
def test_every_layer_applies_on_this_machine():
    assert probe() == ALL_LAYERS


def test_a_program_gets_its_stdin_and_its_output_is_captured(private_tmp):
    result = run_python("import sys\nname = sys.stdin.read()\nprint(f'hello {name}')\nprint('err', file=sys.stderr)",
                        stdin="world", limits=FAST, timeout_s=10)
    assert (result.error, result.returncode, result.stdout, result.stderr) == (None, 0, "hello world\n", "err\n")
    assert list(private_tmp.iterdir()) == []  # the throw-away work directory is gone


def test_the_environment_and_directory_are_fresh(private_tmp, monkeypatch):
    monkeypatch.setenv("MEGARL_SECRET_TOKEN", "s3cret")
    src = ("import os\nopen('left.txt', 'w').write('x')\n"
           "print(os.environ.get('MEGARL_SECRET_TOKEN'), os.environ['HOME'] == os.getcwd() == os.environ['TMPDIR'])")
    first = run_python(src, limits=FAST, timeout_s=10)
    assert first.stdout == "None True\n", first.error
    second = run_python("import os\nprint(os.listdir('.'))", limits=FAST, timeout_s=10)
    assert "left.txt" not in second.stdout  # nothing survives from one run to the next


def test_numpy_imports_although_threads_are_refused():
    """max_processes=1 refuses every thread; OpenBLAS would die (SIGINT) at import without its one-thread setting."""
    result = run_python("import numpy\nprint(numpy.ones((64, 64)).dot(numpy.ones(64)).sum())", limits=FAST,
                        timeout_s=20)
    assert (result.error, result.stdout) == (None, "4096.0\n"), result.stderr[-500:]


@needs_userns
def test_host_processes_are_invisible():
    result = run_python("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))",
                        limits=FAST, timeout_s=10)
    assert result.stdout == "[1, 2]\n", result.error  # the waiting pid 1 and the program itself


@needs_userns
@pytest.mark.parametrize("target", [str(REPO / "ESCAPED.txt"), "/tmp/megarl-escaped.txt", "../escaped.txt"])
def test_writing_outside_the_work_directory_is_denied(target, private_tmp):
    result = run_python(f"open({target!r}, 'w').write('escaped')", limits=FAST, timeout_s=10)
    assert "Read-only file system" in result.error, result.error
    assert not os.path.exists(target if target.startswith("/") else private_tmp / "escaped.txt")


ESCAPES = {
    "fork bomb": ("import os\nwhile True:\n    os.fork()", "PermissionError"),
    "subprocess": ("import subprocess\nsubprocess.run(['true'])", "PermissionError"),
    # max_processes=1 is one task: seccomp refuses the first thread.
    "thread bomb": ("import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(60,)).start()",
                    "RuntimeError: can't start new thread"),
    "sleep forever": ("import time\ntime.sleep(3600)", "wall-clock limit: still running after 3s"),
    "10 GB": ("x = bytearray(10 << 30)", "MemoryError"),
    "busy loop": ("while True:\n    pass", "CPU-time limit: used more than 1s of CPU"),  # wall limit: see below
    "socket": ("import socket\nsocket.socket()", "PermissionError"),
    "huge file": ("open('big', 'wb').write(b'0' * (64 << 20))", "No space left on device|File too large"),
    "output flood": ("while True:\n    print('x' * 1000)", "output limit: more than 256 KiB on stdout"),
    "exception": ("1 / 0", "exit status 1: ZeroDivisionError: division by zero"),
    "exit status": ("raise SystemExit(3)", "exit status 3"),
    "self kill": ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", "killed by SIGSEGV"),
    # The true cause, not the waiting pid 1's failure to relay it (it reported "sandbox setup failed: OSError").
    "SIGKILL": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL: the CPU-time hard"),
}


@pytest.mark.parametrize("name", list(ESCAPES))
def test_escapes_are_contained_and_reported(name):
    source, expected = ESCAPES[name]
    # 1 s of CPU takes load/cores s of wall time: ~35 s at load 70 on 2 cores, where 10 s ran out first. The busy loop
    # ends at its CPU limit, so the wall limit costs nothing on an idle machine.
    wall = 120 if name == "busy loop" else 3
    start = time.monotonic()
    result = run_python(source, limits=SandboxConfig(cpu_s=1, memory_mb=256, disk_mb=16), timeout_s=wall)
    assert result.error is not None and re.search(expected, result.error), (result.error, result.stderr[-500:])
    assert time.monotonic() - start < wall + 2  # the deadline holds, whatever the code does


def test_a_socket_is_refused_unless_the_network_is_allowed():
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.2)
        meta = {"port": server.getsockname()[1]}
        with pytest.raises(SandboxError, match="PermissionError"):
            call(f"{FNS}:connect", ["p", "c", "a", meta], FAST, timeout_s=10)
        with pytest.raises(socket.timeout):
            server.accept()  # nothing got through
        assert call(f"{FNS}:connect", ["p", "c", "a", meta], SandboxConfig(network=True), timeout_s=10) == 1.0


def test_call_returns_plain_values_and_reports_failures():
    assert call(f"{FNS}:exact", ["1+1=", " 2 ", "2", {}], FAST, timeout_s=10) == 1.0
    assert call(f"{FNS}:where_am_i", ["p", "c", "a", {"parent_pid": os.getpid()}], FAST, timeout_s=10) == 1.0
    with pytest.raises(SandboxError, match=r"ValueError: cannot score 'x'"):
        call(f"{FNS}:raises", ["p", "x", "a", {}], FAST, timeout_s=10)
    with pytest.raises(SandboxError, match="cannot import module 'tests.rollout.nope'"):
        call("tests.rollout.nope:fn", [], FAST, timeout_s=10)
    with pytest.raises(SandboxError, match="exit status 3"):
        call(f"{FNS}:crash", ["p", "c", "a", {}], FAST, timeout_s=10)


def run_without_user_namespaces(code: str) -> subprocess.CompletedProcess:
    """`code` in a user namespace whose limit on nested user namespaces is 0: like a kernel that refuses them."""
    script = f"echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} -c \"$0\""
    return subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", script, code], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)


@needs_userns
def test_without_user_namespaces_it_refuses_and_as_root_it_refuses_the_fallback_too():
    """As root a fallback sandbox would run code as root; the non-root fallback runs (and is attacked) in
    tests/rollout/test_sandbox_attacks.py."""
    proc = run_without_user_namespaces(
        "from megarl.config.schema import SandboxConfig\nfrom megarl.rollout.sandbox import run_python\n"
        "print(run_python('print(1)').error)\n"
        "print(run_python('print(1)', limits=SandboxConfig(require_namespaces=False)).error)\n")
    refused, fallback_refused = proc.stdout.splitlines()
    assert "refuses an unprivileged user namespace" in refused and "require_namespaces=false" in refused
    assert "require_namespaces=false is refused for uid 0" in fallback_refused


def test_a_worker_s_start_up_is_not_counted_against_its_calls_deadline():
    """Importing the function (1 s here) is the worker's start-up, not the call: a 0.5 s deadline still holds it."""
    worker = FunctionWorker("tests.rollout.slow_import_reward:exact", timeout_s=0.5)
    try:
        assert worker("1+1=", "2", "2", {}) == 1.0
    finally:
        worker.close()


def test_worker_survives_hangs_and_crashes_within_its_deadline():
    worker = FunctionWorker(f"{FNS}:hang_on_nine", timeout_s=1.0)
    try:
        assert worker("1+1=", "2", "2", {}) == 1.0
        first_pid = worker.proc.pid
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="did not return within 1s"):
            worker("9+9=", "18", "18", {})
        assert time.monotonic() - start < 2.5
        with pytest.raises(ProcessLookupError):
            os.kill(first_pid, 0)  # the hung worker is gone, not leaked
        assert worker("1+2=", "4", "3", {}) == 0.0  # a new worker took over
    finally:
        worker.close()
    crashing = FunctionWorker(f"{FNS}:crash", timeout_s=5.0)
    with pytest.raises(SandboxError, match="exited with status 3"):
        crashing("p", "c", "a", {})
    crashing.close()


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for a reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("exit_how", ["os._exit", "SIGKILL"])
def test_a_rewards_children_die_with_the_process_that_called_it(tmp_path, exit_how):
    """A rank leaves with os._exit (megarl/distributed/lifetime.py), or is killed: neither runs cleanup
    code, and the reward worker's own children must still not outlive it."""
    pid_file = tmp_path / "pids"
    exit_now = "os._exit(0)" if exit_how == "os._exit" else "os.kill(os.getpid(), signal.SIGKILL)"
    # FunctionWorker is what a trusted UserReward calls (megarl/rollout/rewards.py); importing only the
    # sandbox module keeps this test free of torch's import time.
    code = ("import os, signal\nfrom megarl.rollout.sandbox import FunctionWorker\n"
            "reward = FunctionWorker('tests.rollout.reward_fns:spawns_children', timeout_s=10)\n"
            f"print([reward('1+1=', '2', '2', {{'pid_file': {str(pid_file)!r}}}) for _ in range(3)], flush=True)\n"
            + exit_now + "\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout == "[1.0, 1.0, 1.0]\n", proc.stderr[-2000:]
    pids = [int(line) for line in pid_file.read_text().split()]
    assert len(pids) == 3
    deadline = time.monotonic() + 10
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(running, pids)), [p for p in pids if running(p)]


def test_limits_that_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="sandbox.cpu_s: must be > 0"):
        SandboxConfig(cpu_s=0).check()
    with pytest.raises(ValueError, match="sandbox.memory_mb: must be >= 64"):
        SandboxConfig(memory_mb=32).check()
    if os.geteuid() == 0:
        with pytest.raises(ValueError, match="sandbox.max_processes: more than 1 cannot be enforced for uid 0"):
            SandboxConfig(max_processes=4).check()
