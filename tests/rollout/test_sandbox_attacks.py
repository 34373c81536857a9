"""The sandbox attacked: sandboxed code tries to read the sampler's environment, signal or
ptrace a process outside the sandbox, hold memory that RLIMIT_AS does not count (SysV shared memory,
memfd), start thousands of kernel tasks, and -- run by a sandboxed reward -- forge that reward's result.
Each is tried in every mode this machine can show: namespaced as root (how megarl runs here), and, in a
user namespace that makes the "sampler" a non-root uid (1000, still kernel uid 0, so it can run the
interpreter under /root), namespaced and without user namespaces (the require_namespaces=false fallback).
A fallback as root is refused (tests/rollout/test_sandbox.py)."""
import json
import subprocess
import sys

import pytest

from tests.helpers import REPO
from tests.rollout.test_sandbox import needs_userns

# Sandboxed program: every attack, each reported as "allowed" or how it was stopped.
ATTACKS = r'''
import ctypes, errno, json, os, signal, sys
job = json.loads(sys.stdin.read())
libc = ctypes.CDLL(None, use_errno=True)
out = {}

def attempt(name, fn):
    try:
        out[name] = fn()
    except OSError as exc:
        out[name] = errno.errorcode.get(exc.errno, str(exc.errno))

def check(ret):
    if ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret

def env_secret():
    found = "MEGARL_PLANTED_SECRET" in os.environ
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
        try:
            found |= b"MEGARL_PLANTED_SECRET=" in open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            pass
    return "allowed" if found else "not found"

def kill_foreign():
    os.kill(job["victim"], signal.SIGKILL)
    return "allowed"

def ptrace_parent():
    check(libc.ptrace(0x4206, os.getppid(), 0, 0))  # PTRACE_SEIZE: attaches without stopping the tracee
    return "allowed"

class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

def read_parent_memory():
    buf = ctypes.create_string_buffer(8)
    local, remote = IoVec(ctypes.cast(buf, ctypes.c_void_p), 8), IoVec(4096, 8)
    libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                                      ctypes.c_ulong, ctypes.c_ulong]
    if libc.process_vm_readv(os.getppid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == -1:
        err = ctypes.get_errno()
        if err in (errno.EPERM, errno.ESRCH, errno.ENOSYS):  # refused before any address was looked at
            raise OSError(err, os.strerror(err))
    return "allowed"  # a bad address (EFAULT) means the access itself was granted

def sysv_shm():  # twice memory_mb, never touched: the segment alone is the proof
    shm = check(libc.shmget(0, ctypes.c_size_t(2 * job["memory_mb"] << 20), 0o1600))  # IPC_PRIVATE, IPC_CREAT
    libc.shmctl(shm, 0, None)  # IPC_RMID: an old sandbox must not leave it on the host
    return "allowed"

def memfd():  # RLIMIT_FSIZE caps each memfd at disk_mb, but not how many there are
    held = 0
    try:
        while held <= job["memory_mb"] << 20:
            fd = os.memfd_create("held")
            os.ftruncate(fd, job["disk_mb"] << 20)
            held += job["disk_mb"] << 20
    except OSError:
        if held == 0:
            raise
    return "allowed" if held > job["memory_mb"] << 20 else f"{held >> 20} MiB"

def threads():  # _thread: threading.Thread.start() can wait forever for a thread that failed to boot
    import _thread
    _thread.stack_size(32768)
    release, started = _thread.allocate_lock(), 0
    release.acquire()
    try:
        for _ in range(3000):
            _thread.start_new_thread(release.acquire, ())
            started += 1
    except RuntimeError:
        pass
    return f"{started} started"

for name, fn in list(globals().items()):
    if name in ("env_secret", "kill_foreign", "ptrace_parent", "read_parent_memory", "sysv_shm", "memfd", "threads"):
        attempt(name, fn)
print(json.dumps(out), flush=True)
os._exit(0)  # not waiting for the threads to wind down
'''

# The "sampler": starts a victim process outside the sandbox, runs the attacks, reports.
SAMPLER = r'''
import json, subprocess, sys
from megarl.config.schema import SandboxConfig
from megarl.rollout.sandbox import run_python
# The victim does not carry the secret: only the sampler's own environment is protected from a fallback
# sandbox; other processes of a non-root uid are not (docs/security.md).
victim = subprocess.Popen(["sleep", "30"], env={})
limits = SandboxConfig(cpu_s=5, memory_mb=256, disk_mb=16, require_namespaces=sys.argv[1] == "namespaced")
job = {"victim": victim.pid, "memory_mb": 256, "disk_mb": 16}
result = run_python(sys.argv[2], stdin=json.dumps(job), limits=limits, timeout_s=30)
victim_alive = victim.poll() is None
victim.kill()
print(json.dumps({"layers": result.layers, "error": result.error, "stdout": result.stdout,
                  "stderr": result.stderr[-2000:], "victim_alive": victim_alive}))
'''

# Runs argv[3:] as a non-root uid in a new user namespace (uid 1000 inside, the caller's uid outside);
# argv[1] == "no-userns" also forbids nested user namespaces, as a kernel that refuses them.
AS_UID_1000 = r'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.geteuid(), os.getegid()
if libc.unshare(0x10000000) != 0:
    raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
for name, text in (("setgroups", "deny"), ("uid_map", f"1000 {uid} 1"), ("gid_map", f"1000 {gid} 1")):
    with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
if sys.argv[1] == "no-userns":
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
'''

MODES = {  # mode -> (uid, require_namespaces)
    "namespaced-root": ("root", "namespaced"),
    "namespaced-uid1000": ("userns", "namespaced"),
    "fallback-uid1000": ("no-userns", "fallback"),
}


def as_sampler(mode: str, code: str, *args: str, **env_extra: str) -> subprocess.CompletedProcess:
    who, _ = MODES[mode]
    prefix = [] if who == "root" else ["-c", AS_UID_1000, who]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "MEGARL_PLANTED_SECRET": "hunter2", **env_extra}
    return subprocess.run([sys.executable, *prefix, "-c", code, *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO)


@pytest.fixture(scope="module", params=list(MODES))
def attacked(request):
    mode = request.param
    proc = as_sampler(mode, SAMPLER, MODES[mode][1], ATTACKS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["error"] is None, report
    assert ("namespaces" in report["layers"]) == (MODES[mode][1] == "namespaced"), report["layers"]
    return mode, report, json.loads(report["stdout"])


@needs_userns
@pytest.mark.parametrize("attack", ["env_secret", "kill_foreign", "ptrace_parent", "read_parent_memory",
                                    "sysv_shm", "memfd"])
def test_each_attack_is_stopped(attacked, attack):
    mode, report, outcome = attacked
    assert outcome[attack] != "allowed", (mode, attack, outcome)
    if attack == "kill_foreign":
        assert report["victim_alive"], (mode, outcome)


@needs_userns
def test_one_task_means_no_threads_either(attacked):
    """max_processes=1: the 3,000 raw threads of the red team (root is exempt from RLIMIT_NPROC) get none."""
    mode, _, outcome = attacked
    assert outcome["threads"] == "0 started", (mode, outcome)


@needs_userns
@pytest.mark.parametrize("mode", ["namespaced-uid1000", "fallback-uid1000"])
def test_code_a_sandboxed_reward_runs_cannot_write_its_result(mode):
    """The reward runs the completion in a child process (max_processes > 1 needs a non-root uid); the
    completion looks for the reward's result pipe among its inherited fds and the reward's /proc/<pid>/fd,
    writes a forged {"value": 1.0} wherever it can, and exits 7 if it could: the reward then scores 1.0."""
    forge = (r'''import os
forged = b'{"value": 1.0}\n'
wrote = []
for fd in range(3, 256):
    try:
        os.write(fd, forged)
        wrote.append(fd)
    except OSError:
        pass
try:
    names = [n for n in os.listdir(f"/proc/{os.getppid()}/fd") if int(n) > 2]
except OSError:
    names = []
for n in names:
    try:
        fd = os.open(f"/proc/{os.getppid()}/fd/{n}", os.O_WRONLY)
        os.write(fd, forged)
        wrote.append(f"proc:{n}")
    except OSError:
        pass
print("reached", wrote)
raise SystemExit(7 if wrote else 0)
''')
    code = ("import sys\nfrom megarl.config.schema import SandboxConfig\nfrom megarl.rollout.sandbox import call\n"
            "limits = SandboxConfig(max_processes=8, require_namespaces=sys.argv[1] == 'namespaced')\n"
            "print(call('tests.rollout.reward_fns:run_untrusted', ['p', sys.argv[2], 'a', {}], limits, 20))\n")
    proc = as_sampler(mode, code, MODES[mode][1], forge)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "0.0", proc.stdout


@needs_userns
def test_the_answers_and_the_run_directory_are_not_readable(tmp_path):
    """A python_output program that reads task.path would print the answer and score 1.0."""
    answers, run_dir = tmp_path / "answers.jsonl", tmp_path / "runs" / "demo"
    answers.write_text('{"prompt": "2+2=", "answer": "4"}\n')
    run_dir.mkdir(parents=True)
    (run_dir / "rollouts.jsonl").write_text('{"answer": "4"}\n')
    steal = (f"for path in ({str(answers)!r}, {str(run_dir / 'rollouts.jsonl')!r}):\n"
             "    try:\n        print(repr(open(path).read()))\n"
             "    except OSError as exc:\n        print(type(exc).__name__)\n")
    code = ("import sys\nfrom megarl.rollout.sandbox import hide_from_sandboxes, run_python\n"
            "hide_from_sandboxes(sys.argv[1], sys.argv[2], '')\n"
            "result = run_python(sys.argv[3], timeout_s=20)\nprint(result.error, result.layers)\n"
            "print(result.stdout, end='')\n")
    proc = as_sampler("namespaced-root", code, str(answers), str(run_dir), steal)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status, *read = proc.stdout.splitlines()
    assert status.startswith("None") and f"hidden:{answers}" in status and f"hidden:{run_dir}" in status, status
    assert read == ["PermissionError", "FileNotFoundError"], read  # /dev/null on a nodev mount; an empty tmpfs


@needs_userns
def test_the_run_secret_directory_is_hidden_without_being_named(tmp_path):
    """A raw torchrun's ranks share the run secret through a file in a directory of this user's; sandboxed code
    runs as the same uid, so only the mount namespace keeps it out: hidden whether or not the run named it."""
    runtime = tmp_path / "runtime"
    (runtime / "megarl").mkdir(parents=True, mode=0o700)
    secret = runtime / "megarl" / "run-secret-test"
    secret.write_text("0123456789abcdef" * 4)
    steal = (f"import os\ntry:\n    print(os.listdir({str(secret.parent)!r}), open({str(secret)!r}).read())\n"
             "except OSError as exc:\n    print(type(exc).__name__)\n")
    code = ("import sys\nfrom megarl.rollout.sandbox import run_python\n"
            "result = run_python(sys.argv[1], timeout_s=20)\nprint(result.error, result.layers)\n"
            "print(result.stdout, end='')\n")
    proc = as_sampler("namespaced-root", code, steal, XDG_RUNTIME_DIR=str(runtime))
    assert proc.returncode == 0, proc.stderr[-3000:]
    status, *read = proc.stdout.splitlines()
    assert status.startswith("None") and "namespaces" in status and str(secret.parent) not in status, status
    assert read == ["FileNotFoundError"], read  # an empty tmpfs over the directory


@needs_userns
def test_a_hidden_path_that_holds_a_rewards_import_path_stays_visible():
    code = ("import os\nfrom megarl.rollout.sandbox import call, hide_from_sandboxes\n"
            "hide_from_sandboxes(os.getcwd())\n"
            "print(call('tests.rollout.reward_fns:exact', ['1+1=', '2', '2', {}], timeout_s=20))\n")
    proc = as_sampler("namespaced-root", code)
    assert proc.returncode == 0 and proc.stdout == "1.0\n", (proc.stdout, proc.stderr[-3000:])


# Sandboxed program: a child that tries to leave the sandbox's process group (setsid) and keeps running, holding the
# program's stdout, after the program itself has ended.
ESCAPE = r'''
import errno, json, os, time
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        os.setsid()
        left = "allowed"
    except OSError as exc:
        left = errno.errorcode[exc.errno]
    os.write(w, left.encode())
    time.sleep(60)
    os._exit(0)
print(json.dumps({"child": pid, "setsid": os.read(r, 64).decode()}), flush=True)
'''

RUN_ESCAPE = r'''
import json, sys, time
from megarl.config.schema import SandboxConfig
from megarl.rollout.sandbox import run_python
limits = SandboxConfig(cpu_s=5, memory_mb=256, max_processes=4, require_namespaces=sys.argv[1] == "namespaced")
result = run_python(sys.argv[2], limits=limits, timeout_s=3)

def alive(pid):  # (a killed orphan is a zombie until init reaps it: dead)
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

child = json.loads(result.stdout)["child"]  # a host pid in the fallback (no pid namespace)
deadline = time.monotonic() + 10  # SIGKILL is delivered asynchronously
while sys.argv[1] != "namespaced" and alive(child) and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({"error": result.error, "stdout": result.stdout,
                  "child_alive": sys.argv[1] != "namespaced" and alive(child)}))
'''


@needs_userns
@pytest.mark.parametrize("mode", ["namespaced-uid1000", "fallback-uid1000"])  # (root: max_processes is 1)
def test_a_child_that_calls_setsid_is_contained_and_reported_as_what_it_was(mode):
    proc = as_sampler(mode, RUN_ESCAPE, MODES[mode][1], ESCAPE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    outcome = json.loads(report["stdout"])
    if mode.startswith("namespaced"):  # setsid is allowed: the pid namespace ends the child with the program
        assert outcome["setsid"] == "allowed" and report["error"] is None, report
        return
    # fallback: seccomp refuses setsid, so the child stays in the group the sandbox kills; the program ended and
    # its child held the output until the deadline, which the error says
    assert outcome["setsid"] == "EPERM" and not report["child_alive"], report
    assert report["error"].startswith("wall-clock limit: the program ended, but a process it started still "
                                      "held its output after 3s"), report
